"""Structured output and logit_bias through the engine, with speculation: every verified position is masked by
the grammar state its preceding (draft) tokens reach, so

- output always belongs to the grammar, whatever the drafter proposes (illegal drafts are rejected: the bug
  users report from engines that accept grammar-illegal drafts),
- greedy output is the same with speculation on and off,
- sampled output follows the masked (and biased) target's distribution, computed here independently,
- a bad grammar or bias is refused at admission, and a request with one never disturbs its neighbours.

The tiny models have a 12-token vocabulary of single letters (tests.tiny_models.tiny_char_tokenizer), so a
regular expression over letters is a real grammar for llguidance and the exact distribution is cheap."""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Sequence

import numpy as np
import pytest
import torch

from services.common.proposer import Draft, DraftInput
from services.drafter.methods.ngram import NgramProposer
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import (
    GenerationRequest,
    OutputGrammar,
    SamplingParams,
    SpeculationParams,
)
from services.verifier.structured_output import GrammarCompiler, grammar_compiler_for
from tests.engine_harness import run_schedule
from tests.proposers import ModelSamplingProposer, RandomProposer
from tests.stats import ALPHA, chi_square_p_value, reference_processed, total_variation
from tests.tiny_models import CHARS, tiny_char_tokenizer, tiny_llama

V = 12
EOS = 0
PROMPT = (1, 5, 2, 7, 1, 5, 2, 7, 1, 5)
SAMPLES = 3000


def text(tokens: Sequence[int]) -> str:
    return "".join(CHARS[t - 1] for t in tokens if t != EOS)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=21, vocab_size=V)


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(tiny_char_tokenizer(), V)


class IllegalProposer:
    """Drafts a legal first token (the target's own next token is not known to it: it drafts 'a') and then
    tokens the grammars below always forbid ('k', or EOS too early)."""

    method = "illegal"

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [Draft(([1] + [11, EOS] * 32)[: item.num_speculative_tokens]) for item in inputs]

    def release(self, seq_id: Hashable) -> None:
        pass


def engine_for(model, grammars, proposers=None, slots: int = 8, adaptive: bool = False) -> Engine:
    return Engine(
        LlamaFamilyRunner(model, max_num_seqs=slots, max_model_len=64),
        EngineConfig(max_num_batched_tokens=4096, max_waiting_requests=SAMPLES, log_stats_interval_s=0,
                     adaptive_speculation=adaptive),
        proposers or {},
        eos_token_ids=[EOS],
        grammars=grammars,
    )


GRAMMARS = {
    "regex": (OutputGrammar("regex", "(ab|c)+d[a-f]{3}"), r"(ab|c)+d[a-f]{3}"),
    "choice": (OutputGrammar("choice", '["abc", "bad", "cafe", "fjk"]'), r"abc|bad|cafe|fjk"),
    "lark": (OutputGrammar("grammar", 'start: ("a" | "b")+ "c" "d"?'), r"[ab]+cd?"),
}


@pytest.mark.parametrize("kind", GRAMMARS)
async def test_greedy_output_obeys_the_grammar_and_equals_no_speculation(target, grammars, kind):
    grammar, pattern = GRAMMARS[kind]
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=grammar)
    proposers = {"ngram": NgramProposer(), "random": RandomProposer(V, seed=4), "illegal": IllegalProposer()}
    outputs = {}
    for method in ("none", "ngram", "random", "illegal"):
        spec = SpeculationParams() if method == "none" else SpeculationParams(method, 4)
        engine = engine_for(target, grammars, proposers)
        requests = [GenerationRequest("g", PROMPT, params, spec),
                    GenerationRequest("free", PROMPT, SamplingParams(max_tokens=12, temperature=0.0), spec)]
        results = await run_schedule(engine, {0: requests})
        outputs[method] = results["g"].tokens
        assert re.fullmatch(pattern, text(results["g"].tokens)), (method, text(results["g"].tokens))
        assert results["g"].finish_reason.name == "STOP"  # the grammar completed, nothing was cut
        if method in ("random", "illegal"):
            assert results["g"].outputs[-1].spec.num_draft_tokens > 0  # illegal drafts really were verified
        outputs[f"free-{method}"] = results["free"].tokens  # the unconstrained neighbour is untouched
    assert outputs["ngram"] == outputs["random"] == outputs["illegal"] == outputs["none"]
    assert outputs["free-ngram"] == outputs["free-random"] == outputs["free-illegal"] == outputs["free-none"]


async def test_illegal_drafts_are_rejected_not_accepted(target, grammars):
    """The drafter proposes 'a' then 'k' / EOS at every step; the grammar never allows 'k'."""
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_output=OutputGrammar("regex", "[a-d]{12}"))
    engine = engine_for(target, grammars, {"illegal": IllegalProposer()})
    result = (await run_schedule(engine, {0: [GenerationRequest("g", PROMPT, params,
                                                                SpeculationParams("illegal", 3))]}))["g"]
    assert re.fullmatch("[a-d]{12}", text(result.tokens)) and 11 not in result.tokens
    spec = result.outputs[-1].spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens


def masked_joint(model, params: SamplingParams, allowed: Sequence[int], bias: dict[int, float]) -> np.ndarray:
    """p(t2, t3) of the target restricted to `allowed` tokens (the grammar [a-e]{6} allows the same set at
    every position) with `bias` added to its logits, written with numpy apart from the engine's code."""
    keep = np.full(V, -np.inf)
    keep[list(allowed)] = 0.0
    shift = np.zeros(V)
    for token, value in bias.items():
        shift[token] = value

    def dist(logits: np.ndarray) -> np.ndarray:
        return reference_processed(logits + shift + keep, params)

    with torch.inference_mode():
        p1 = dist(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy())
        one = model(input_ids=torch.tensor([PROMPT + (a,) for a in range(V)])).logits[:, -1].numpy()
        two = model(input_ids=torch.tensor([PROMPT + (a, b) for a in range(V) for b in range(V)])).logits[:, -1]
        two = two.numpy().reshape(V, V, V)
    joint = np.zeros((V, V))
    for a in range(V):
        p2 = dist(one[a])
        for b in range(V):
            joint[b] += p1[a] * p2[b] * dist(two[a, b])
    return joint


