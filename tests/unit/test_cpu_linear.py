"""oneDNN-packed linears (cpu_linear.py) and the per-shape, per-M choice between them and F.linear
(kernel_choice.py): decisions checked with fake timings, outputs checked against F.linear."""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest
import torch

from services.modeling import kernel_choice
from services.modeling.cpu_linear import packed_linear
from services.modeling.kernel_choice import (
    DEFAULT_ROWS,
    DispatchLinear,
    KernelChoice,
    KernelChooser,
    measure_choice,
)
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from tests.cpu_features import bf16_linear_supported, needs_bf16_linear
from tests.memory import mapping_rss
from tests.tiny_models import tiny_llama


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (9, 64), (2, 5, 64)])
def test_packed_linear_matches_plain_linear(with_bias, shape):
    torch.manual_seed(0)
    weights = [torch.randn(48, 64), torch.randn(16, 64)]
    biases = [torch.randn(48), torch.randn(16)] if with_bias else [None, None]
    linear = packed_linear(weights, biases)
    assert linear is not None, "oneDNN is available in the CPU build of torch this project pins"
    x = torch.randn(*shape)
    expected = torch.nn.functional.linear(x, torch.cat(weights), torch.cat(biases) if with_bias else None)
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)


def test_unsupported_inputs_fall_back_to_none():
    assert packed_linear([torch.randn(4, 4, dtype=torch.float64)], [None]) is None
    assert packed_linear([torch.randn(4, 4), torch.randn(4, 4)], [torch.randn(4), None]) is None



@needs_bf16_linear
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_bfloat16_copy_computes_the_linear_of_the_rounded_weights_and_inputs(with_bias):
    """The drafters' bf16 candidate: the products of bf16-rounded weights and inputs, accumulated in float32, the
    bias added in float32, returned in the input's dtype."""
    torch.manual_seed(0)
    weights = [torch.randn(48, 64), torch.randn(16, 64)]
    biases = [torch.randn(48), torch.randn(16)] if with_bias else [None, None]
    linear = packed_linear(weights, biases, torch.bfloat16)
    assert linear is not None, "oneDNN's bf16 linear is available in the CPU build of torch this project pins"
    x = torch.randn(5, 64)
    bias = torch.cat(biases) if with_bias else None
    got = linear(x)
    assert got.dtype == torch.float32
    rounded = torch.nn.functional.linear(x.bfloat16().float(), torch.cat(weights).bfloat16().float(), bias)
    torch.testing.assert_close(got, rounded, atol=2e-2, rtol=1e-2)  # what is left: the output's own rounding
    exact = torch.nn.functional.linear(x, torch.cat(weights), bias)
    assert (got - exact).abs().max() > 1e-3, "the float32 products: no bf16 copy ran"
    held = [cell.cell_contents for cell in linear.__closure__ if isinstance(cell.cell_contents, torch.Tensor)]
    dense = [t for t in held if t.layout == torch.strided and t.dim() > 1]
    assert not dense, "the kernel keeps an unpacked copy of the weights alive beside its packed one"
    assert packed_linear([torch.randn(4, 4, dtype=torch.float64)], [None], torch.bfloat16) is None

# -- the choice between plain and packed (kernel_choice.py) -------------------------------------------------


