"""vLLM's token rules (allowed_token_ids, bad_words, min_tokens) through the engine, with speculation.

They mask the target's logits at every verified position, and bad_words and min_tokens depend on the output
before a position, which for a draft position includes the draft tokens before it. So

- the rules hold whatever the drafter proposes, and greedy output is the same with speculation on and off,
- sampled output follows the masked target, computed here independently (numpy, position by position),
- rules that leave nothing to generate are refused at admission, and a request whose rules reach a dead end
  fails alone, with and without speculation alike.

The tiny model has a 12-token vocabulary (token 0 is EOS), so exact distributions are cheap."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from services.drafter.methods.ngram import NgramProposer
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine, RequestConstraintError
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.proposers import RandomProposer
from tests.stats import ALPHA, chi_square_p_value, reference_processed, total_variation
from tests.tiny_models import tiny_llama

V = 12
EOS = 0
PROMPT = (1, 5, 2, 7, 1, 5, 2, 7, 1, 5)
SAMPLES = 3000


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=21, vocab_size=V)


def engine_for(model, proposers=None, slots: int = 8) -> Engine:
    return Engine(
        LlamaFamilyRunner(model, max_num_seqs=slots, max_model_len=64),
        EngineConfig(max_num_batched_tokens=4096, max_waiting_requests=SAMPLES, log_stats_interval_s=0,
                     adaptive_speculation=False),
        proposers or {},
        eos_token_ids=[EOS],
    )


def contains(tokens: Sequence[int], word: Sequence[int]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == tuple(word) for i in range(len(tokens) - len(word) + 1))


def greedy_free(model, length: int) -> list[int]:
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(length):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


RULES = {
    "allowed": {"allowed_token_ids": (2, 4, 6, 9)},
    # the free greedy output's own pairs, so the ban really changes it
    "bad_words": None,
    "min_tokens": {"min_tokens": 6, "logit_bias": ((EOS, 6.0),)},
}


@pytest.mark.parametrize("rule", RULES)
async def test_greedy_output_keeps_the_rule_and_equals_no_speculation(target, rule):
    free = greedy_free(target, 12)
    sampling = RULES[rule] or {"bad_words": ((free[1], free[2]), (free[4],))}
    params = SamplingParams(max_tokens=12, temperature=0.0, **sampling)
    proposers = {"ngram": NgramProposer(), "random": RandomProposer(V, seed=4)}
    outputs = {}
    for method in ("none", "ngram", "random"):
        spec = SpeculationParams() if method == "none" else SpeculationParams(method, 4)
        engine = engine_for(target, proposers)
        requests = [GenerationRequest("r", PROMPT, params, spec),
                    GenerationRequest("free", PROMPT, SamplingParams(max_tokens=12, temperature=0.0), spec)]
        results = await run_schedule(engine, {0: requests})
        tokens = results["r"].tokens
        outputs[method], outputs[f"free-{method}"] = tokens, results["free"].tokens
        if method == "random":
            assert results["r"].outputs[-1].spec.num_draft_tokens > 0
        if rule == "allowed":
            assert set(tokens) <= {2, 4, 6, 9}, tokens
        elif rule == "bad_words":
            assert not contains(tokens, (free[1], free[2])) and free[4] not in tokens, (tokens, free)
        else:
            assert EOS not in tokens[:6] and len(tokens) >= 6, tokens
    assert outputs["ngram"] == outputs["random"] == outputs["none"]
    assert outputs["free-none"] == outputs["free-ngram"] == outputs["free-random"] == free  # the neighbour
    assert outputs["none"] != free  # the rule changed the output


def rules_joint(model, params: SamplingParams, eos_bias: float) -> np.ndarray:
    """p(t1, t2) of the target with the rules applied position by position, written with numpy apart from the
    engine's code: allowed tokens, single-token and two-token bad words, EOS held back for min_tokens."""
    allowed = set(params.allowed_token_ids) or set(range(V))

    def mask(history: tuple[int, ...]) -> np.ndarray:
        keep = np.array([0.0 if t in allowed else -np.inf for t in range(V)])
        if len(history) < params.min_tokens:
            keep[EOS] = -np.inf
        for word in params.bad_words:
            if len(word) == 1 or (len(history) >= len(word) - 1 and history[len(history) - len(word) + 1 :]
                                  == tuple(word[:-1])):
                keep[word[-1]] = -np.inf
        return keep

    shift = np.zeros(V)
    shift[EOS] = eos_bias
    with torch.inference_mode():
        first = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy()
        second = model(input_ids=torch.tensor([PROMPT + (a,) for a in range(V)])).logits[:, -1].numpy()
    p1 = reference_processed(first + shift + mask(()), params)
    joint = np.zeros((V, V))
    for a in range(V):
        if p1[a] > 0:
            joint[a] = p1[a] * reference_processed(second[a] + shift + mask((a,)), params)
    return joint