SAMPLED = {
    "grammar_random_drafts": ("random", {}),
    "grammar_and_bias_same_model_q": ("same", {3: 2.5, 2: -100.0}),
    "bias_only_other_model": ("other", {4: 3.0, 9: -1.5}),
}


# The grammar-and-bias case is the longest (9 s of 3,000 requests): `make test` runs it, the inner loop (`make
# test-fast`) keeps the other two, a grammar and a bias.
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "grammar_and_bias_same_model_q"
                                  else case for case in SAMPLED])
async def test_sampled_output_follows_the_masked_biased_target(target, grammars, case):
    drafter, bias = SAMPLED[case]
    grammar = None if case == "bias_only_other_model" else OutputGrammar("regex", "[a-e]{6}")
    allowed = range(V) if grammar is None else range(1, 6)
    params = SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, logit_bias=tuple(sorted(bias.items())),
                            structured_output=grammar)
    if drafter == "random":
        proposer = RandomProposer(V, seed=3)
    else:
        draft_model = target if drafter == "same" else tiny_llama(seed=99, vocab_size=V)
        proposer = ModelSamplingProposer(draft_model, 0.9, True, seed=5, method="sampler")
    engine = engine_for(target, grammars, {proposer.method: proposer}, slots=500)
    requests = [GenerationRequest(f"s{i}", PROMPT, SamplingParams(**{**params.__dict__, "seed": 1000 + i}),
                                  SpeculationParams(proposer.method, 2)) for i in range(SAMPLES)]
    results = await run_schedule(engine, {0: requests})
    joint = np.zeros((V, V))
    for result in results.values():
        joint[result.tokens[1], result.tokens[2]] += 1
    assert engine.stats.num_drafts > 0
    expected = masked_joint(target, params, allowed, bias)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    unbiased = masked_joint(target, params, allowed, {})  # negative control: the bias really shows
    assert chi_square_p_value(joint, unbiased) < ALPHA if bias else True


async def test_greedy_logit_bias_forces_a_token_with_and_without_speculation(target, grammars):
    params = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((6, 100.0),))
    for spec in (SpeculationParams(), SpeculationParams("ngram", 3)):
        engine = engine_for(target, grammars, {"ngram": NgramProposer()})
        result = (await run_schedule(engine, {0: [GenerationRequest("b", PROMPT, params, spec)]}))["b"]
        assert result.tokens == [6] * 8


@pytest.mark.parametrize(("sampling", "message"), [
    ({"structured_output": OutputGrammar("regex", "(unclosed")}, "invalid"),
    ({"structured_output": OutputGrammar("json_schema", '{"type": "nonsense"}')}, "invalid"),
    ({"structured_output": OutputGrammar("grammar", "start: undefined_rule")}, "invalid"),
    ({"structured_output": OutputGrammar("choice", "not a list")}, "invalid"),
    ({"logit_bias": ((V, 1.0),)}, "logit_bias token ids"),
])
async def test_bad_grammar_or_bias_is_refused_at_admission(target, grammars, sampling, message):
    engine = engine_for(target, grammars)
    with pytest.raises(ValueError, match=message):
        engine.add_request(GenerationRequest("x", PROMPT, SamplingParams(**sampling)))


def test_values_are_checked_before_the_engine():
    with pytest.raises(ValueError, match="kind"):
        OutputGrammar("yaml", "a: b")
    with pytest.raises(ValueError, match="empty"):
        OutputGrammar("regex", " ")
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((1, 101.0),))
    with pytest.raises(ValueError, match="at most 300"):
        SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301)))


async def test_an_engine_without_a_compiler_refuses_grammars(target):
    """A tokenizer llguidance cannot take (not a `tokenizers` one): no compiler, the server still starts, and
    grammars are refused clearly."""
    assert grammar_compiler_for(object(), V) is None
    assert grammar_compiler_for(tiny_char_tokenizer(), V) is not None
    engine = engine_for(target, None)
    with pytest.raises(ValueError, match="unavailable"):
        engine.add_request(GenerationRequest("x", PROMPT, SamplingParams(structured_output=OutputGrammar("json_object"))))


async def test_a_choice_among_thousands_is_followed_with_and_without_speculation(target, grammars):
    """2,500 choices: llguidance's own choice grammar holds each as an item of its parser's first row, at most 2,000,
    and failed the request at its first token; as one terminal (structured_output.choice_grammar) any number
    is followed. Greedy output is one of them, the same with speculation."""
    letters = CHARS[:10]
    words = sorted({a + b + c + d for a in letters for b in letters for c in letters for d in letters})[::4][:2500]
    assert len(words) == 2500
    grammar = OutputGrammar("choice", json.dumps(words))
    params = SamplingParams(max_tokens=10, temperature=0.0, structured_output=grammar)
    outputs = {}
    for method in ("none", "ngram"):
        spec = SpeculationParams() if method == "none" else SpeculationParams(method, 4)
        results = await run_schedule(engine_for(target, grammars, {"ngram": NgramProposer()}),
                                     {0: [GenerationRequest("choice", PROMPT, params, spec)]})
        assert results["choice"].finish_reason.name == "STOP" and text(results["choice"].tokens) in words
        outputs[method] = results["choice"].tokens
    assert outputs["none"] == outputs["ngram"]
