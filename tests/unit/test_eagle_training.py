"""EAGLE training pieces on a tiny target: the ShareGPT reader keeps whole records of a cut-off file, training
steps lower the loss, and the acceptance count is vLLM's (1 + leading accepted drafts)."""

from __future__ import annotations

import copy
import io
from dataclasses import asdict

import pytest
import torch

from services.eagle.evaluate import AcceptanceReport, chain_acceptance, leading_matches
from services.eagle.sharegpt import conversations, is_held_out, iter_records
from services.eagle.extract import Example
from services.eagle.train import TrainSettings, draft_vocabulary, reachable, step_losses
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
    settings = TrainSettings(steps=3)
    history = []
    for _ in range(30):
        losses = step_losses(head, target.get_input_embeddings(), target.lm_head.weight, ids, features, 10, settings)
        assert len(losses) == 3
        optimizer.zero_grad()
        sum(losses).backward()
        optimizer.step()
        history.append(float(sum(losses)))
    assert history[-1] < 0.9 * history[0]  # soft cross-entropy has the target's entropy as its floor


def test_losses_cover_only_the_answer_positions_a_chain_reaches():
    # a prompt of 10 tokens: the first chain starts at head position 9 (the bonus token after the prefill), so
    # step j's outputs count from position 8 + j on
    assert reachable(30, 10, 1).tolist() == list(range(9, 30))
    assert reachable(30, 10, 3).tolist() == list(range(11, 30))
    assert reachable(30, 1, 2).tolist() == list(range(1, 30))  # never a position before the chain's step
    # an answer too short for step 3's chain (the target answered with its end token at once): no position
    assert reachable(9, 10, 1).tolist() == [] and reachable(9, 10, 3).tolist() == []


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens_and_the_end_tokens():
    examples = [Example(torch.tensor([50, 50, 50, 7, 7, 7, 8, 9]), 3, torch.zeros(7, 4), torch.zeros(7, 4)),
                Example(torch.tensor([51, 7, 8, 3]), 1, torch.zeros(3, 4), torch.zeros(3, 4))]
    assert draft_vocabulary(examples, 3, always=[2]).tolist() == [2, 7, 8]  # never the prompts' 50 and 51


def test_a_reduced_vocabulary_head_drafts_target_ids_and_keeps_them_through_its_files(tmp_path):
    target = tiny_llama(seed=3)
    config = EagleConfig(**{**asdict(EagleConfig.for_target(target.config)), "draft_vocab_size": 5})
    head = EagleHead(config)
    head.draft_vocab.copy_(torch.tensor([3, 10, 20, 40, 90]))
    weight = head.draft_weight(target.lm_head.weight)
    assert torch.equal(weight[2], target.lm_head.weight[20])
    assert head.token_ids(torch.tensor([0, 4])).tolist() == [3, 90]
    head.save(tmp_path)
    loaded = EagleHead.load(tmp_path)
    assert loaded.draft_vocab.dtype == torch.long and loaded.draft_vocab.tolist() == [3, 10, 20, 40, 90]
    assert torch.allclose(loaded.fc.weight, head.fc.weight.half().float())


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


def test_two_heads_are_compared_prompt_by_prompt_against_the_spread_over_prompts():
    from services.eagle.evaluate import paired_difference

    def report(per_prompt):
        return AcceptanceReport(4, sum(n for n, _ in per_prompt), [0] * 4, [0] * 4, sum(a for _, a in per_prompt),
                                per_prompt)

    baseline = report([(10, 5), (20, 4), (10, 10)])  # 1.5, 1.2, 2.0 tokens a step
    head = report([(10, 6), (20, 8), (10, 10)])  # 1.6, 1.4, 2.0
    difference = paired_difference(head, baseline)
    assert difference.prompts == 3 and difference.mean == pytest.approx(0.1)
    assert difference.standard_error == pytest.approx(0.1 / 3 ** 0.5)  # the diffs 0.1, 0.2, 0.0: sd 0.1
    assert paired_difference(baseline, baseline).mean == 0 and paired_difference(baseline, baseline).standard_error == 0
    assert "+0.100" in str(difference) and "3 prompts" in str(difference)
    with pytest.raises(ValueError):  # reports of different prompt lists are no pair
        paired_difference(head, report([(10, 5)]))
    from services.eagle.train import main

    with pytest.raises(SystemExit):  # a comparison measures saved heads: it does not train one first
        main(["--baseline", "/nowhere"])


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


