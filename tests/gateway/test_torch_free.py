"""The gateway process leaves torch unimported where torch is installed beside it (services/gateway/torch_free.py),
except with --trust-remote-code, where a tokenizer's own code may import it. Each case runs `specserve gateway`'s
main in a fresh interpreter (the test process has torch imported already), with uvicorn's server replaced by a
stub so that main returns once it would serve."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy.dockerfiles import ROOT

GATEWAY_MAIN = """
import sys
import uvicorn
uvicorn.run = lambda *args, **kwargs: None
from services.gateway.main import main
main(sys.argv[1:])
try:
    import torch
    print("torch imported")
except ImportError:
    print("torch refused")
"""


def gateway_main(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", GATEWAY_MAIN, "--port", "1", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.parametrize(("flags", "expected"), [((), "torch refused"),
                                                 (("--trust-remote-code",), "torch imported")])
def test_the_gateway_hides_torch_unless_remote_code_may_need_it(flags, expected):
    assert gateway_main(*flags).stdout.strip().splitlines()[-1] == expected


def test_the_gateway_does_not_tell_its_user_that_pytorch_is_missing():
    """transformers logs "PyTorch was not found. Models won't be available ..." when imported without torch: true of
    the gateway by design, and read by users as a broken install. The process gets as far as its tokenizer."""
    result = gateway_main("--model", "smollm2-135m-instruct")
    assert result.stdout.strip().splitlines()[-1] == "torch refused"
    assert "was not found" not in result.stderr, result.stderr
    assert "specserve gateway -> verifier" in result.stderr, "main ran to where it serves"
