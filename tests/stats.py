"""Goodness-of-fit helpers for the sampling tests."""

from __future__ import annotations

import numpy as np
from scipy import stats

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
