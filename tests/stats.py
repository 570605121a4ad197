"""Goodness-of-fit helpers for the sampling tests."""

from __future__ import annotations

import numpy as np
from scipy import stats

from services.verifier.sampling_params import SamplingParams

ALPHA = 1e-3  # significance of every distribution test (seeds are fixed, so outcomes are reproducible)


def chi_square_p_value(observed_counts: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square of counts against probabilities; cells with expected count < min_expected are merged
    (the approximation needs it). Observations in a zero-probability cell give p = 0."""
    observed = np.asarray(observed_counts, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    total = observed.sum()
    if observed[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * total
    big = expected >= min_expected
    obs = list(observed[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def total_variation(observed_counts: np.ndarray, expected_probs: np.ndarray) -> float:
    observed = np.asarray(observed_counts, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    return 0.5 * float(np.abs(observed / observed.sum() - probs / probs.sum()).sum())


def reference_processed(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Textbook top-k / top-p / min-p / temperature, written independently of the code under test."""
    z = logits.astype(np.float64) / params.temperature
    order = np.argsort(-z)
    vocab = len(z)
    keep = np.zeros(vocab, dtype=bool)
    if params.top_k > 0:
        keep[order[: params.top_k]] = True
    else:
        keep[:] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if params.top_p < 1.0:
        nucleus = np.zeros(vocab, dtype=bool)
        mass = 0.0
        for token in order:
            if not keep[token]:
                continue
            nucleus[token] = True
            mass += p[token]
            if mass >= params.top_p:
                break
        p = p * nucleus
        p /= p.sum()
    if params.min_p > 0:
        p = p * (p >= params.min_p * p.max())
        p /= p.sum()
    return p
