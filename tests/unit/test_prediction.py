"""OpenAI's predicted outputs (method "prediction", built into every engine): drafts from where the output lines
up with the prediction; greedy output identical to no speculation whatever the prediction (exact, edited, wrong),
sampled output following the target's distribution, and a prediction a request cannot use refused at admission."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from services.common.proposer import DraftInput
from services.common.drafter_methods import PREDICTION
from services.verifier.prediction_proposer import PredictionProposer
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import random_workload
from tests.stats import ALPHA, chi_square_p_value, total_variation
from tests.tiny_models import VOCAB, tiny_llama
from tests.unit.test_engine_distribution import V, exact_joint, sample_pairs
from tests.unit.test_engine_greedy import build_schedule, greedy_baseline, make_engine


async def drafts(proposer: PredictionProposer, committed: list[int], prediction: list[int], k: int = 4,
                 prompt: int = 3):
    [draft] = await proposer.propose([DraftInput("s", committed, k, prediction=prediction, num_prompt_tokens=prompt)])
    return list(draft.token_ids)


async def test_drafts_follow_the_prediction_across_accepted_drafts_insertions_and_deletions():
    proposer, prediction, prompt = PredictionProposer(), list(range(100, 140)), [1, 2, 3]
    output = [100]
    assert await drafts(proposer, prompt + output, prediction) == [101, 102, 103, 104]  # lined up at its start
    output += [101, 102, 103, 104, 105]  # the draft accepted whole, and the bonus token
    assert await drafts(proposer, prompt + output, prediction) == [106, 107, 108, 109]
    output += [106, 7]  # one accepted, then the output departs from the prediction (an inserted word)
    assert await drafts(proposer, prompt + output, prediction) == []
    output += [8, 9]
    assert await drafts(proposer, prompt + output, prediction) == []
    output += [112, 113]  # it rejoins further on: 107..111 were deleted
    assert await drafts(proposer, prompt + output, prediction) == [114, 115, 116, 117]
    output += [100, 101, 102]  # it repeats its beginning: the last occurrence before lines up
    assert await drafts(proposer, prompt + output, prediction) == [103, 104, 105, 106]
    assert await drafts(proposer, prompt + output + list(range(136, 140)), prediction) == []  # past its end
    proposer.release("s")
    assert await drafts(proposer, prompt + [5, 5], [5, 5, 6, 7]) == [6, 7]  # a new sequence under the same id
    assert await drafts(PredictionProposer(), prompt + [100], []) == []  # no prediction: no draft
    assert await drafts(PredictionProposer(), prompt, prediction) == [100, 101, 102, 103]  # no output yet: its start
    assert await drafts(PredictionProposer(), [100, 101, 50], prediction, prompt=2) == []  # the prompt is not matched


async def test_the_longest_suffix_that_occurs_wins_and_a_token_split_across_matches_is_no_match():
    proposer = PredictionProposer()
    prediction = [9, 1, 2, 50, 3, 1, 2, 60]  # "1 2" twice; "3 1 2" once
    assert await drafts(proposer, [3, 1, 2], prediction, k=1, prompt=0) == [60]
    # 256 then two 0s, as int64 bytes, hold the bytes of "1 0" from byte 1: a match not on a token's boundary
    prediction = [256, 0, 0, 9, 1, 0, 7]
    assert await drafts(PredictionProposer(), [4, 1, 0], prediction, k=1, prompt=0) == [7]


async def test_where_the_output_does_not_line_up_it_is_drafted_by_prompt_lookup():
    proposer, prediction = PredictionProposer(), [100, 101, 102, 103, 104, 105]
    prompt = [20, 21, 22, 23, 24]
    assert await drafts(proposer, prompt + [7], prediction, prompt=5) == []  # not in the prediction nor before
    assert await drafts(proposer, prompt + [7, 21], prediction, prompt=5) == [22, 23, 24, 7]  # the prompt's
    # one token in common (a space, a bracket) is not enough to line up again: prompt lookup drafts instead
    assert await drafts(proposer, prompt + [7, 21, 9, 103], prediction, prompt=5) == []
    assert await drafts(proposer, prompt + [7, 21, 9, 103, 104], prediction, prompt=5) == [105]  # two are
    assert await drafts(proposer, prompt + [100, 101, 102, 103, 104, 105], prediction, prompt=5) == []  # its end
    # found again in the prediction by two tokens, where the output itself holds three: the output's continuation
    output = [50, 51, 52, 9, 50, 51, 52]
    assert await drafts(PredictionProposer(), prompt + output, [60, 51, 52, 70, 71], prompt=5) == [9, 50, 51, 52]
    assert await drafts(PredictionProposer(), prompt + output[1:], [60, 51, 52, 70, 71], prompt=5) == [70, 71]


async def test_an_edited_file_is_mostly_drafted_from_its_prediction():
    """The edit loop of a 300-token file against a prediction with a word replaced, 10 tokens the output does not
    have and 10 it has that the prediction lacks, each draft accepted as far as it agrees with the output (what
    greedy verification does): most of the output comes from accepted drafts, in a fifth of the steps."""
    rng = random.Random(0)
    output = [rng.randrange(50_000) for _ in range(300)]
    prediction = list(output)
    prediction[50:52] = [7, 7, 7]
    prediction[150:150] = [rng.randrange(50_000) for _ in range(10)]
    del prediction[220:230]
    proposer, prompt, committed, accepted, steps = PredictionProposer(), [1, 2, 3], output[:1], 0, 0
    while len(committed) < len(output):
        draft = await drafts(proposer, prompt + committed, prediction, k=6)
        agreed = 0
        while agreed < len(draft) and len(committed) + agreed < len(output) and \
                draft[agreed] == output[len(committed) + agreed]:
            agreed += 1
        accepted, steps = accepted + agreed, steps + 1
        committed = output[:len(committed) + agreed + 1]  # and the target's own next token
    assert accepted >= 0.75 * len(output) and steps <= len(output) / 5, (accepted, steps)


@pytest.mark.parametrize("kind", ["exact", "edited", "wrong"])
async def test_greedy_output_with_a_prediction_equals_no_speculation(kind):
    model = tiny_llama(seed=3)
    n = 6
    prompts, max_tokens = random_workload(13, n, (5, 30), (10, 40))
    baseline = await greedy_baseline(model, prompts, max_tokens)
    rng = random.Random(kind)
    specs = []
    for i in range(n):
        expected = list(baseline[f"r{i}"].tokens)
        if kind == "edited":  # a word replaced, one inserted, one deleted
            expected[3:5] = [rng.randrange(VOCAB)]
            expected[len(expected) // 2:len(expected) // 2] = [rng.randrange(VOCAB) for _ in range(3)]
            del expected[-4:-2]
        elif kind == "wrong":
            expected = [rng.randrange(VOCAB) for _ in expected]
        specs.append(SpeculationParams(PREDICTION, 6, prediction=tuple(expected)))
    engine = make_engine(model, {})
    out = await run_schedule(engine, build_schedule(specs, prompts, max_tokens))
    for i in range(n):
        assert out[f"r{i}"].tokens == baseline[f"r{i}"].tokens, (kind, i)
    stats = engine.stats_by_method[PREDICTION]
    if kind == "exact":  # every draft of the output itself is accepted
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    elif kind == "edited":  # short outputs of a tiny model: the edits are a large part of them
        assert stats.num_accepted_tokens > stats.num_draft_tokens / 3


async def test_sampled_output_with_a_prediction_follows_the_target():
    """Every token of the vocabulary in the prediction, so that each step lines up and drafts."""
    target = tiny_llama(seed=21, vocab_size=V)
    params = SamplingParams(temperature=0.9)
    prediction = tuple(np.random.default_rng(5).permutation(np.tile(np.arange(V), 3)).tolist())
    joint, engine = await sample_pairs(target, params, SpeculationParams(PREDICTION, 3, prediction=prediction), {},
                                       samples=2000)
    stats = engine.stats_by_method[PREDICTION]
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


async def test_a_prediction_the_request_cannot_use_is_refused_at_admission():
    engine = make_engine(tiny_llama(seed=3), {})
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    cases = {
        "method 'prediction', not 'ngram'": SpeculationParams("ngram", 3, prediction=(1, 2)),
        "method 'prediction', not 'none'": SpeculationParams(None, 0, prediction=(1, 2)),
        f"prediction token ids must be in [0, {VOCAB})": SpeculationParams(PREDICTION, 3, prediction=(1, VOCAB)),
        "drafts from the request's predicted output, and it has none": SpeculationParams(PREDICTION, 3),
    }
    for said, spec in cases.items():
        with pytest.raises(ValueError, match=re.escape(said)):
            engine.add_request(GenerationRequest("bad", (1, 2, 3), greedy, spec))
    ok = await run_schedule(engine, {0: [GenerationRequest("ok", (1, 2, 3), greedy,
                                                           SpeculationParams(PREDICTION, 3, prediction=(4,)))]})
    assert len(ok["ok"].tokens) == 4


def test_a_prediction_without_k_drafts_long_runs_and_a_k_given_is_kept():
    from services.verifier.prediction_proposer import PREDICTION_NUM_TOKENS
    from services.verifier.wire import DefaultSpeculation, speculation_from_proto
    from services.verifier.wire import verifier_pb2 as pb

    predicted = pb.SpeculationParams(prediction_token_ids=[5, 6])
    spec = speculation_from_proto(predicted, DefaultSpeculation("suffix", 5))
    assert (spec.method, spec.num_speculative_tokens, spec.prediction) == (PREDICTION, PREDICTION_NUM_TOKENS, (5, 6))
    assert speculation_from_proto(predicted, DefaultSpeculation("suffix", 12)).num_speculative_tokens == 12
    predicted.num_speculative_tokens = 3
    assert speculation_from_proto(predicted, DefaultSpeculation(None, 5)).num_speculative_tokens == 3
    assert speculation_from_proto(pb.SpeculationParams(), DefaultSpeculation("suffix", 5)).num_speculative_tokens == 5
