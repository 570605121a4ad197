"""EAGLE training pieces on a tiny target: the ShareGPT reader keeps whole records of a cut-off file, training
steps lower the loss, and the acceptance count is vLLM's (1 + leading accepted drafts)."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F

from services.eagle.evaluate import AcceptanceReport, chain_acceptance, leading_matches
from services.eagle.sharegpt import conversations, is_held_out, iter_records
from services.eagle.train import TrainSettings, step_losses
from services.modeling.eagle_head import EagleConfig, EagleHead
from tests.tiny_models import tiny_llama

CUT = ('[\n {"id": "a", "conversations": [{"from": "human", "value": "Hi, how are you?"}, {"from": "gpt", '
       '"value": "Fine."}]},\n {"id": "b", "conversations": [{"from": "human", "value": "Bonjour, ça va très bien? é"},'
       ' {"from": "gpt", "value": "Très bien"}]},\n {"id": "c", "conversations": [{"from": "human", "val')


def test_the_reader_drops_the_cut_off_tail_and_keeps_english():
    assert [r["id"] for r in iter_records(io.StringIO(CUT))] == ["a", "b"]
    kept = list(conversations(io.StringIO(CUT)))
    assert [cid for cid, _ in kept] == ["a"]
    assert kept[0][1] == [{"role": "user", "content": "Hi, how are you?"}, {"role": "assistant", "content": "Fine."}]
    assert is_held_out("x") == is_held_out("x")
    assert 0.01 < sum(is_held_out(str(i)) for i in range(20000)) / 20000 < 0.03


def test_training_steps_lower_the_loss():
    target = tiny_llama(seed=3)
    target.requires_grad_(False)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.config))
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        features = target.model(input_ids=ids).last_hidden_state
        logp = F.log_softmax(target.lm_head(features), dim=-1)
    settings = TrainSettings(steps=3)
    history = []
    for _ in range(30):
        losses = step_losses(head, target.get_input_embeddings(), target.lm_head, ids, features, logp, settings)
        assert len(losses) == 3
        optimizer.zero_grad()
        sum(losses).backward()
        optimizer.step()
        history.append(float(sum(losses)))
    assert history[-1] < 0.9 * history[0]  # soft cross-entropy has the target's entropy as its floor


def test_acceptance_counts_leading_matches_as_serving_does():
    assert leading_matches([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and leading_matches([5], [1]) == 0
    target = tiny_llama(seed=3)
    head = EagleHead(EagleConfig.for_target(target.config)).eval()
    ids = torch.randint(0, 96, (1, 30)).tolist()[0]
    with torch.no_grad():
        features = target.model(input_ids=torch.tensor([ids])).last_hidden_state
    report = AcceptanceReport(4, 0, [0] * 4, [0] * 4, 0)
    chain_acceptance(head, target.get_input_embeddings(), target.lm_head, ids, features, 10, 4, report)
    assert report.positions == 30 - 4 - 10
    assert report.reached[0] == report.positions and 1.0 <= report.mean_acceptance_length <= 5.0


class OracleHead(EagleHead):
    """Predicts the target's true next feature at every position: a perfect head, so every draft of every chain
    must be accepted if the evaluation aligns features, tokens and positions as serving does."""

    def __init__(self, config, features):
        super().__init__(config)
        self.true = features

    def step(self, embeddings, features, start, cache):
        positions = range(start, start + embeddings.shape[1])
        return torch.stack([self.true[0, p + 1] for p in positions])[None], cache


def test_a_perfect_head_is_accepted_everywhere():
    target = tiny_llama(seed=3)
    prompt = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        ids = target.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0].tolist()
        features = target.model(input_ids=torch.tensor([ids])).last_hidden_state
    report = AcceptanceReport(4, 0, [0] * 4, [0] * 4, 0)
    chain_acceptance(OracleHead(EagleConfig.for_target(target.config), features), target.get_input_embeddings(),
                     target.lm_head, ids, features, 8, 4, report)
    assert report.positions > 0 and report.mean_acceptance_length == 5.0, report
