"""Statistical tests of the rejection sampler: with any drafter, emitted tokens follow the target's processed
distribution. Each test draws N independent rows (one seed each) in a single batched call, lets rows that stopped
early continue with a plain (K = 0) step exactly as the engine would, and compares the joint histogram of the
first two tokens with p1 x p2 by chi-square at ALPHA. Negative controls show the statistic has the power to
reject a sampler that is slightly off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.verifier.rejection import verify
from services.verifier.sampling_batch import SamplingBatch
from services.verifier.sampling_params import SamplingParams
from tests.stats import ALPHA, chi_square_p_value, reference_processed, total_variation

V = 10
K = 3
N = 40_000


def target_logits(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 1.5, size=(K + 1, V)).astype(np.float32)  # [K+1, V]


def run_sampler(
    logits: np.ndarray, params: SamplingParams, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> np.ndarray:
    """Emit two tokens per row through verify (plus a K = 0 step for rows that emitted only one)."""
    rows = draft_tokens.shape[0]
    batch = SamplingBatch.build([params] * rows, list(range(rows)), V, torch.device("cpu"))
    logits_t = torch.from_numpy(logits)[None].expand(rows, -1, -1).contiguous()  # [N, K+1, V]
    positions = torch.full((rows,), 50, dtype=torch.int64)
    has_q = torch.ones(rows, dtype=torch.bool) if draft_probs is not None else None
    out = verify(logits_t, draft_tokens, torch.full((rows,), K), positions, batch, draft_probs, has_q)
    first = out.tokens[:, 0]
    second = out.tokens[:, 1].clone()
    only_one = out.num_accepted == 0
    # rows that emitted one token: the next engine step samples position 2 with no draft, from p2
    follow = verify(
        logits_t[:, 1:2].contiguous(), torch.zeros(rows, 0, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
        positions + 1, batch,
    )
    second = torch.where(only_one, follow.tokens[:, 0], second)
    joint = np.zeros((V, V))
    np.add.at(joint, (first.numpy(), second.numpy()), 1)
    return joint


def draft_from(q: np.ndarray, rows: int, seed: int) -> torch.Tensor:
    """Each row drafts K tokens, position i sampled from q[i] (independent of the sampler's noise)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(torch.from_numpy(q[i]), rows, replacement=True, generator=generator) for i in range(K)], dim=1)


SETTINGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "t0.7_top_p": SamplingParams(temperature=0.7, top_p=0.8),
    "t1.0_top_k": SamplingParams(temperature=1.0, top_k=4),
    "t1.0_top_k_top_p_min_p": SamplingParams(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05),
}


