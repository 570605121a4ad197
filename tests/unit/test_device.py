"""Device and dtype flags resolve to usable torch objects or fail at startup with an actionable message."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from services.common import device as device_mod
from services.common.device import resolve_device, resolve_dtype

CPU = torch.device("cpu")
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def test_cpu_and_case_and_whitespace() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device(" CPU ") == CPU
    assert resolve_device(torch.device("cpu")) == CPU


@pytest.mark.skipif(torch.cuda.is_available() or HAS_TORCH_NPU, reason="machine has an accelerator")
def test_auto_is_cpu_without_accelerators() -> None:
    assert resolve_device("auto") == CPU


def test_auto_prefers_cuda_then_npu_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.device('npu') only exists once torch_npu registers it, so the npu branch is checked by order."""
    probed: list[bool] = []
    monkeypatch.setattr(device_mod, "_npu_available", lambda: probed.append(True) or False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert probed == []  # CUDA wins without probing for NPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    assert probed == [True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_unavailable_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(RuntimeError, match="cuda"):
        resolve_device("cuda:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_checked() -> None:
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(RuntimeError, match="only"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_without_torch_npu_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import of torch_npu raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install torch_npu"):
        resolve_device("npu")
    assert device_mod._npu_available() is False


@pytest.mark.parametrize("bad", ["gpu", "tpu", "cuda:x", "", "cuda:-1"])
def test_unknown_device_names(bad: str) -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device(bad)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("torch.bfloat16", torch.bfloat16),
    ],
)
def test_dtype_names_on_cpu(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, CPU) is expected


def test_auto_dtype_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", CPU) is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.float16
    with pytest.raises(RuntimeError, match="bfloat16 is not supported"):
        resolve_dtype("bf16", torch.device("cuda"))
    assert resolve_dtype("fp16", torch.device("cuda")) is torch.float16


def test_dtype_objects_pass_through() -> None:
    assert resolve_dtype(torch.bfloat16, CPU) is torch.bfloat16
    with pytest.raises(ValueError, match="not supported"):
        resolve_dtype(torch.int8, CPU)


@pytest.mark.parametrize("bad", ["int8", "float64", "fp8", "", "bfloat"])
def test_unknown_dtype_names(bad: str) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype.*float32, bfloat16, float16"):
        resolve_dtype(bad, CPU)


@pytest.mark.parametrize("command", [["verifier"], ["generate", "--max-tokens", "1"]])
def test_a_device_that_cannot_run_here_is_the_commands_error_not_a_traceback(command, monkeypatch, capsys) -> None:
    """`specserve verifier --device cuda` on a machine without a GPU: one line saying what to change, exit 1."""
    from services import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([*command, "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert f"specserve {command[0]}: error: device 'cuda' requested" in err and "--device cpu" in err
    assert "Traceback" not in err
