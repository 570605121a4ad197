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


def torch_after_gateway_main(*flags: str) -> str:
    result = subprocess.run([sys.executable, "-c", GATEWAY_MAIN, "--port", "1", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(("flags", "expected"), [((), "torch refused"),
                                                 (("--trust-remote-code",), "torch imported")])
def test_the_gateway_hides_torch_unless_remote_code_may_need_it(flags, expected):
    assert torch_after_gateway_main(*flags) == expected
