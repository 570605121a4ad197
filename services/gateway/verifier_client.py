"""The gateway's only way to the verifier: a grpc.aio channel per the contract in proto/specserve/v1.

Every call carries a deadline, so a hung verifier becomes a 503 instead of a hung HTTP request. The channel is
opened lazily inside the running event loop (grpc.aio channels belong to the loop that made them), and
leaving a `generate` iterator early — a stop string, a client disconnect — cancels the call, which tells the
verifier to abort the request and free its KV slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from services.common import protos
from services.common.tls import channel_credentials, open_channel

pb, pb_grpc = protos.load("verifier")

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]  # keepalive: open_channel's policy


class VerifierClient:
    def __init__(self, address: str, *, info_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 root_cert: Path | None = None) -> None:
        self.address = address
        self._info_timeout_s = info_timeout_s
        self._request_timeout_s = request_timeout_s
        self._credentials = channel_credentials(root_cert)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    def _ensure(self) -> Any:
        if self._stub is None:
            self._channel = open_channel(self.address, self._credentials, _CHANNEL_OPTIONS)
            self._stub = pb_grpc.VerifierStub(self._channel)
        return self._stub

    async def info(self, timeout_s: float | None = None) -> Any:
        return await self._ensure().Info(pb.InfoRequest(), timeout=timeout_s or self._info_timeout_s)

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        """GenerateResponse messages of one request; closing the iterator early cancels the call."""
        call = self._ensure().Generate(request, timeout=self._request_timeout_s)
        try:
            async for response in call:
                yield response
        finally:
            if not call.done():
                call.cancel()

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()
