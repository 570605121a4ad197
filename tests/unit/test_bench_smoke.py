"""The benchmark pipeline end to end on a tiny random llama: every row, ratio and check comes out, and greedy
speculative output equals speculation off. Token ids go in directly, so no tokenizer or download is needed."""

from __future__ import annotations

import math
import random
import re

import torch

from services.bench import BenchSettings, run_benchmark
from services.bench.hardware import cpu_info, describe_hardware
from services.bench.prompts import Workload
from services.bench.report import RATIO_SPECS, format_report
from tests.tiny_models import VOCAB, tiny_llama

ROW_KEYS = ("hf-plain", "hf-pld", "off-1", "ngram-1", "suffix-1", "off-N", "ngram-N", "suffix-N")


def repetitive_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    """Repeated phrases, so prompt lookup finds something to propose."""
    phrases = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(3)]
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += rng.choice(phrases)
    return tuple(tokens[:length])


def test_bench_pipeline_on_tiny_model():
    model = tiny_llama(seed=5)
    model.generation_config.eos_token_id = None  # every request runs to max_tokens, as in the engine (no EOS)
    rng = random.Random(0)
    workloads = [
        Workload("humaneval", tuple(repetitive_prompt(rng, n) for n in (12, 20)), max_tokens=10),
        Workload("code-edit", (repetitive_prompt(rng, 30),), max_tokens=16),
        Workload("edit-sequence", (repetitive_prompt(rng, 24), repetitive_prompt(rng, 24)), max_tokens=12),
    ]
    settings = BenchSettings(k=3, prompt_lookup_min=1, prompt_lookup_max=3, concurrency=3, repeats=2)
    messages: list[str] = []

    result = run_benchmark(model, workloads, settings, [], {"model": "tiny llama"}, messages.append)

    assert messages, "progress lines were reported"
    assert {(r.workload, r.key) for r in result.rows} == {(w.name, k) for w in workloads for k in ROW_KEYS}
    by_name = {w.name: w for w in workloads}
    for row in result.rows:
        assert row.tokens_per_s > 0 and math.isfinite(row.tokens_per_s)
        w = by_name[row.workload]
        requests = settings.concurrency if row.concurrency > 1 else len(w.prompts)
        assert row.output_tokens == requests * w.max_tokens, row
    in_process = [spec for spec in RATIO_SPECS if not spec.numerator.startswith("http-")]  # no HTTP stack here
    assert len(result.ratios) == sum(len(spec.workloads) for spec in in_process)
    assert all(math.isfinite(r.value) and r.value > 0 for r in result.ratios)
    assert result.failed_checks == 0, [c for c in result.checks if c.mismatches]

    assert "lm_head" in result.header["specserve kernels"] or "plain" in result.header["specserve kernels"]
    assert re.fullmatch(r"(main|worker) \(one-token forward [\d.]+ ms on the main thread, [\d.]+ ms on a worker "
                        r"thread\)", result.header["specserve compute thread"])
    assert re.fullmatch(rf"1 position [\d.]+ ms, {settings.k + 1} positions [\d.]+ ms \([\d.]+x\) after \d+ tokens "
                        r"of context", result.header["specserve forward cost"])
    report = format_report(result)
    for heading in ("== ratios ==", "== greedy equality ==", "== markdown =="):
        assert heading in report
    assert report.count("MET") >= len(result.ratios)
    assert result.to_json()["rows"]


def test_hardware_lines_name_the_cpu_its_relevant_flags_and_torch_threads():
    cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu sse avx2 fma avx512f amx_tile amx_bf16\n"
    assert cpu_info(cpuinfo) == ("Intel(R) Xeon(R) Platinum", ("avx2", "fma", "avx512f", "amx_tile", "amx_bf16"))
    assert cpu_info("Features\t: fp asimd\n")[1] == ()  # an Arm machine: none of the x86 flags
    lines = describe_hardware()
    assert lines["cpu"] and f"intra-op {torch.get_num_threads()}" in lines["torch threads"]
