"""A plain, non-editable install works, and each service's install set carries only its own stack.

The project's sources (no generated code, no checkout around them) are built into a wheel once with
`pip wheel`, the same PEP 517 build that `pip install .` runs (its isolated build environment brings
grpcio-tools, the build hook generates the gRPC code), and that wheel is installed into fresh virtualenvs:

- core (`pip install specserve`): no torch, no transformers, no grpcio-tools; an ngram drafter really starts
  from it and answers the gRPC health check (the probe the images' HEALTHCHECK runs).
- gateway (`specserve[gateway]`): no torch; the gateway's app imports and the target's tokenizer (SmolLM2's
  GGUF file) loads and renders a chat through transformers' tokenizer classes.
- verifier and model drafter: installing torch into a fresh virtualenv would cost minutes and gigabytes, so this
  one virtualenv sees the test interpreter's packages (torch, transformers) through a .pth line, and gets the
  wheel itself with `--no-deps`: it checks that the wheel, not the source tree, holds what their commands import.

Packages come from the package index (pip's cache makes reruns fast); nothing needs a model hub.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from services.modeling.fetch import fetch_registered_model
from tests.deploy.dockerfiles import ROOT
from tests.ports import free_port

pytestmark = pytest.mark.slow  # builds the wheel and installs it into fresh virtualenvs: over a minute

SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "proto", "services")
PIP_TIMEOUT_S = 600


def run(command: list[str], *, timeout: float = PIP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run to success. From /, without PYTHONPATH: `python -c` must not find `services` in this checkout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd="/")
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def pip(*args: str) -> None:
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """specserve's wheel, built from a copy of its sources alone (no services/proto_gen from this checkout)."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("proto_gen", "__pycache__", "*.pyc")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    pip("wheel", "--no-deps", "--wheel-dir", str(dist), str(source))
    [built] = dist.glob("specserve-*.whl")
    return built


def new_venv(path: Path, extra: str, *, see: Path | None = None, no_deps: bool = False) -> Path:
    """A fresh virtualenv with the wheel installed (by this interpreter's pip); `see`: a site-packages folder
    its interpreter also reads (a .pth line, after its own)."""
    run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = path / "bin" / "python"
    # --no-compile: these venvs live for one test and run a few commands, which compile what they import (106 s ->
    # 72 s for this module on 2 cores); byte-compiling every installed file is not what the tests check
    pip("--python", str(python), "install", "--quiet", "--no-compile", *(["--no-deps"] if no_deps else []), extra)
    if see is not None:  # only now: pip must neither see nor touch what `see` holds
        purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
        (Path(purelib.strip()) / "test-overlay.pth").write_text(f"{see}\n")
    return path