def recording_kernels(calls: list[tuple[str, int]], tag: int = 0):
    """Stand-in candidates that record (name, rows) per call (name suffixed with tag if given) and return x."""

    def kernel(name):
        def run(x):
            calls.append((f"{name}{tag or ''}", x.numel() // x.shape[-1]))
            return x

        return run

    return {"plain": kernel("plain"), "packed": kernel("packed")}


def fake_timer(seconds):
    """A `measure` that runs the kernel but reports seconds(name, rows) instead of timing it."""

    def measure(name, kernel, x):
        kernel(x)
        return seconds(name, x.shape[0])

    return measure


def plain_up_to_4(name: str, m: int) -> float:
    """Fake timings: plain wins at M <= 4 tokens, packed from 5 on (the Intel pattern of issue 8)."""
    if name == "plain":
        return 1e-6 if m <= 4 else 3e-6
    return 2e-6


def test_choice_follows_fake_timings_per_bucket():
    calls: list[tuple[str, int]] = []
    choice = measure_choice([recording_kernels(calls)], 16, torch.float32, measure=fake_timer(plain_up_to_4))
    assert choice.rows == tuple(sorted(DEFAULT_ROWS))
    assert choice.chosen == ("plain", "plain", "plain", "packed", "packed", "packed", "packed")
    assert choice.seconds[0] == (1e-6, 2e-6)
    expected = {1: "plain", 3: "plain", 4: "plain", 5: "packed", 8: "packed", 9: "packed", 64: "packed", 900: "packed"}
    assert {m: choice.kernel_at(m) for m in expected} == expected
    assert choice.describe() == "plain at M=1..4, packed at M>=5"
    # M=1 first, then M=8 (decode and verify sizes before the rest), each with one warm-up call per candidate
    assert [m for _, m in calls][:12] == [1] * 12 and calls[12][1] == 8
    # interleaved, the order rotated each round: warm-up, then plain-packed, packed-plain, plain-packed, ...
    assert [name for name, _ in calls[:8]] == ["plain", "packed"] * 2 + ["packed", "plain"] + ["plain", "packed"]


def test_each_round_goes_to_the_next_weight_of_the_shape():
    calls: list[tuple[str, int]] = []
    instances = [recording_kernels(calls, tag) for tag in (1, 2, 3)]
    measure_choice(instances, 16, torch.float32, rows=(1, 8), measure=fake_timer(plain_up_to_4))
    weights_in_turn = [name[-1] for name, _ in calls[::2]]  # each round calls both candidates of one weight
    assert weights_in_turn == list("123123123123"), "warm-up and 5 rounds per M, cycling through the weights"
    assert all(a[0][-1] == b[0][-1] for a, b in zip(calls[::2], calls[1::2])), "both candidates of one weight"


def test_interference_on_most_repetitions_does_not_decide():
    """Contention only adds time: plain is judged by its undisturbed calls even when 3 of its 5 were slowed."""
    seen = Counter()

    def seconds(name, m):
        seen[name] += 1
        if name == "plain":
            return 9e-6 if seen[name] in (2, 3, 4) else 1e-6  # warm-up is call 1; rounds 1-3 hit by other work
        return 2e-6

    choice = measure_choice([recording_kernels([])], 8, torch.float32, rows=(1,), measure=fake_timer(seconds))
    assert choice.chosen == ("plain",), "the fastest repetition decides (a median of 5 would pick packed)"


@pytest.mark.parametrize(("packed_s", "expected"), [(0.98e-6, "plain"), (0.5e-6, "packed")])
def test_packed_must_be_faster_by_more_than_the_margin(packed_s, expected):
    timer = fake_timer(lambda name, m: 1e-6 if name == "plain" else packed_s)
    choice = measure_choice([recording_kernels([])], 8, torch.float32, rows=(1,), measure=timer)
    assert choice.chosen == (expected,)


def test_budget_keeps_decode_and_verify_sizes_and_extends_the_largest_measured():
    calls: list[tuple[str, int]] = []

    def seconds(name, m):  # M=1 is cheap; M=8 alone overruns the 0.1 s budget
        if m == 1:
            return 1e-3 if name == "plain" else 2e-3
        return 0.05 if name == "plain" else 0.01

    timer = fake_timer(seconds)
    choice = measure_choice([recording_kernels(calls)], 8, torch.float32, measure=timer, budget_s=0.1)
    assert choice.rows == (1, 8) and choice.chosen == ("plain", "packed")
    assert Counter(m for _, m in calls) == {1: 12, 8: 2 + 2 * 3}, "M=8 stops after warm-up and 3 rounds"
    assert [choice.kernel_at(m) for m in (1, 2, 8, 64)] == ["plain", "packed", "packed", "packed"]


def test_dispatch_runs_the_chosen_kernel_for_each_calls_rows():
    calls: list[tuple[str, int]] = []
    choice = KernelChoice(("plain", "packed"), (1, 4, 16), ("plain", "packed", "plain"), ((0, 0),) * 3)
    linear = DispatchLinear(recording_kernels(calls), choice, in_features=8)
    for shape in [(1, 8), (3, 8), (2, 2, 8), (1, 5, 8), (16, 8), (40, 8), (2, 1, 8)]:
        linear(torch.zeros(shape))
    assert calls == [
        ("plain", 1),
        ("packed", 3),
        ("packed", 4),
        ("plain", 5),
        ("plain", 16),
        ("plain", 40),
        ("packed", 2),
    ]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("timings", ["measured", "fake"])
def test_chosen_linear_matches_plain_linear_at_every_rows(with_bias, timings):
    torch.manual_seed(0)
    weights = [torch.randn(48, 64), torch.randn(16, 64)]
    biases = [torch.randn(48), torch.randn(16)] if with_bias else [None, None]
    chooser = KernelChooser() if timings == "measured" else KernelChooser(measure=fake_timer(plain_up_to_4))
    linear = chooser.linear("gate/up", weights, biases)
    assert linear is not None
    if timings == "fake":
        assert linear.choice.describe() == "plain at M=1..4, packed at M>=5"  # both paths run below
    expected_weight, expected_bias = torch.cat(weights), torch.cat(biases) if with_bias else None
    for shape in [(1, 64), (3, 64), (2, 5, 64), (9, 64), (70, 64)]:
        x = torch.randn(*shape)
        expected = torch.nn.functional.linear(x, expected_weight, expected_bias)
        torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)


def bf16_wins(name: str, m: int) -> float:
    return 1e-6 if name == "bf16" else 3e-6


def test_bfloat16_is_a_candidate_only_where_a_drafter_allows_it_and_the_cpu_has_it():
    torch.manual_seed(0)
    weights = [torch.randn(48, 64)]
    supported = bf16_linear_supported()
    assert (packed_linear(weights, [None], torch.bfloat16) is not None) == supported
    timed: set[str] = set()
    drafter = KernelChooser(measure=fake_timer(lambda name, m: timed.add(name) or bf16_wins(name, m)),
                            allow_bf16=True)
    linear = drafter.linear("gate/up", weights, [None])
    if supported:
        assert timed == {"plain", "packed", "bf16"} and linear.choice.describe() == "bf16 at all M"
        x = torch.randn(3, 64)
        torch.testing.assert_close(linear(x), packed_linear(weights, [None], torch.bfloat16)(x))
    else:  # an AVX2-only CPU: the copy cannot be built, so it is neither timed nor chosen
        assert timed == {"plain", "packed"} and "bf16" not in linear.choice.describe()
    timed.clear()
    verifier = KernelChooser(measure=fake_timer(lambda name, m: timed.add(name) or bf16_wins(name, m)))
    assert verifier.linear("gate/up", weights, [None]).choice.describe() != "bf16 at all M"
    assert timed == {"plain", "packed"}
    timed.clear()  # weights already in bf16 have no rounded copy to add (and without a bf16 linear, no packed one)
    drafter.linear("o_proj", [torch.randn(8, 64, dtype=torch.bfloat16)], [None])
    assert timed == ({"plain", "packed"} if supported else set())


def test_a_verifier_runner_never_rounds_its_target_to_bfloat16():
    """The target's products decide the output: the runner's own chooser does not offer bf16 however fast."""
    runner = LlamaFamilyRunner(tiny_llama(), max_num_seqs=1, max_model_len=16)
    assert runner._chooser is not None and not runner._chooser.allow_bf16
    assert all("bf16" not in choice.names for choice in runner._chooser.choices.values())


def test_no_packing_means_no_candidate_and_no_measurement():
    calls: list[tuple[str, int]] = []
    chooser = KernelChooser(measure=fake_timer(lambda name, m: calls.append((name, m)) or 1e-6))
    assert chooser.linear("o_proj", [torch.randn(8, 8, dtype=torch.float64)], [None]) is None
    assert calls == [] and chooser.choices == {} and chooser.measure_seconds == 0.0


def test_runner_measures_each_distinct_shape_once_and_matches_unpacked():
    model = tiny_llama()
    calls = Counter()
    chooser = KernelChooser(measure=fake_timer(lambda name, m: calls.update([m]) or plain_up_to_4(name, m)))
    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=64, kernel_chooser=chooser)
    reference = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=64, pack_weights=False)

    assert len(chooser.choices) == 5, "q/k/v, o_proj, gate/up, down_proj and the head: 2 layers share 4 shapes"
    assert calls[1] == 5 * 12, "one measurement per shape: 2 warm-up + 5 rounds of 2 calls at M=1"
    assert runner.kernels.startswith("per-shape choice of F.linear (plain) or oneDNN-packed by measurement: ")
    assert "q/k/v [128x64] plain at M=1..4, packed at M>=5" in runner.kernels
    assert "lm_head [96x64] plain at M=1..4, packed at M>=5" in runner.kernels
    assert reference.kernels == "plain torch modules (F.linear)"

    tokens = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    for r in (runner, reference):
        r.add_sequence("a")
    for chunk, logits in ((tokens[:30], 30), (tokens[30:31], 1), (tokens[31:33], 2), (tokens[33:], 7)):
        got = runner.forward([RowInput("a", chunk, logits)]).logits
        expected = reference.forward([RowInput("a", chunk, logits)]).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_packed_copies_of_a_shape_that_never_wins_are_freed(monkeypatch):
    packed_kernels: dict[tuple[int, int], list[weakref.ref]] = {}
    real_packed_linear = kernel_choice.packed_linear

    def tracking_packed_linear(weights, biases):
        kernel = real_packed_linear(weights, biases)
        shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
        packed_kernels.setdefault(shape, []).append(weakref.ref(kernel))
        return kernel

    monkeypatch.setattr(kernel_choice, "packed_linear", tracking_packed_linear)

    def measure(name, kernel, x):  # packed wins only where in_features is 128: the [64x128] down_proj
        kernel(x)
        return 1e-6 if name == "plain" else (0.5e-6 if x.shape[1] == 128 else 2e-6)

    runner = LlamaFamilyRunner(tiny_llama(), max_num_seqs=1, max_model_len=16, kernel_chooser=KernelChooser(measure))
    gc.collect()
    alive = {shape: sum(ref() is not None for ref in refs) for shape, refs in packed_kernels.items()}
    assert alive == {(128, 64): 0, (64, 64): 0, (256, 64): 0, (64, 128): 2, (96, 64): 0}, "only down_proj's kept"
    assert "o_proj [64x64] plain at all M" in runner.kernels and "down_proj [64x128] packed at all M" in runner.kernels


