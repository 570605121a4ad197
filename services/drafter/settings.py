"""The drafter's configuration: one settings class, read from `SPECSERVE_DRAFTER_*` environment variables and
overridden by command-line flags (server.main), like the verifier's, so a Helm chart (env) and a shell (flags)
configure the same process the same way."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.tls import TlsServerSettings


class DrafterSettings(TlsServerSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_DRAFTER_", extra="forbid", frozen=True)

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(5, ge=1)  # the largest K served per step
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(50061, ge=0, le=65535)  # 0: a free port
    metrics_port: int | None = Field(8002, ge=0, le=65535)  # 0 or None: no metrics endpoint
    drain_s: float = Field(0.0, ge=0)  # on SIGTERM: NOT_SERVING this long before refusing new streams
    grace_s: float = Field(5.0, ge=0)  # then: time for open streams to end

    @model_validator(mode="after")
    def _lookup_range(self) -> DrafterSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self
