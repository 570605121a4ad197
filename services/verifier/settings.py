"""The verifier's configuration: one settings class, read from `SPECSERVE_VERIFIER_*` environment variables and
overridden by command-line flags (main.py), so the same process is configured the same way by a Helm chart
(env) and by a person at a shell (flags)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.byte_size import parse_bytes
from services.common.human_counts import human_readable_int
from services.common.speculative_config import SpeculativeConfig
from services.common.tls import TlsServerSettings
from services.modeling.registry import DEFAULT_MODEL


def default_measurement_dir() -> Path:
    """Where measurement_store.py keeps start-up measurements: `$XDG_CACHE_HOME/specserve/measurements` (default
    `~/.cache/...`), beside the models, not among them. Here, not there: settings import no torch."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specserve" / "measurements"


def parse_drafter(spec: str) -> tuple[str, str]:
    """"name=host:port" -> (name, "host:port"); the name is what requests select as their method."""
    name, sep, address = spec.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not name.strip() or not colon or not host or not port.isdigit():
        raise ValueError(f"--drafter must look like name=host:port (e.g. ngram=127.0.0.1:50061), got {spec!r}")
    if name.strip() == "none":
        raise ValueError("'none' is reserved (it turns speculation off per request); pick another drafter name")
    return name.strip(), address


class VerifierSettings(TlsServerSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_VERIFIER_", extra="forbid", frozen=True)

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False  # vLLM's: run the Python a model's folder (or hub repo) ships with its config
    max_num_seqs: int = Field(64, ge=1)  # a scheduling limit; KV memory is the pool's (kv_cache_memory_bytes)
    max_model_len: int | None = Field(None, ge=2)  # None: the model's whole context
    # the paged KV pool's size, as vLLM's --kv-cache-memory-bytes ("4GiB", "512M" or bytes); None: a share of
    # the memory available at start-up (services/modeling/kv_budget.py)
    kv_cache_memory_bytes: str | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)  # vLLM's: the device memory share (kv_budget.py)
    block_size: int = Field(16, ge=1, le=1024)  # tokens per KV block
    enable_prefix_caching: bool = True  # reuse the KV blocks of a cached prompt prefix (vLLM's APC)
    max_num_batched_tokens: int = Field(512, ge=1)
    max_waiting_requests: int = Field(256, ge=0)
    max_logprobs: int = Field(20, ge=-1)  # vLLM's: most alternatives per position a request may ask; -1: vocabulary
    seed: int | None = None  # vLLM's: seeds the requests that give none (EngineConfig.seed); None: fresh randomness
    compute_thread: Literal["auto", "main", "worker"] = "auto"  # thread for the forwards; auto: measured
    enforce_eager: bool = False  # vLLM's: on an accelerator, never replay captured graphs (step_graphs.py)
    cuda_graph_sizes: list[int] | None = None  # vLLM's: row counts a graph is captured for; None: 1, 2, 4, 8, 16...
    batch_invariant: bool = False  # forwards of one fixed shape: bit-identical greedy output with speculation on/off
    adaptive_speculation: bool = True  # verify only draft positions worth their cost (speculation_planner.py)
    draft_timeout_s: float = Field(0.5, gt=0)  # per step; a late drafter costs K = 0 for that step
    max_draft_timeout_s: float = Field(2.0, gt=0)  # the deadline grows with a drafter's measured calls up to this
    drafter_health_interval_s: float = Field(2.0, ge=0)  # Info probe of a drafter idle this long; 0: never
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)  # 0: a free port
    metrics_port: int | None = Field(8001, ge=0, le=65535)  # 0 or None: no metrics endpoint
    speculative_config: str | None = None  # JSON, as vLLM's --speculative-config
    drafters: list[str] = Field(default_factory=list)  # "name=host:port"
    # the target layers whose hidden states drafters receive (services/modeling/hidden_layers.py); None: what the
    # drafters reached at start-up declare (served_hidden_layers.py)
    hidden_layers: list[int] | None = None
    drain_s: float = Field(0.0, ge=0)  # on SIGTERM: NOT_SERVING this long before refusing new calls
    grace_s: float = Field(5.0, ge=0)  # then: time for calls in flight to finish
    drafter_tls_root_cert: str | None = None  # PEM root certificate: the links to drafters use TLS
    log_stats_interval_s: float = Field(10.0, ge=0)
    # where start-up measurements (thread placement, step-cost profile) are kept for the next start on this
    # machine and setup (measurement_store.py); "": measured at every start
    measurement_cache_dir: str = Field(default_factory=lambda: str(default_measurement_dir()))

    @field_validator("speculative_config")
    @classmethod
    def _valid_speculative_config(cls, value: str | None) -> str | None:
        SpeculativeConfig.parse(value)  # fail at startup, with the flag's name in the message
        return value

    @field_validator("drafters")
    @classmethod
    def _valid_drafters(cls, value: list[str]) -> list[str]:
        names = [parse_drafter(spec)[0] for spec in value]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must be unique, got {names}")
        return value

    @field_validator("kv_cache_memory_bytes")
    @classmethod
    def _valid_kv_cache_memory_bytes(cls, value: str | None) -> str | None:
        if value is not None and parse_bytes(value) <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        return value

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _valid_cuda_graph_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 1):
            raise ValueError("cuda_graph_sizes must be a non-empty list of row counts of 1 or more")
        return value

    @property
    def graphs(self):
        """The runner's GraphSettings (imported here, as kv_cache's)."""
        from services.modeling.step_graphs import GraphSettings

        sizes = tuple(sorted(set(self.cuda_graph_sizes))) if self.cuda_graph_sizes else None
        return GraphSettings(self.enforce_eager, sizes)

    @property
    def kv_cache(self):
        """The runner's KVCacheConfig (imported here: these settings are read before torch is imported)."""
        from services.modeling.kv_budget import KVCacheConfig

        memory = parse_bytes(self.kv_cache_memory_bytes) if self.kv_cache_memory_bytes is not None else None
        return KVCacheConfig(memory, self.block_size, self.enable_prefix_caching, self.gpu_memory_utilization)

    @property
    def speculation(self) -> SpeculativeConfig:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def drafter_targets(self) -> dict[str, str]:
        return dict(parse_drafter(spec) for spec in self.drafters)