def test_a_runner_that_owns_its_model_keeps_one_layout_of_each_weight():
    """owns_model: one kernel per shape at every M (the one fastest relative to plain across M), the modules' weights
    freed where packed runs, and the same logits as the plain modules."""
    model, reference_model = tiny_llama(), tiny_llama()

    def measure(name, kernel, x):  # packed wins only for the [64x128] down_proj, and only summed over M
        kernel(x)
        if name == "plain":
            return 1e-6 if x.shape[0] <= 4 else 4e-6
        return (0.5e-6 if x.shape[0] <= 4 else 1e-6) if x.shape[1] == 128 else 5e-6

    chooser = KernelChooser(measure, one_layout=True)
    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=64, kernel_chooser=chooser, owns_model=True)
    assert "down_proj [64x128] packed at all M" in runner.kernels and "o_proj [64x64] plain at all M" in runner.kernels
    down = [layer.mlp.down_proj.weight for layer in model.model.layers]
    assert all(w.numel() == 0 for w in down) and runner.freed_weight_bytes == sum(64 * 128 * 4 for _ in down)
    assert all(layer.self_attn.o_proj.weight.numel() == 64 * 64 for layer in model.model.layers)
    choice = KernelChoice(("plain", "packed"), (1, 8), ("plain", "packed"), ((1.0, 3.0), (4.0, 1.0)))
    assert choice.one_kernel().chosen == ("packed", "packed")  # 3x and 0.25x plain's: 0.87x geometric mean
    # a near tie at small M is not outvoted by one large M's seconds (which a sum would let decide)
    choice = KernelChoice(("plain", "packed"), (1, 2, 4, 64), ("plain",) * 4,
                          ((1.0, 0.8), (1.0, 0.8), (1.0, 0.8), (10.0, 11.0)))
    assert choice.one_kernel().chosen == ("packed",) * 4
    choice = KernelChoice(("plain", "packed"), (1, 8), ("plain",) * 2, ((1.0, 1.0), (2.0, 2.0)))
    assert choice.one_kernel().chosen == ("plain", "plain")  # a tie keeps the first

    reference = LlamaFamilyRunner(reference_model, max_num_seqs=1, max_model_len=64, pack_weights=False)
    tokens = torch.randint(0, model.config.vocab_size, (20,)).tolist()
    for r in (runner, reference):
        r.add_sequence("a")
    torch.testing.assert_close(runner.forward([RowInput("a", tokens, 3)]).logits,
                               reference.forward([RowInput("a", tokens, 3)]).logits, atol=1e-4, rtol=1e-4)


