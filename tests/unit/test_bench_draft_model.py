"""The draft-model pair bench's own logic, on made-up measurements: which rows the targets compare (the best
setting of each side, adaptive included), that a speculative output differing from speculation off fails the
run, and that transformers' assistant is really set to K (its generate keywords do not reach the assistant)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from services.bench.draft_model_pair import (
    ASSISTANT_DEFAULT,
    assistant_tokens,
    drafter_args,
    equality_checks,
    parse_args,
    row_order,
    targets,
)
from services.bench.report import Generation, Measurement, summarize
from services.drafter.methods.draft_model import DraftModelSettings
from services.drafter.server import add_drafter_flags, settings_from_args

KS = (2, 4)


def measurement(key: str, tokens_per_s: float, outputs=((1, 2, 3),), concurrency: int = 1) -> Measurement:
    runs = tuple(Generation(tuple(tokens), len(tokens) / tokens_per_s, len(tokens)) for tokens in outputs)
    batch = (sum(r.seconds for r in runs),) if concurrency > 1 else ()
    return Measurement(key, "humaneval", key, concurrency, (runs,), batch, speculative=key.startswith(("dm", "hf-a")))


def test_targets_compare_the_best_setting_of_each_side():
    rows = [summarize(m) for m in (
        measurement("hf-plain", 2.0), measurement("hf-assist-2", 3.0), measurement("hf-assist-4", 4.0),
        measurement("hf-assist-default", 3.5), measurement("off-1", 5.0), measurement("dm2-1", 6.0),
        measurement("dm4-1", 8.0), measurement("dm-adaptive-1", 7.0),
        measurement("off-N", 10.0, concurrency=4), measurement("dm-adaptive-N", 9.0, concurrency=4),
    )]
    found = {t.name.split(",")[0]: t for t in targets(rows, KS)}
    vs_assisted = found["specserve draft_model (best) / transformers assisted (best K)"]
    assert vs_assisted.value == 8.0 / 4.0 and vs_assisted.met
    assert vs_assisted.detail == "dm4-1 vs hf-assist-4"  # names the rows it compared
    vs_off = found["specserve draft_model (best) / specserve off"]
    assert vs_off.value == 8.0 / 5.0 and vs_off.met
    concurrent = found["specserve draft_model adaptive / specserve off"]
    assert concurrent.value == 0.9 and not concurrent.met


def test_a_speculative_output_that_differs_from_off_is_a_required_failure():
    measurements = [measurement("off-1", 5.0), measurement("dm2-1", 6.0, outputs=((1, 2, 4),)),
                    measurement("dm4-1", 6.0), measurement("hf-plain", 2.0, outputs=((9,),))]
    checks = {c.name: c for c in equality_checks(measurements, KS)}
    assert checks["dm2-1 vs off, 1 request"].mismatches == 1 and checks["dm2-1 vs off, 1 request"].required
    assert checks["dm4-1 vs off, 1 request"].mismatches == 0
    assert not checks["specserve off vs transformers plain"].required  # float reassociation may flip a near-tie


def test_rows_are_ordered_transformers_then_one_request_then_concurrent():
    keys = ["dm-adaptive-N", "off-N", "http-off-1", "dm-adaptive-1", "dm2-1", "off-1", "hf-assist-default",
            "hf-assist-2", "hf-plain"]
    assert sorted(keys, key=lambda k: row_order(k, KS)) == [
        "hf-plain", "hf-assist-2", "hf-assist-default", "off-1", "dm2-1", "dm-adaptive-1", "http-off-1",
        "off-N", "dm-adaptive-N"]


def test_the_assistant_is_set_to_k_and_restored():
    config = SimpleNamespace(num_assistant_tokens=20, num_assistant_tokens_schedule="heuristic")
    draft = SimpleNamespace(generation_config=config)
    with assistant_tokens(draft, 3):
        assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (3, "constant")
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (20, "heuristic")
    with assistant_tokens(draft, ASSISTANT_DEFAULT):
        assert config.num_assistant_tokens == 20


def test_the_drafter_process_is_started_with_flags_the_drafter_parses_into_the_pair():
    """The drafter's argv (a decorator left on drafter_args once made it a context manager, and the bench failed
    before its first row)."""
    settings, _ = parse_args(["--k", "3", "5", "--concurrency", "2"])
    parser = argparse.ArgumentParser()
    add_drafter_flags(parser)
    drafter = settings_from_args(parser.parse_args(drafter_args(settings, 700)))
    assert drafter.speculation.method == "draft_model" and drafter.speculation.num_speculative_tokens == 5
    assert DraftModelSettings.from_config(drafter.speculation) == DraftModelSettings(
        settings.draft, settings.device, settings.dtype, 2, 700)
