"""The benchmark pipeline end to end on a tiny random llama: every row, ratio and check comes out, and greedy
speculative output equals speculation off. Token ids go in directly, so no tokenizer or download is needed."""

from __future__ import annotations

import collections
import itertools
import math
import random
import re

import pytest
import torch

from services.bench import BenchSettings, parse_args, run_benchmark
from services.bench.hardware import cpu_info, describe_hardware
from services.bench.prompts import EDIT_SEQUENCE_RENAMES, Workload, build_workloads, multi_turn_messages
from services.bench.report import RATIO_SPECS, format_report
from services.bench.transformers_baseline import generate_one
from tests.gateway.fakes import EOS, byte_tokenizer
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


def test_multi_turn_prompts_hold_the_models_earlier_answers_and_run_through_every_row():
    """The multi-turn workload on a tiny random llama with a real (byte-level) tokenizer: prompt i + 1 is prompt
    i, then the model's greedy answer to it, then the next user turn; the other workloads are as before; and the
    conversation goes through the whole pipeline with every row and no greedy mismatch."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(seed=3, vocab_size=EOS + 1)
    model.generation_config.eos_token_id = None
    generated: list[tuple[int, ...]] = []

    def greedy(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        answer = generate_one(model, prompt, max_tokens, [EOS]).tokens
        generated.append(answer)
        return answer

    workloads = build_workloads(tokenizer, 1, 8, 12, greedy, num_turns=3)

    assert [(w.name, len(w.prompts), w.max_tokens) for w in workloads] == [
        ("humaneval", 1, 8), ("code-edit", 1, 12), ("edit-sequence", len(EDIT_SEQUENCE_RENAMES), 12),
        ("multi-turn", 3, 12),
    ]
    prompts = workloads[-1].prompts
    assert len(generated) == 2 and all(generated), "the last turn's answer is what the bench measures"
    questions = multi_turn_messages(3)
    for i, (prompt, following) in enumerate(itertools.pairwise(prompts)):
        assert following[: len(prompt)] == prompt, "each prompt extends the conversation before it"
        assert generated[i] == generate_one(model, prompt, 12, [EOS]).tokens, "answers are greedy, so repeatable"
        added = tokenizer.decode(list(following[len(prompt):]))
        answer = tokenizer.decode(list(generated[i]), skip_special_tokens=True)
        assert added == f"{answer}\n<|user|>{questions[i + 1]}\n<|assistant|>"  # fakes.CHAT_TEMPLATE's turns
    assert tokenizer.decode(list(prompts[0])).startswith("<|user|>Here is a Python class:")

    # adaptive off: every row verifies its drafts, so each drafter's row has an acceptance length on any machine
    settings = BenchSettings(k=3, prompt_lookup_min=1, prompt_lookup_max=3, concurrency=2, repeats=1,
                             adaptive_speculation=False)
    result = run_benchmark(model, workloads[-1:], settings, [], {}, lambda _: None)
    assert {(r.workload, r.key) for r in result.rows} == {("multi-turn", k) for k in ROW_KEYS}
    assert all(r.output_tokens > 0 and r.tokens_per_s > 0 for r in result.rows)
    assert all(r.mean_acceptance_length is not None for r in result.rows if r.key.startswith(("ngram", "suffix")))
    assert result.failed_checks == 0, [c for c in result.checks if c.mismatches]
    assert "| multi-turn | specserve suffix K<=3 | 2 |" in format_report(result)


def test_quick_runs_a_two_turn_conversation_and_turns_are_bounded(capsys):
    assert parse_args(["--quick"]).turns == 2 and parse_args([]).turns == 4
    assert parse_args(["--turns", "3"]).turns == 3
    with pytest.raises(SystemExit):
        parse_args(["--turns", "5"])
    assert "--turns" in capsys.readouterr().err


def test_hardware_lines_name_the_cpu_its_relevant_flags_and_torch_threads():
    cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu sse avx2 fma avx512f amx_tile amx_bf16\n"
    assert cpu_info(cpuinfo) == ("Intel(R) Xeon(R) Platinum", ("avx2", "fma", "avx512f", "amx_tile", "amx_bf16"))
    assert cpu_info("Features\t: fp asimd\n")[1] == ()  # an Arm machine: none of the x86 flags
    lines = describe_hardware()
    assert lines["cpu"] and f"intra-op {torch.get_num_threads()}" in lines["torch threads"]


async def test_a_steady_load_sends_each_prompt_once_a_client_at_a_time_and_keeps_their_order():
    """accelerator_step --rounds: generate_all with `clients` keeps at most that many requests in flight, each client
    sending its next as its last ends; the outputs are those of sending them all at once, in the prompts' order."""
    from services.bench.accelerator_step import generate_all
    from services.bench.request_lengths import request_tokens
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.sampling_params import SpeculationParams

    engine = Engine(LlamaFamilyRunner(tiny_llama(seed=4), max_num_seqs=4, max_model_len=512),
                    EngineConfig(log_stats_interval_s=0), {})
    prompts = [tuple(range(3 + i, 12 + 2 * i)) for i in range(7)]
    in_flight, most = 0, 0
    generate = engine.generate

    async def counted(request):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        async for output in generate(request):
            yield output
        in_flight -= 1

    async with engine:
        _, together = await generate_all(engine, prompts, 6, SpeculationParams())
        engine.generate = counted
        _, two_at_a_time = await generate_all(engine, prompts, 6, SpeculationParams(), clients=2)
        engine.generate = generate
        _, varied = await generate_all(engine, prompts, 6, SpeculationParams(), clients=2, varied=True)
    assert two_at_a_time == together and len(together) == 7 and all(len(out) == 6 for out in together)
    assert most == 2
    # --lengths varied: each its own length, the first tokens of the same greedy answers
    assert [len(out) for out in varied] == [request_tokens(i, 6, varied=True) for i in range(7)] != [6] * 7
    assert all(out == full[: len(out)] for out, full in zip(varied, together, strict=True))


