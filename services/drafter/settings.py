"""The drafter's configuration: one settings class, read from `SPECSERVE_DRAFTER_*` environment variables and
overridden by command-line flags (server.main), like the verifier's, so a Helm chart (env) and a shell (flags)
configure the same process the same way."""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.speculative_config import SpeculativeConfig
from services.common.tls import TlsServerSettings

# Setting -> the SpeculativeConfig field it overrides. The model flags keep the names every specserve command
# uses for a model (--model, --device, --dtype, --max-num-seqs, --max-model-len, --enforce-eager); in a drafter
# process there is only one model, the draft model (or EAGLE head), so they mean its settings.
CONFIG_OVERRIDES = MappingProxyType({
    "method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "model": "model",
    "device": "draft_device",
    "dtype": "draft_dtype",
    "max_num_seqs": "draft_max_num_seqs",
    "max_model_len": "max_model_len",
    "enforce_eager": "enforce_eager",
})


class DrafterSettings(TlsServerSettings):
    """The method and its options come from `speculative_config` (the same vLLM-shaped JSON the verifier and
    `specserve serve` take, so every method's options reach the drafter without a flag of their own); the
    method, K, n-gram and draft-model flags override single fields of it (CONFIG_OVERRIDES). Unset fields keep
    SpeculativeConfig's defaults: one source of defaults for every process."""

    model_config = SettingsConfigDict(env_prefix="SPECSERVE_DRAFTER_", extra="forbid", frozen=True)

    speculative_config: str | None = None  # JSON, as the verifier's --speculative-config
    method: str | None = None  # a registered method (services/common/drafter_methods.py)
    num_speculative_tokens: int | None = Field(None, ge=1)  # the largest K served per step
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)
    model: str | None = None  # draft_model: the draft model (registered name, folder, .gguf file or hub id)
    device: str | None = None  # draft_model: where it runs (auto | cpu | cuda | cuda:N | npu | npu:N)
    dtype: str | None = None  # draft_model: auto | float32 | bfloat16 | float16
    max_num_seqs: int | None = Field(None, ge=1)  # draft_model: sequences with a KV slot (the rest are evicted)
    max_model_len: int | None = Field(None, ge=2)  # draft_model: positions per KV slot
    enforce_eager: bool | None = None  # draft_model, eagle: on an accelerator, no captured graphs
    compute_thread: Literal["auto", "main", "worker"] = "auto"  # draft_model: thread for the forwards; auto: measured
    host: str = "127.0.0.1"
    port: int = Field(50061, ge=0, le=65535)  # 0: a free port
    metrics_port: int | None = Field(8002, ge=0, le=65535)  # 0 or None: no metrics endpoint
    drain_s: float = Field(0.0, ge=0)  # on SIGTERM: NOT_SERVING this long before refusing new streams
    grace_s: float = Field(5.0, ge=0)  # then: time for open streams to end

    @model_validator(mode="after")
    def _valid_speculation(self) -> DrafterSettings:
        speculation = self.speculation  # fails at start-up, naming the bad field
        if not speculation.enabled:
            raise ValueError("a drafter needs a speculative method and num_speculative_tokens >= 1, not 'none'")
        return self

    @property
    def speculation(self) -> SpeculativeConfig:
        overrides = {
            field: getattr(self, name) for name, field in CONFIG_OVERRIDES.items() if getattr(self, name) is not None
        }
        if not self.speculative_config and not overrides:
            return SpeculativeConfig()  # the defaults (ngram), where the verifier's flag would mean "none"
        return SpeculativeConfig.parse(self.speculative_config, overrides)