def expected_joint(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return np.outer(reference_processed(logits[0], params), reference_processed(logits[1], params))


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", ["high_acceptance", "low_acceptance"])
def test_deterministic_drafts_are_lossless(setting, drafter):
    params = SETTINGS[setting]
    logits = target_logits(1)
    ranked = np.argsort(-logits, axis=-1)  # [K+1, V]
    pick = ranked[:K, 0] if drafter == "high_acceptance" else ranked[:K, -1]  # the best / the worst token
    drafts = torch.from_numpy(np.tile(pick, (N, 1))).long()
    joint = run_sampler(logits, params, drafts, None)
    expected = expected_joint(logits, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


@pytest.mark.parametrize("setting", ["t1.0", "t0.7", "t0.7_top_p", "t1.0_top_k"])
@pytest.mark.parametrize("drafter", ["close_q", "far_q"])
@pytest.mark.parametrize("send_q", [True, False])
def test_sampled_drafts_are_lossless_with_and_without_q(setting, drafter, send_q):
    params = SETTINGS[setting]
    logits = target_logits(2)
    p = np.stack([reference_processed(logits[i], params) for i in range(K)])
    if drafter == "close_q":  # a good draft model: mostly the target, a little uniform
        q = 0.8 * p + 0.2 / V
    else:  # a poor one: mass on tokens the target dislikes
        q = np.exp(-2.0 * logits[:K]); q /= q.sum(-1, keepdims=True)
    q = q.astype(np.float32)
    drafts = draft_from(q, N, seed=3)
    probs = torch.from_numpy(q)[None].expand(N, -1, -1).contiguous() if send_q else None
    joint = run_sampler(logits, params, drafts, probs)
    expected = expected_joint(logits, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


def test_sending_q_raises_acceptance_of_sampled_drafts():
    """The q rule exists for speed: with q, a sampled drafter is accepted more often than with the coupled rule."""
    params = SETTINGS["t1.0"]
    logits = target_logits(2)
    p = np.stack([reference_processed(logits[i], params) for i in range(K)])
    q = (0.8 * p + 0.2 / V).astype(np.float32)
    drafts = draft_from(q, N, seed=4)
    batch = SamplingBatch.build([params] * N, list(range(N)), V, torch.device("cpu"))
    logits_t = torch.from_numpy(logits)[None].expand(N, -1, -1).contiguous()
    args = (logits_t, drafts, torch.full((N,), K), torch.zeros(N, dtype=torch.int64), batch)
    with_q = verify(*args, torch.from_numpy(q)[None].expand(N, -1, -1).contiguous(), torch.ones(N, dtype=torch.bool))
    without_q = verify(*args)
    assert with_q.num_accepted.float().mean() > 1.2 * without_q.num_accepted.float().mean()


def test_negative_control_detects_a_slightly_wrong_distribution():
    """The same statistic rejects samples at temperature 0.7 when the target is 0.8: it has power."""
    logits = target_logits(1)
    ranked = np.argsort(-logits, axis=-1)
    drafts = torch.from_numpy(np.tile(ranked[:K, 0], (N, 1))).long()
    joint = run_sampler(logits, SETTINGS["t0.7"], drafts, None)
    wrong = expected_joint(logits, SamplingParams(temperature=0.8))
    assert chi_square_p_value(joint, wrong) < ALPHA


def test_negative_control_detects_accepting_without_rejection():
    """A lossy sampler that accepts every draft is caught (here: emitted tokens are the drafts themselves)."""
    logits = target_logits(2)
    q = np.full((K, V), 1.0 / V)
    drafts = draft_from(q, N, seed=5)
    joint = np.zeros((V, V))
    np.add.at(joint, (drafts[:, 0].numpy(), drafts[:, 1].numpy()), 1)
    assert chi_square_p_value(joint, expected_joint(logits, SETTINGS["t1.0"])) < ALPHA


def test_greedy_rows_pick_the_argmax_and_logprobs_are_real():
    logits = target_logits(3)
    params = SamplingParams(temperature=0.0, logprobs=3)
    batch = SamplingBatch.build([params], [0], V, torch.device("cpu"))
    best = torch.from_numpy(logits.argmax(-1))
    drafts = torch.stack([best[0], best[1], (best[2] + 1) % V])[None]  # two right, third wrong
    out = verify(torch.from_numpy(logits)[None], drafts, torch.tensor([K]), torch.tensor([0]), batch)
    assert int(out.num_accepted[0]) == 2
    assert out.tokens[0, :3].tolist() == best[:3].tolist()
    expected = torch.log_softmax(torch.from_numpy(logits), -1)
    torch.testing.assert_close(out.logprobs[0, :3], expected[torch.arange(3), best[:3]])
    torch.testing.assert_close(out.top_logprobs[0], expected.topk(3, dim=-1).values)


def test_seeded_rows_reproduce_and_spec_on_equals_spec_off():
    """Noise is keyed by (seed, position): with a deterministic drafter, speculation on and off emit the very
    same sampled tokens."""
    params = SamplingParams(temperature=1.0)
    logits = target_logits(4)
    rows = 2000
    batch = SamplingBatch.build([params] * rows, list(range(rows)), V, torch.device("cpu"))
    logits_t = torch.from_numpy(logits)[None].expand(rows, -1, -1).contiguous()
    plain = verify(logits_t[:, :1].contiguous(), torch.zeros(rows, 0, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
                   torch.full((rows,), 7), batch)
    drafts = torch.randint(0, V, (rows, K), generator=torch.Generator().manual_seed(0))
    spec = verify(logits_t, drafts, torch.full((rows,), K), torch.full((rows,), 7), batch)
    assert torch.equal(plain.tokens[:, 0], spec.tokens[:, 0])
    again = verify(logits_t, drafts, torch.full((rows,), K), torch.full((rows,), 7), batch)
    assert torch.equal(spec.tokens, again.tokens)