def add_engine_flags(parser: argparse.ArgumentParser, default=argparse.SUPPRESS, compute_thread: bool = True,
                     serving: bool = True) -> None:
    """The model and engine flags, declared once for `specserve verifier`, `specserve serve` (which passes on the
    ones given) and `specserve generate`. `default`: SUPPRESS leaves unset flags to the settings (environment or
    the defaults above), None marks them unset for a caller that fills them in; the help shows the real default.
    serving: the limits a server puts on requests (--max-logprobs), which a local `generate` has no use for."""
    fields = VerifierSettings.model_fields

    def shown(name: str) -> str:
        value = fields[name].default
        defaults = {"max_model_len": "the model's whole context",
                    "kv_cache_memory_bytes": "40%% of the memory available at start, at most 4GiB"}
        return defaults.get(name, "none") if value is None else str(value)

    parser.add_argument("--model", default=default,
                        help=f"registered name, transformers folder, .gguf file or hub id (default {shown('model')})")
    parser.add_argument("--device", default=default,
                        help=f"auto | cpu | cuda | cuda:N | npu | npu:N (default {shown('device')})")
    parser.add_argument("--dtype", default=default, help=f"auto | float32 | bfloat16 | float16 (default {shown('dtype')})")
    parser.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true", default=default,
                        help="vLLM's flag: load a model whose folder (or hub repo) ships Python code for its "
                        "architecture or tokenizer, and run that code (default off: such a model fails to load)")
    parser.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=default,
                        help=f"requests running at once; more wait (default {shown('max_num_seqs')})")
    parser.add_argument("--max-model-len", dest="max_model_len", type=human_readable_int, default=default,
                        help="most tokens of one request, prompt and output; 32k = 32,000, 32K = 32,768 as in vLLM "
                        f"(default {shown('max_model_len')})")
    parser.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory_bytes", default=default,
                        help="memory for the paged KV cache, e.g. 4GiB, 512M or bytes "
                        f"(default {shown('kv_cache_memory_bytes')})")
    parser.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float, default=default,
                        help="the share of the device's memory (on CPU: of RAM) the instance may hold, weights and KV "
                        "cache, as vLLM's flag: the KV cache takes what is free beyond the rest, all of it "
                        "(default: unset, the KV cache as --kv-cache-memory-bytes says; that wins where both are "
                        "given)")
    parser.add_argument("--block-size", dest="block_size", type=int, default=default,
                        help=f"tokens per KV cache block (default {shown('block_size')})")
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                        action=argparse.BooleanOptionalAction, default=default,
                        help="reuse the KV cache of a prompt's cached prefix (default on)")
    parser.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=human_readable_int,
                        default=default, help="prompt tokens prefilled per step; 8k = 8,000, 8K = 8,192 "
                        f"(default {shown('max_num_batched_tokens')})")
    if serving:
        parser.add_argument("--max-logprobs", dest="max_logprobs", type=int, default=default,
                            help="most logprobs / prompt_logprobs alternatives a request may ask per position; -1: "
                            f"the whole vocabulary (default {shown('max_logprobs')})")
        parser.add_argument("--seed", dest="seed", type=int, default=default,
                            help="seed for the requests that give none: a fresh server sent the same requests in "
                            "the same order samples the same tokens (default none: fresh randomness each request)")
    parser.add_argument("--adaptive-speculation", dest="adaptive_speculation", action=argparse.BooleanOptionalAction,
                        default=default, help="verify only the draft positions expected to pay for their cost, per "
                        "step (default on); --no-adaptive-speculation verifies every row's full K")
    parser.add_argument("--enforce-eager", dest="enforce_eager", action=argparse.BooleanOptionalAction,
                        default=default, help="on a GPU or NPU, run every forward eagerly instead of replaying "
                        "graphs captured per batch shape (default off: decode and verify steps are captured)")
    parser.add_argument("--cuda-graph-sizes", dest="cuda_graph_sizes", type=int, nargs="+", default=default,
                        help="the running-request counts a step graph is captured for; a step's rows are padded up "
                        "to the next (default 1 2 4 8 16 24 ... up to --max-num-seqs)")
    parser.add_argument("--batch-invariant", dest="batch_invariant", action=argparse.BooleanOptionalAction,
                        default=default, help="run every forward in waves of one fixed shape so that a token's "
                        "logits do not depend on its batch: in bf16, speculative greedy output is then "
                        "bit-identical to non-speculative output, at the padding's cost (as vLLM's "
                        "VLLM_BATCH_INVARIANT; default off)")
    if compute_thread:
        parser.add_argument("--compute-thread", dest="compute_thread", choices=["auto", "main", "worker"],
                            default=default, help="thread for the model's forwards; auto (default) measures both")
