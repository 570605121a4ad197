"""What every route of the gateway shares (GatewayState): settings, the verifier client, the tokenizer, metrics,
and the verifier's model facts, fetched once on first need so the gateway can start before the verifier."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.concurrency import run_in_threadpool

from services.gateway.errors import ApiError, from_grpc
from services.gateway.generation_defaults import GenerationDefaults, read_generation_defaults
from services.gateway.metrics import GatewayMetrics
from services.gateway.settings import GatewaySettings
from services.gateway.token_bytes import TokenBytes
from services.gateway.tokenizer import load_tokenizer, with_chat_template
from services.gateway.verifier_client import VerifierClient
from services.modeling.model_source import ModelUnavailableError
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

logger = logging.getLogger("specserve.gateway")


@dataclass
class GatewayState:
    """What the routes share: settings, the verifier client, the tokenizer, metrics, and the verifier's model
    facts (fetched once, on first need, so the gateway can start before the verifier)."""

    settings: GatewaySettings
    client: VerifierClient
    metrics: GatewayMetrics
    tokenizer: Any = None
    tokenizer_problem: str | None = None  # why the tokenizer cannot be had (then the gateway is not ready)
    info: Any = None
    # vLLM's --generation-config: read with the tokenizer, from the same model (generation_defaults.py)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _token_bytes: TokenBytes | None = None  # token_bytes(), made once the tokenizer is there

    def __post_init__(self) -> None:
        self.tokenizer = with_chat_template(self.tokenizer, self.settings.chat_template)
        if self.tokenizer is not None:  # loaded at start for --model (main.py): a bad file fails the start
            self.generation_defaults = read_generation_defaults(self.settings.generation_config, self.settings.model)

    async def model_info(self) -> Any:
        if self.info is None:
            async with self._lock:
                if self.info is None:
                    try:
                        info = await self.client.info()
                    except grpc.RpcError as exc:
                        raise from_grpc(exc) from exc
                    if self.tokenizer is not None:
                        await self._check_tokenizer(info, self.tokenizer)
                    self.info = info
        return self.info

    async def get_tokenizer(self) -> Any:
        """The tokenizer, for a request: never loaded (nor its model fetched) here. Until prepare() has it, a
        503 that says why: the verifier is unreachable, the tokenizer is loading, or it cannot be had."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.tokenizer_problem is not None:
            raise ApiError(503, self.tokenizer_problem, code="model_unavailable")
        await self.model_info()  # the verifier's own 503 while it is unreachable
        raise ApiError(503, "the gateway is starting: its tokenizer is loading; retry in a few seconds",
                       code="not_ready")

    def token_bytes(self) -> TokenBytes:
        """The tokenizer's tokens as bytes (chat logprobs' `bytes`), each worked out once for the gateway's life."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes

    async def prepare(self, retry_s: float = 0.5) -> None:
        """Load the tokenizer once, at start-up: the --model one, else that of the model the verifier serves
        (asked until it answers). A model that cannot be found or fetched leaves `tokenizer_problem` set: the
        gateway stays up, not ready, and says why on /health and in every 503."""
        while self.tokenizer is None:
            try:
                spec = self.settings.model or (await self.model_info()).model_id
            except ApiError:  # the verifier is not up yet: the gateway may start first
                await asyncio.sleep(retry_s)
                continue
            try:
                tokenizer = await run_in_threadpool(load_tokenizer, spec, self.settings.trust_remote_code)
                if self.info is not None:
                    await self._check_tokenizer(self.info, tokenizer)
                self.generation_defaults = read_generation_defaults(self.settings.generation_config, spec)
            except ModelUnavailableError as error:
                self.tokenizer_problem = str(error)
                logger.error("gateway not ready: %s", error)
                return
            except ApiError as error:  # tokenizer_mismatch
                self.tokenizer_problem = error.message
                logger.error("gateway not ready: %s", error.message)
                return
            except Exception as error:  # noqa: BLE001 - a bad file or folder: not ready, and why, not a dead task
                self.tokenizer_problem = f"the tokenizer of model {spec!r} could not be loaded: {error}"
                logger.exception("gateway not ready: %s", self.tokenizer_problem)
                return
            self.tokenizer = with_chat_template(tokenizer, self.settings.chat_template)

    async def _check_tokenizer(self, info: Any, tokenizer: Any) -> None:
        """Ids from a tokenizer with another vocabulary would mean other tokens to the verifier's model."""
        if not info.tokenizer_fingerprint:
            return
        ours = await run_in_threadpool(tokenizer_fingerprint, tokenizer)
        if ours and ours != info.tokenizer_fingerprint:
            raise ApiError(
                503,
                f"the gateway's tokenizer (--model {self.settings.model or info.model_id}) does not match the "
                f"verifier's model {info.model_id!r} (vocabulary fingerprints {ours[:12]} vs "
                f"{info.tokenizer_fingerprint[:12]}); start the gateway with the verifier's --model",
                code="tokenizer_mismatch",
            )

    async def served_names(self) -> list[str]:
        """The names a request may give as its model (--served-model-name), the one responses give first."""
        return self.settings.served_model_name or [(await self.model_info()).model_id]

    async def check_model(self, name: str | None) -> str:
        """The name responses give (the first served name, as vLLM's); a 404 when a request names a model that is
        not served (None: the request may leave it out)."""
        served = await self.served_names()
        if name is not None and name not in served:
            names = ", ".join(f"`{n}`" for n in served)
            raise ApiError(404, f"The model `{name}` does not exist; this server serves {names}.",
                           param="model", code="model_not_found")
        return served[0]