def importable(venv: Path, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    return subprocess.run([str(venv / "bin" / "python"), "-c", probe], check=False, timeout=60).returncode == 0


def specserve(venv: Path, *args: str, timeout: float = 120) -> str:
    return run([str(venv / "bin" / "specserve"), *args], timeout=timeout).stdout


@pytest.fixture(scope="module")
def core(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_venv(tmp_path_factory.mktemp("venvs") / "core", str(wheel))


@pytest.fixture(scope="module")
def gateway(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_venv(tmp_path_factory.mktemp("venvs") / "gateway", f"{wheel}[gateway]")


def test_wheel_carries_generated_grpc_code_and_needs_no_build_tools_at_run_time(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [metadata_name] = [name for name in names if name.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    for proto in ("drafter", "verifier"):
        assert f"services/proto_gen/specserve/v1/{proto}_pb2.py" in names
        assert f"services/proto_gen/specserve/v1/{proto}_pb2_grpc.py" in names
    assert {name.split("/")[0] for name in names} == {"services", metadata_name.split("/")[0]}
    requirements = metadata.get_all("Requires-Dist")
    unconditional = {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
                     for r in requirements if ";" not in r}
    assert "grpcio-tools" not in unconditional and "torch" not in unconditional
    assert any(r.startswith("torch") and 'extra == "verifier"' in r for r in requirements)
    assert not any(r.startswith("torch") and 'extra == "gateway"' in r for r in requirements)


def test_core_install_has_no_model_stack_and_serves_an_ngram_drafter(core: Path) -> None:
    for module in ("torch", "transformers", "grpc_tools", "fastapi"):
        assert not importable(core, module), f"the core install pulled {module}"
    assert "usage: specserve" in specserve(core, "--help")
    for service in ("drafter", "serve"):
        assert "--port" in specserve(core, service, "--help")
    assert "--model" in specserve(core, "verifier", "--help")  # its flags need no torch
    assert "--verifier" in specserve(core, "gateway", "--help")  # nor the gateway's FastAPI
    # a command whose stack is not installed says in one line which extra brings it, not a traceback
    for argv, extra in ((["gateway", "--port", "1"], "gateway"), (["verifier", "--model", str(core)], "verifier")):
        result = subprocess.run([str(core / "bin" / "specserve"), *argv], capture_output=True, text=True,
                                timeout=60, check=False, cwd="/")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().endswith(f"pip install 'specserve[{extra}]'"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    port = free_port()
    drafter = subprocess.Popen(
        [str(core / "bin" / "specserve"), "drafter", "--method", "ngram", "--port", str(port), "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
    )
    probe = [str(core / "bin" / "python"), "-m", "services.common.health_probe", f"127.0.0.1:{port}"]
    try:
        deadline = time.monotonic() + 60
        while True:
            result = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False, cwd="/")
            if result.returncode == 0:
                break
            assert drafter.poll() is None, f"the drafter exited: {drafter.communicate()[0]}"
            assert time.monotonic() < deadline, f"no SERVING within 60 s: {result.stdout}{result.stderr}"
            time.sleep(0.5)
        assert result.stdout.strip() == f"127.0.0.1:{port}: SERVING"
    finally:
        drafter.send_signal(signal.SIGTERM)
        drafter.wait(timeout=30)
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False, cwd="/")
    assert refused.returncode == 1, "the probe must fail when nothing serves"


def test_gateway_install_has_no_torch_and_loads_the_tokenizer(gateway: Path) -> None:
    assert not importable(gateway, "torch"), "the gateway install pulled torch"
    assert "--verifier" in specserve(gateway, "gateway", "--help")
    model = fetch_registered_model("smollm2-135m-instruct")  # cached by the real-model tests too
    script = (
        "import sys\n"
        "import services.gateway.app\n"
        "from services.gateway.tokenizer import encode_chat, load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(model)!r})\n"
        "ids = encode_chat(tokenizer, [{'role': 'user', 'content': 'Name three rivers.'}])\n"
        "assert 'torch' not in sys.modules, 'something imported torch'\n"
        "print(len(ids), tokenizer.decode(ids))\n"
    )
    output = run([str(gateway / "bin" / "python"), "-c", script], timeout=300).stdout
    assert "Name three rivers." in output and "<|im_start|>" in output, output


def test_verifier_and_model_drafter_commands_run_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    venv = new_venv(tmp_path / "verifier", str(wheel), see=Path(sysconfig.get_paths()["purelib"]), no_deps=True)
    located = run([str(venv / "bin" / "python"), "-c", "import services; print(services.__file__)"]).stdout
    assert located.startswith(str(venv)), f"services imported from {located}, not from the installed wheel"
    assert "--speculative-config" in specserve(venv, "verifier", "--help", timeout=300)
    assert "--max-tokens" in specserve(venv, "generate", "--help", timeout=300)
    assert "draft_model" in specserve(venv, "drafter", "--help", timeout=300)
    model_drafter = "import services.drafter.methods.draft_model"  # imported only once a drafter runs it
    run([str(venv / "bin" / "python"), "-c", model_drafter], timeout=300)
