"""Reading the Dockerfiles' build stages, for tests that hold the images to the compose file and to each other."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = (ROOT / "Dockerfile.target", ROOT / "Dockerfile.drafter")


def dockerfile_stages(path: Path) -> dict[str, list[str]]:
    """Each build stage's instructions (continuation lines joined, comments dropped), by stage name."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for instruction in re.sub(r"\\\n\s*", " ", path.read_text()).splitlines():
        instruction = instruction.strip()
        if not instruction or instruction.startswith("#"):
            continue
        stage = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", instruction, re.IGNORECASE)
        if stage:
            current = stages.setdefault(stage.group(1), [])
        current.append(instruction)
    return stages


def instructions(stage: list[str], keyword: str) -> list[str]:
    """The arguments of every `keyword` instruction of a stage."""
    return [line[len(keyword):].strip() for line in stage if line.split(maxsplit=1)[0].upper() == keyword]


def entrypoint(stage: list[str]) -> list[str]:
    [line] = instructions(stage, "ENTRYPOINT")
    return json.loads(line)
