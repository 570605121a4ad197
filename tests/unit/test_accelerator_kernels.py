"""The kernels a CUDA forward runs instead of the CPU's (a fused RMSNorm, SDPA attention) compute the same forward,
and are chosen only where they apply. Checked on CPU, where both forms run."""

import torch

from services.modeling.attention import attention_for, folded_sdpa_attention, grouped_attention, sdpa_attention
from services.modeling.attention_choice import (
    FORMS,
    VERIFY_WIDTH,
    AttentionByShape,
    choose_attention,
    measured_choice,
    probe_inputs,
)
from services.modeling.fused_norm import fused_rms_norm, module_norm, norm_for
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from tests.tiny_models import tiny_llama, tiny_qwen2


def test_the_fused_norm_computes_what_the_models_own_norm_does():
    for model in (tiny_llama(), tiny_qwen2()):
        for norm in (model.model.layers[0].input_layernorm, model.model.norm):
            with torch.no_grad():
                norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)  # a weight that is not all ones
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(3, 5, norm.weight.shape[0], dtype=dtype) * 4
                expected = norm.to(dtype)(x)
                got = fused_rms_norm(norm, x)
                assert got.dtype == expected.dtype
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)
            norm.float()


def test_the_fused_norm_runs_on_cuda_only_and_only_for_plain_rms_norms():
    norms = [tiny_llama().model.norm]
    assert norm_for(torch.device("cpu"), norms) is module_norm
    assert norm_for(torch.device("meta"), norms) is module_norm  # another accelerator: not measured there
    assert norm_for(torch.device("cuda"), norms) is fused_rms_norm  # chosen, not run: no device needed

    class GemmaRMSNorm(torch.nn.Module):  # weight applied as 1 + weight: not the plain formula
        variance_epsilon, weight = 1e-6, torch.nn.Parameter(torch.zeros(4))

    assert norm_for(torch.device("cuda"), norms + [GemmaRMSNorm()]) is module_norm
    assert norm_for(torch.device("cuda"), [torch.nn.LayerNorm(4)]) is module_norm


def test_the_sdpa_forms_are_grouped_attention():
    torch.manual_seed(0)
    for width in (1, 5):
        rows, heads, kv_heads, head_dim, span = 3, 8, 2, 16, 40
        q = torch.randn(rows, width, heads, head_dim)
        keys, values = torch.randn(kv_heads, rows, span, head_dim), torch.randn(kv_heads, rows, span, head_dim)
        ends = torch.tensor([40, 17, 5])
        fed = ends[:, None, None] - width + torch.arange(width)[None, :, None]
        allowed = torch.arange(span)[None, None, :] <= fed
        mask = torch.zeros(rows, 1, width, span).masked_fill_(~allowed[:, None], float("-inf"))
        expected = grouped_attention(q, keys, values, mask, 0.25)
        for form in (sdpa_attention, folded_sdpa_attention):
            torch.testing.assert_close(form(q, keys, values, mask, 0.25), expected, rtol=1e-5, atol=1e-5)
    assert attention_for(torch.device("cuda")) is sdpa_attention
    assert attention_for(torch.device("cpu")) is grouped_attention
    assert attention_for(torch.device("meta")) is grouped_attention  # another accelerator: not measured there


def test_a_forward_with_the_cuda_kernels_matches_the_plain_one():
    """The runner's body with CUDA's choices (fused norm, each SDPA form, or one form per query width as the
    start-up measurement may choose), run on CPU: the same logits as the plain body, for a batch of rows at
    different offsets (prefill, a verify-shaped step, then a decode)."""
    model = tiny_llama()
    by_width = AttentionByShape({"one token": (((1, 64), sdpa_attention),),
                                 "verify": (((1, 64), folded_sdpa_attention),),
                                 "prefill": (((1, 64), grouped_attention),)})
    logits = []
    for attention in (None, sdpa_attention, folded_sdpa_attention, by_width):
        runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=128, pack_weights=False)
        if attention is not None:
            runner._norm, runner._attention = fused_rms_norm, attention
        for i, prompt in enumerate(([3, 4, 5, 6, 7], [9, 10], [11, 12, 13])):
            runner.add_sequence(i)
            runner.forward([RowInput(i, prompt, 1)])
        verify = runner.forward([RowInput(i, [20 + i, 21, 22], 3) for i in range(3)])
        decode = runner.forward([RowInput(i, [30 + i], 1) for i in range(3)])
        logits.append((verify.logits, decode.logits))
    for verify, decode in logits[1:]:
        torch.testing.assert_close(verify, logits[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decode, logits[0][1], rtol=1e-4, atol=1e-4)


def test_the_measured_attention_form_is_the_fastest_for_each_query_width_rows_and_span():
    """measured_choice keeps, at each probe of one-token, verify-wide and prefill-wide queries, the form that took
    least there; a form that fails there is no candidate; a call takes the choice of the probe nearest its rows and
    span. Fake timings: the choice, not the clock, is under test."""
    widths = {"one token": 1, "verify": 5, "prefill": 24}
    shapes = ((1, 32), (8, 32), (8, 128))
    inputs = {width_class: [probe_inputs(rows, width, span, 8, 2, 16, torch.device("cpu"), torch.float32)
                            for rows, span in shapes] for width_class, width in widths.items()}

    def fast(width, rows, span):  # SDPA but for verifies of 8 rows, folded over 32 positions and matmuls over 128
        if width != 5 or rows == 1:
            return sdpa_attention
        return folded_sdpa_attention if span == 32 else grouped_attention

    def measure(form, probe):
        q, keys = probe[0], probe[1]
        if form is grouped_attention and q.shape[1] != 5:
            raise RuntimeError("not capturable here")
        return 1.0 if form is fast(q.shape[1], q.shape[0], keys.shape[2]) else 2.0

    chosen = measured_choice(inputs, measure)
    for width in (1, 5, 24):
        for rows, span in ((1, 20), (2, 40), (6, 30), (16, 100), (64, 4096)):  # each nearest one of the probes
            near_rows = 1 if rows < 3 else 8
            near_span = 32 if rows < 3 or span < 64 else 128
            assert chosen.form_for(rows, width, span) is fast(width, near_rows, near_span)
    assert "verify 8x5 over 32: folded SDPA" in chosen.description
    assert "verify 8x5 over 128: matmuls" in chosen.description
    for probes in inputs.values():  # whatever it dispatches to computes the same attention
        for probe in probes:
            torch.testing.assert_close(chosen(*probe), grouped_attention(*probe), rtol=1e-5, atol=1e-5)
    nothing_runs = measured_choice(inputs, lambda form, probe: (_ for _ in ()).throw(RuntimeError("no")))
    assert {form for entries in nothing_runs.chosen.values() for _, form in entries} == {FORMS["SDPA"]}
    assert choose_attention(torch.device("cpu"), torch.float32, 8, 2, 16) is grouped_attention  # measured on CUDA


def test_attention_by_shape_dispatches_on_the_query_length():
    def form(name):
        return lambda q, *rest: name

    by_shape = AttentionByShape({name: (((1, 64), form(name)),) for name in ("one token", "verify", "prefill")})
    for width, expected in ((1, "one token"), (2, "verify"), (VERIFY_WIDTH, "verify"), (VERIFY_WIDTH + 1, "prefill")):
        assert by_shape(torch.zeros(3, width, 8, 16), torch.zeros(2, 3, 64, 16), None, None, 1.0) == expected