def test_each_shape_frees_what_it_no_longer_runs_before_the_next_shape_is_packed(monkeypatch):
    """The start-up peak: a runner that owns its model holds one shape's packed copies beside the model, not every
    shape's. When a shape is packed, the module weights of every shape chosen before it are already freed."""
    model = tiny_llama()
    layers = model.model.layers
    modules_by_role = {
        (128, 64): lambda: [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                             layer.self_attn.v_proj)],
        (64, 64): lambda: [layer.self_attn.o_proj for layer in layers],
        (256, 64): lambda: [m for layer in layers for m in (layer.mlp.gate_proj, layer.mlp.up_proj)],
    }
    seen: list[tuple[int, int]] = []
    still_held: list[tuple[tuple[int, int], tuple[int, int]]] = []
    pack = kernel_choice.packed_linear

    def recording(weights, biases, dtype=None):
        shape = (sum(int(w.shape[0]) for w in weights), int(weights[0].shape[1]))
        if shape not in seen:
            for earlier in seen:  # every shape chosen before this one: its weights gone (packed won everywhere)
                held = [m for m in modules_by_role.get(earlier, list)() if m.weight.numel()]
                if held:
                    still_held.append((shape, earlier))
            seen.append(shape)
        return pack(weights, biases, dtype)

    monkeypatch.setattr(kernel_choice, "packed_linear", recording)
    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=16, owns_model=True,
                               kernel_chooser=KernelChooser(_packed_everywhere, one_layout=True))
    assert len(seen) == 5 and still_held == []
    assert all(layer.mlp.down_proj.weight.numel() == 0 for layer in layers) and runner.freed_weight_bytes > 0