def test_eagle3_training_steps_lower_the_loss_and_its_head_keeps_through_its_speculators_files(tmp_path):
    """An EAGLE-3 head learns from the fused states of its layers, scoring with its own LM head (trained with
    it); saved in the speculators layout and loaded back, it drafts exactly the same."""
    from services.modeling.eagle_head_files import load_eagle_head
    from tests.tiny_heads import random_eagle3_head

    target = tiny_llama(seed=3)
    target.requires_grad_(False)
    vocab = torch.arange(0, 96, 2)  # a reduced draft vocabulary: the even ids
    head = random_eagle3_head(target.config, (0, 1, -1), vocab.tolist())
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        every = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    states, final = torch.cat([every[0], every[1], every[-1]], dim=-1), every[-1]
    settings = TrainSettings(steps=3)
    lm_rows = target.lm_head.weight[vocab]
    before = head.lm_head.weight.detach().clone()
    history = []
    for _ in range(30):
        losses = step_losses(head, target.get_input_embeddings(), lm_rows, ids, states, 10, settings, final,
                             head.draft_weight(target.lm_head.weight))
        assert len(losses) == 3
        optimizer.zero_grad()
        sum(losses).backward()
        optimizer.step()
        history.append(float(sum(losses).detach()))
    assert history[-1] < 0.9 * history[0]
    assert not torch.equal(before, head.lm_head.weight)  # its own LM head learns too
    head.eval()
    head.save(tmp_path / "head", {"examples_trained": 1})
    loaded = load_eagle_head(tmp_path / "head")
    assert loaded.config.hidden_layers == (0, 1, -1) and loaded.draft_vocab.tolist() == vocab.tolist()
    rounded = copy.deepcopy(head)  # the files hold fp16
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.half().float())
        logits = []
        for h in (rounded, loaded):
            out, _ = h.step(target.get_input_embeddings()(ids[:, 1:21]), h.target_features(states[:, :20]), 0, None)
            logits.append(h.draft_logits(out, h.draft_weight(None)))
    assert torch.allclose(logits[0], logits[1], atol=1e-4)


def test_the_other_source_chat_prompts_cover_every_category_in_a_short_run():
    from services.eagle.chat_prompts import CHAT_PROMPTS, chat_prompt_messages
    from services.eagle.evaluate import evaluation_prompts

    categories = {category for category, _ in CHAT_PROMPTS}
    texts = [text for _, text in CHAT_PROMPTS]
    assert len(set(texts)) == len(texts) == 48
    first = chat_prompt_messages(len(categories))
    by_text = dict((text, category) for category, text in CHAT_PROMPTS)
    assert {by_text[chat[0]["content"]] for chat in first} == categories
    assert all(len(chat) == 1 and chat[0]["role"] == "user" for chat in chat_prompt_messages())
    assert sorted(chat[0]["content"] for chat in chat_prompt_messages()) == sorted(texts)
    assert evaluation_prompts("chat", 5) == chat_prompt_messages(5)
    with pytest.raises(ValueError, match="sharegpt, chat"):
        evaluation_prompts("mt-bench", 5)


def test_an_eagle3_head_reads_the_layers_it_is_told_or_vllms_default():
    from services.eagle.train import new_head

    target = tiny_llama(seed=3)  # 2 decoder layers
    config = target.config
    assert TrainSettings().head_layers(config) == (-1,)
    assert TrainSettings(eagle3=True).head_layers(config) == (0, 1, 1)  # vLLM's default for a shallow target
    told = TrainSettings(eagle3=True, eagle3_layers=(0, 1, -1))
    assert told.head_layers(config) == (0, 1, -1)
    assert new_head(target, told, torch.arange(0, 96, 2)).config.hidden_layers == (0, 1, -1)
    with pytest.raises(ValueError, match="three target layers"):
        TrainSettings(eagle3=True, eagle3_layers=(0, -1)).head_layers(config)
    with pytest.raises(ValueError, match="hidden layer 5 does not exist"):
        TrainSettings(eagle3=True, eagle3_layers=(0, 5, -1)).head_layers(config)