# 3,000 requests of three tokens each: about 8 s, so the inner loop (`make test-fast`) leaves it to `make test`.
@pytest.mark.slow
async def test_sampled_output_follows_the_target_under_the_rules(target):
    params = SamplingParams(temperature=0.9, max_tokens=3, allowed_token_ids=(0, 1, 2, 3, 4, 5, 6),
                            bad_words=((3,), (2, 4), (1, 1)), min_tokens=2, logit_bias=((EOS, 2.5),))
    proposer = RandomProposer(V, seed=3)
    engine = engine_for(target, {proposer.method: proposer}, slots=500)
    requests = [GenerationRequest(f"s{i}", PROMPT, SamplingParams(**{**params.__dict__, "seed": 1000 + i}),
                                  SpeculationParams(proposer.method, 2)) for i in range(SAMPLES)]
    results = await run_schedule(engine, {0: requests})
    joint = np.zeros((V, V))
    for result in results.values():
        joint[result.tokens[0], result.tokens[1]] += 1
    assert engine.stats.num_draft_tokens > 0
    expected = rules_joint(target, params, eos_bias=2.5)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    # negative control: the history-dependent rules really show (without the two-token bad words and min_tokens)
    looser = SamplingParams(**{**params.__dict__, "bad_words": ((3,),), "min_tokens": 0})
    assert chi_square_p_value(joint, rules_joint(target, looser, eos_bias=2.5)) < ALPHA


@pytest.mark.parametrize(("sampling", "message"), [
    ({"allowed_token_ids": (1, V)}, "allowed_token_ids must be in"),
    ({"bad_words": ((2, V),)}, "bad_words token ids must be in"),
    ({"allowed_token_ids": (3, 4), "bad_words": ((3,), (4,))}, "leave no token"),
    ({"allowed_token_ids": (EOS,), "min_tokens": 2}, "min_tokens holds back"),
])
async def test_rules_that_cannot_be_kept_are_refused_at_admission(target, sampling, message):
    with pytest.raises(ValueError, match=message):
        engine_for(target).add_request(GenerationRequest("x", PROMPT, SamplingParams(max_tokens=4, **sampling)))


def test_values_are_checked_before_the_engine():
    with pytest.raises(ValueError, match="at most max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=((),))
    with pytest.raises(ValueError, match="at most 128 bad_words"):
        SamplingParams(bad_words=tuple((i,) for i in range(129)))


async def outcome(engine: Engine, request: GenerationRequest) -> tuple[list[int], str | None]:
    """The request's tokens and, if it failed, its error; with a free neighbour that must finish untouched."""
    streams = {r.request_id: engine.add_request(r) for r in
               (request, GenerationRequest("free", PROMPT, SamplingParams(max_tokens=8, temperature=0.0)))}
    tokens: dict[str, list[int]] = {rid: [] for rid in streams}
    error = None
    for _ in range(100):
        await engine.step()
        for rid, stream in streams.items():
            try:
                for output in stream.ready_outputs():
                    tokens[rid] += output.token_ids
            except RequestConstraintError as failure:
                error = str(failure)
        if engine.num_running == 0 and engine.num_waiting == 0:
            break
    assert tokens["free"] == greedy_free(engine.runner.model, 8)
    return tokens[request.request_id], error


async def test_a_dead_end_fails_the_request_alone_with_and_without_speculation(target):
    """allowed {1, 2} with bad words (1, 1) and (1, 2): after a 1 nothing may follow. The request fails when its
    output reaches a 1, and speculation (whose drafts may walk into the dead end and be rejected) fails it
    exactly where the plain engine does."""
    params = SamplingParams(max_tokens=10, temperature=0.0, allowed_token_ids=(1, 2), bad_words=((1, 1), (1, 2)))
    results = {}
    for method in ("none", "random", "ones"):
        spec = SpeculationParams() if method == "none" else SpeculationParams("random" if method == "random"
                                                                              else "ones", 3)
        proposers = {"random": RandomProposer(V, seed=8), "ones": _Ones()}
        results[method] = await outcome(engine_for(target, proposers), GenerationRequest("r", PROMPT, params, spec))
    assert results["none"] == results["random"] == results["ones"]
    tokens, error = results["none"]
    assert tokens[-1] == 1 and 1 not in tokens[:-1] and "allow no next token" in error, (tokens, error)


class _Ones:
    """Drafts only 1s: every draft walks into the dead end."""

    method = "ones"

    async def propose(self, inputs):
        from services.common.proposer import Draft

        return [Draft([1] * item.num_speculative_tokens) for item in inputs]

    def release(self, seq_id) -> None:
        pass
