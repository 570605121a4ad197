"""Drive an Engine step by step (no background loop), so tests control exactly when requests join, leave and
abort, and runs are reproducible."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.verifier.engine import Engine
from services.verifier.outputs import RequestOutput
from services.verifier.request_stream import RequestStream
from services.verifier.sampling_params import GenerationRequest


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def finish_reason(self):
        return self.outputs[-1].finish_reason if self.outputs else None


async def run_schedule(
    engine: Engine,
    arrivals: Mapping[int, Sequence[GenerationRequest]],
    aborts: Mapping[int, Sequence[str]] | None = None,
    max_steps: int = 10_000,
) -> dict[str, Collected]:
    """arrivals[s]: requests added before step s; aborts[s]: request ids aborted before step s."""
    aborts = aborts or {}
    streams: dict[str, RequestStream] = {}
    results: dict[str, Collected] = {}
    last_arrival = max(arrivals, default=0)
    for step in range(max_steps):
        for request in arrivals.get(step, ()):
            streams[request.request_id] = engine.add_request(request)
            results[request.request_id] = Collected()
        for request_id in aborts.get(step, ()):
            engine.abort(request_id)
        await engine.step()
        for request_id, stream in streams.items():
            for output in stream.ready_outputs():
                results[request_id].outputs.append(output)
                results[request_id].tokens.extend(output.token_ids)
        if step >= last_arrival and engine.num_running == 0 and engine.num_waiting == 0:
            return results
    raise AssertionError("engine did not finish the schedule")
