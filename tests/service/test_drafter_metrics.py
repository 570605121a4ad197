"""The drafter's own metrics over a real link: steps, proposed tokens and resyncs are counted as the verifier's
end sees them, and the open streams/sequences gauges follow links opening, releasing and closing."""

from __future__ import annotations

import asyncio

from services.common.proposer import DraftInput
from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.drafter.metrics import DrafterMetrics
from services.drafter.server import serve
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from tests.tiny_models import VOCAB

A = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
B = [1, 2, 3, 1, 2, 3, 1, 2]


def sample(metrics: DrafterMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"method": "ngram"})
    return 0.0 if value is None else value


async def test_drafter_metrics_follow_the_link():
    metrics = DrafterMetrics("ngram")
    server, port = await serve(NgramProposer(NgramSettings(1, 3)), "127.0.0.1", 0, metrics=metrics)
    remote = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB))
    try:
        drafts = await remote.propose([DraftInput("a", A, 3), DraftInput("b", B, 2)])
        proposed = sum(len(d.token_ids) for d in drafts)
        assert proposed > 0
        drafts = await remote.propose([DraftInput("a", [*A, 7], 3)])
        proposed += sum(len(d.token_ids) for d in drafts)
        assert sample(metrics, "specserve_drafter_steps_total") == 2
        assert sample(metrics, "specserve_drafter_sequences_drafted_total") == 3
        assert sample(metrics, "specserve_drafter_proposed_tokens_total") == proposed
        assert sample(metrics, "specserve_drafter_resyncs_total") == 0
        assert sample(metrics, "specserve_drafter_step_seconds_count") == 2
        assert sample(metrics, "specserve_drafter_open_streams") == 1
        assert sample(metrics, "specserve_drafter_open_sequences") == 2
        remote.release("b")  # travels with the next step
        await remote.propose([DraftInput("a", [*A, 7, 8], 3)])
        assert sample(metrics, "specserve_drafter_open_sequences") == 1
    finally:
        await remote.close()
    for _ in range(100):  # the server notices the closed stream asynchronously
        if sample(metrics, "specserve_drafter_open_streams") == 0:
            break
        await asyncio.sleep(0.02)
    assert sample(metrics, "specserve_drafter_open_streams") == 0
    assert sample(metrics, "specserve_drafter_open_sequences") == 0
    await server.server.stop(0)