def _packed_everywhere(name, kernel, x):
    kernel(x)
    return 1e-6 if name == "packed" else 2e-6


def test_layer_weights_that_run_packed_give_their_pages_in_the_checkpoints_mapping_back(tmp_path):
    """owns_model and every layer linear packed at every M: each layer's plain weights are dropped, and where they
    lie in the safetensors file's mapping their resident pages go too (released together, a shape at a time)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)  # safetensors, mapped when loaded
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    layer_weights = [module.weight for layer in model.model.layers for module in
                     (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                      *(getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")))]
    address, layer_bytes = layer_weights[0].data_ptr(), sum(w.nbytes for w in layer_weights)
    for weight in model.parameters():
        float(weight.detach().sum())  # every page of the checkpoint resident
    before = mapping_rss(address)

    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=64, owns_model=True,
                               kernel_chooser=KernelChooser(_packed_everywhere, one_layout=True))
    assert all(weight.numel() == 0 for layer in model.model.layers for weight in
               (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight))
    assert runner.freed_weight_bytes >= layer_bytes
    assert before - mapping_rss(address) >= layer_bytes - 2 * 4096 * len(layer_weights)  # whole pages only


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_that_runs_packed_keeps_one_copy(tmp_path, tied):
    """owns_model and a head packed at every M: an untied head's plain weight is freed; a tied one is the
    embedding's table, so only its resident pages in the checkpoint's mapping are dropped (lookups read rows back
    from the file) - and the logits are the plain modules'."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(tmp_path)  # safetensors, mapped when loaded
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight
    assert (model.lm_head.weight.data_ptr() == table.data_ptr()) is tied
    head_bytes = model.lm_head.weight.nbytes  # 2 MiB
    float(table.detach().sum())  # every page of the table resident
    before = mapping_rss(table.data_ptr())

    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=64, owns_model=True,
                               kernel_chooser=KernelChooser(_packed_everywhere, one_layout=True))
    if tied:
        assert model.lm_head.weight.numel() == table.numel()
        assert before - mapping_rss(table.data_ptr()) >= head_bytes - 8192  # whole pages only
    else:
        assert model.lm_head.weight.numel() == 0
    assert runner.freed_weight_bytes >= head_bytes - 8192

    plain = LlamaFamilyRunner(reference, max_num_seqs=1, max_model_len=64, pack_weights=False)
    tokens = torch.randint(0, config.vocab_size, (24,)).tolist()
    for r in (runner, plain):
        r.add_sequence("a")
    torch.testing.assert_close(runner.forward([RowInput("a", tokens, 4)]).logits,
                               plain.forward([RowInput("a", tokens, 4)]).logits, atol=1e-4, rtol=1e-4)
