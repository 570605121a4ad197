import logging

from services.verifier.spec_stats import PeriodicStatsLogger, SpecDecodeStats


def test_counters_and_periodic_log_line(caplog):
    stats = SpecDecodeStats()
    stats.record(num_draft=4, num_accepted=2)
    stats.record(num_draft=2, num_accepted=2)
    stats.record(num_draft=0, num_accepted=0)  # no draft: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.drafts_per_position == [2, 2, 1, 1]
    assert stats.accepted_per_position == [2, 2, 0, 0]
    assert stats.mean_acceptance_length == 3.0
    assert abs(stats.acceptance_rate - 4 / 6) < 1e-9

    stats.num_fallbacks, stats.num_late_proposals = 3, 2
    logger = PeriodicStatsLogger(interval_s=10.0, _last_time=0.0)
    with caplog.at_level(logging.INFO, logger="services.verifier.spec_stats"):
        logger.maybe_log(stats, now=5.0)  # too early
        assert not caplog.records
        logger.maybe_log(stats, now=10.0)
    line = caplog.records[-1].getMessage()
    assert "mean acceptance length 3.00" in line and "acceptance rate 66.7%" in line
    assert "per-position acceptance [1.00, 1.00, 0.00, 0.00]" in line
    assert "drafted 0.6 tok/s" in line and "fallbacks 3 (late 2)" in line


def test_merged_sums_counters_and_positions_of_any_length():
    short, long_ = SpecDecodeStats(), SpecDecodeStats()
    short.record(num_draft=2, num_accepted=1)
    short.num_fallbacks, short.num_late_proposals = 3, 1
    long_.record(num_draft=4, num_accepted=4)
    total = SpecDecodeStats.merged([short, long_])
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens, total.num_fallbacks) == (2, 6, 5, 3)
    assert total.num_late_proposals == 1
    assert total.drafts_per_position == [2, 2, 1, 1] and total.accepted_per_position == [2, 1, 1, 1]
    copy = SpecDecodeStats.merged([short])
    copy.record(num_draft=1, num_accepted=1)
    assert short.num_drafts == 1  # a copy, not a view
