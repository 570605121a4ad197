"""The benchmark's end-to-end rows: the stack is planned like `specserve serve` with the bench's settings on free
ports, outputs are compared as text + token count, the ratios appear, a stack that cannot start fails clearly and
leaves nothing running, and (slow) the real rows on SmolLM2-135M through the HTTP API."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket

import pytest

from services import launcher
from services.bench import BenchSettings, HttpTarget, http_runs, run_benchmark
from services.bench.report import Generation, Row, compute_ratios, same_output

MODEL = "smollm2-135m-instruct"


def target(model: str = MODEL, start_timeout_s: float = 300.0) -> HttpTarget:
    return HttpTarget(model, "cpu", "float32", 2, lambda ids: " ".join(map(str, ids)), start_timeout_s)


def test_stack_is_planned_like_serve_with_the_bench_settings():
    args = http_runs.launcher_args(target(), k=6, prompt_lookup_min=2, prompt_lookup_max=3, max_num_seqs=5,
                                   max_model_len=777)
    children = {c.name: c for c in launcher.plan(args)}
    assert list(children) == ["drafter", "verifier", "gateway"]
    drafter, verifier = children["drafter"].argv, " ".join(children["verifier"].argv)
    sent = json.loads(drafter[drafter.index("--speculative-config") + 1])
    assert sent == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    for flag in ("--model smollm2-135m-instruct", "--device cpu", "--dtype float32", "--max-num-seqs 5",
                 "--max-model-len 777", f"--drafter ngram=127.0.0.1:{args.drafter_port}"):
        assert flag in verifier
    ports = [value for name, value in vars(args).items() if name == "port" or name.endswith("_port")]
    assert len(set(ports)) == len(ports) >= 4, "every port flag gets its own free port"


def test_child_env_drops_settings_the_flags_do_not_control(monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", "secret")
    monkeypatch.setenv("SPECSERVE_VERIFIER_MAX_NUM_SEQS", "1")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", "/models")
    env = http_runs.child_env(threads=3)
    assert "SPECSERVE_API_KEY" not in env and "SPECSERVE_VERIFIER_MAX_NUM_SEQS" not in env
    assert env["SPECSERVE_CACHE_DIR"] == "/models" and env["OMP_NUM_THREADS"] == "3"


def test_outputs_compare_by_ids_or_by_text_and_count():
    a = Generation((1, 2, 3), 1.0, 3, text="abc")
    http = Generation((), 1.0, 3, text="abc", reported_tokens=3)
    assert same_output(a, http) and same_output(http, http)
    assert not same_output(a, Generation((), 1.0, 3, text="abd", reported_tokens=3))
    assert not same_output(a, Generation((), 1.0, 2, text="abc", reported_tokens=2))  # same text, fewer tokens
    assert not same_output(a, Generation((1, 2, 4), 1.0, 3, text="abc"))  # ids when both sides have them
    assert http.tokens_per_s == 3.0
    with pytest.raises(ValueError):
        same_output(Generation((1, 2, 3), 1.0, 3), http)


def test_http_ratios_against_the_in_process_rows():
    def row(key: str, tokens_per_s: float) -> Row:
        return Row(key, "humaneval", key, 1, tokens_per_s, 10, 1.0, 1.0, None)

    rows = [row("off-1", 30.0), row("ngram-1", 40.0), row("http-off-1", 28.5), row("http-ngram-1", 34.0)]
    ratios = {r.name: r for r in compute_ratios(rows)}
    ngram, off = ratios["HTTP API ngram / in-process ngram (1 req)"], ratios["HTTP API off / in-process off (1 req)"]
    assert math.isclose(ngram.value, 0.85) and not ngram.met and ngram.target == 0.9
    assert math.isclose(off.value, 0.95) and off.met


@pytest.mark.slow  # real processes: a drafter starts, the verifier fails
def test_a_stack_that_cannot_start_fails_with_its_log_and_leaves_nothing_running():
    args = http_runs.launcher_args(target("no-such-model-anywhere", start_timeout_s=120), 3, 1, 3, 2, 256)
    messages: list[str] = []
    stack = http_runs.HttpStack(args, 1, messages.append)
    with pytest.raises(http_runs.StackError, match=r"verifier .*log"), stack:
        pytest.fail("the stack must not start without its model")
    assert stack.log_dir is not None and (stack.log_dir / "verifier.log").exists()
    assert any(str(stack.log_dir) in m for m in messages), "the kept logs' path is reported"
    assert not stack._children
    assert not listening(args.drafter_port), "the drafter started first and was stopped"
    shutil.rmtree(stack.log_dir)


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_http_rows_on_smollm2(smollm2):
    """`specserve bench --quick`'s setup, shrunk: every in-process row plus the HTTP rows through the real
    stack, which must generate exactly what the in-process engine generates. On one short workload (a plain
    chat): every workload takes the same path through the HTTP API, a second one doubled this test's two
    minutes, and the code-edit ones (~1,000-token prompts) made it four (test_bench_smoke.py runs all four
    workloads on a tiny model)."""
    from services.bench.prompts import Workload, chat_token_ids, humaneval_messages
    from services.gateway.tokenizer import make_decode

    eos = sorted(smollm2.eos_token_ids)
    workloads = [Workload("humaneval", tuple(chat_token_ids(smollm2.tokenizer, m) for m in humaneval_messages(1)), 16)]
    settings = BenchSettings(k=8, prompt_lookup_min=2, prompt_lookup_max=4, concurrency=2, repeats=1)
    http = HttpTarget(MODEL, "cpu", "float32", 2, make_decode(smollm2.tokenizer))
    messages: list[str] = []

    result = run_benchmark(smollm2.model, workloads, settings, eos, {}, messages.append, http)

    by_key = {(r.workload, r.key): r for r in result.rows}
    for w in workloads:
        for key in ("http-off-1", "http-ngram-1"):
            row = by_key[w.name, key]
            assert row.tokens_per_s > 0 and math.isfinite(row.tokens_per_s)
            assert row.output_tokens == by_key[w.name, key.removeprefix("http-")].output_tokens > 0
        assert by_key[w.name, "http-ngram-1"].mean_acceptance_length is not None
    http_checks = [c for c in result.checks if "HTTP" in c.name]
    assert len(http_checks) == 3 * len(workloads) and all(c.required and c.total for c in http_checks)
    assert result.failed_checks == 0, [c for c in result.checks if c.mismatches]
    names = {r.name for r in result.ratios}
    assert {"HTTP API ngram / in-process ngram (1 req)", "HTTP API off / in-process off (1 req)"} <= names
    serving = next(m for m in messages if "HTTP stack serving" in m)
    port = int(re.search(r":(\d+) ", serving).group(1))
    assert not listening(port), "the gateway was stopped after the benchmark"


def test_http_rows_are_on_by_default_and_quick_keeps_them():
    from services.bench import parse_args

    assert parse_args([]).http and parse_args(["--quick"]).http
    assert not parse_args(["--quick", "--no-http"]).http