async def test_step_phases_split_the_loop_into_its_parts_and_the_outputs_are_unchanged():
    """accelerator_step's StepPhases times the loop's parts (the plans, the commit, the cost model) beside the
    phases it had; wrapped, the engine's outputs are those of an engine not wrapped."""
    from services.bench.accelerator_step import StepPhases, generate_all
    from services.drafter.methods.ngram import NgramProposer
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.sampling_params import SpeculationParams

    rng = random.Random(2)
    prompts = [repetitive_prompt(rng, 24) for _ in range(3)]
    outputs = []
    for wrapped in (False, True):
        engine = Engine(LlamaFamilyRunner(tiny_llama(seed=4), max_num_seqs=4, max_model_len=256),
                        EngineConfig(log_stats_interval_s=0), {"ngram": NgramProposer()})
        phases = StepPhases(engine) if wrapped else None
        async with engine:
            if phases is not None:
                with phases:
                    _, out = await generate_all(engine, prompts, 12, SpeculationParams("ngram", 3))
            else:
                _, out = await generate_all(engine, prompts, 12, SpeculationParams("ngram", 3))
        outputs.append(out)
    assert outputs[0] == outputs[1]
    summary = phases.summary()
    found = re.search(r"loop (-?[\d.]+) \(plan ([\d.]+), second plan ([\d.]+), commit ([\d.]+), cost model ([\d.]+), "
                      r"rest (-?[\d.]+)\)", summary)
    assert found, summary
    loop, *parts, rest = map(float, found.groups())
    assert all(part >= 0 for part in parts) and parts[2] > 0  # every step committed rows
    assert math.isclose(sum(parts) + rest, loop, abs_tol=0.02)


async def test_step_phases_time_the_verifiers_reads_of_kept_states_apart_with_the_positions_read():
    """An EAGLE-like drafter reads the target's states: the asks' reads of them from the runner are timed apart,
    and the positions counted are those the runner was asked for."""
    from services.bench.accelerator_step import StepPhases, generate_all
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.sampling_params import SpeculationParams
    from tests.unit.test_hidden_states import RecordingProposer

    rng = random.Random(3)
    prompts = [repetitive_prompt(rng, 20 + 4 * i) for i in range(3)]
    proposer = RecordingProposer(True, {}, no_draft=1.0)  # asked, it answers no draft (continuation unused)
    proposer.continuation = collections.defaultdict(list)
    runner = LlamaFamilyRunner(tiny_llama(seed=4), max_num_seqs=4, max_model_len=256)
    read_positions = []
    read = runner.kept_hidden_states_of

    def counted(ranges):
        read_positions.append(sum(stop - start for _, start, stop in ranges))
        return read(ranges)

    runner.kept_hidden_states_of = counted
    engine = Engine(runner, EngineConfig(log_stats_interval_s=0, adaptive_speculation=False),
                    {"recorder": proposer})
    phases = StepPhases(engine)
    async with engine:
        with phases:
            await generate_all(engine, prompts, 8, SpeculationParams("recorder", 2))
    found = re.search(r"kept states within them: ([\d.]+) ms in all, (\d+) positions", phases.summary())
    assert found and read_positions, phases.summary()
    assert int(found.group(2)) == sum(read_positions) > sum(map(len, prompts)) - len(prompts)
