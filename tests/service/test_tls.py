"""TLS on the gRPC links: a drafter and a verifier serving TLS, reached by clients that trust the certificate;
plaintext clients and clients trusting another certificate are turned away; bad certificate paths fail at
start-up with the path in the message."""

from __future__ import annotations

import grpc
import pytest

from services.common.proposer import DraftInput
from services.common.tls import channel_credentials, server_credentials
from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.drafter.server import serve
from services.gateway.verifier_client import VerifierClient
from services.verifier.remote_proposer import DrafterUnavailableError, RemoteProposer, RemoteProposerConfig
from services.verifier.server import start_verifier
from services.verifier.settings import VerifierSettings
from services.verifier.wire import verifier_pb2
from tests.tiny_models import VOCAB, tiny_llama
from tests.tls_certs import write_self_signed

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    return write_self_signed(folder / "good"), write_self_signed(folder / "other")


@pytest.fixture
async def tls_drafter(certs):
    good, _ = certs
    server, port = await serve(
        NgramProposer(NgramSettings(1, 3)), "127.0.0.1", 0, num_speculative_tokens=4,
        credentials=server_credentials(good.cert, good.key),
    )
    try:
        yield port
    finally:
        await server.server.stop(0)


async def test_drafter_over_tls_proposes_what_the_proposer_proposes(certs, tls_drafter):
    good, _ = certs
    config = RemoteProposerConfig(f"localhost:{tls_drafter}", VOCAB, channel_credentials=channel_credentials(good.cert))
    remote = await RemoteProposer.connect(config)
    try:
        (draft,) = await remote.propose([DraftInput("a", PROMPT, 3)])
        (expected,) = await NgramProposer(NgramSettings(1, 3)).propose([DraftInput("a", PROMPT, 3)])
        assert list(draft.token_ids) == list(expected.token_ids) and len(draft.token_ids) > 0
    finally:
        await remote.close()


@pytest.mark.parametrize("client", ["plaintext", "other-root"])
async def test_drafter_over_tls_refuses_untrusting_clients(certs, tls_drafter, client):
    _, other = certs
    credentials = channel_credentials(other.cert) if client == "other-root" else None
    config = RemoteProposerConfig(
        f"localhost:{tls_drafter}", VOCAB, channel_credentials=credentials, info_timeout_s=1.0, step_timeout_s=1.0
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await RemoteProposer.connect(config)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    remote = RemoteProposer(config)  # as the engine uses it: a refused link is a fallback, not a crash
    with pytest.raises(DrafterUnavailableError):
        await remote.propose([DraftInput("a", PROMPT, 3)])
    await remote.close()


async def test_verifier_serves_tls_and_reaches_its_drafter_over_tls(certs, tls_drafter):
    good, _ = certs
    settings = VerifierSettings(
        port=0, metrics_port=0, host="127.0.0.1", max_num_seqs=2, max_model_len=128, log_stats_interval_s=0,
        draft_timeout_s=2.0, tls_cert_file=str(good.cert), tls_key_file=str(good.key),
        drafters=[f"ngram=localhost:{tls_drafter}"], drafter_tls_root_cert=str(good.cert),
    )
    running = await start_verifier(tiny_llama(seed=4), "tiny-llama", settings)
    client = VerifierClient(f"localhost:{running.port}", root_cert=good.cert)
    plaintext = VerifierClient(f"localhost:{running.port}", info_timeout_s=1.0)
    try:
        info = await client.info()
        assert [(d.name, d.state) for d in info.drafters] == [("ngram", verifier_pb2.DRAFTER_STATE_SERVING)]
        request = verifier_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=PROMPT,
            sampling=verifier_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        )
        responses = [r async for r in client.generate(request)]
        assert sum(len(r.token_ids) for r in responses) == 12
        assert responses[-1].speculation.num_drafts > 0  # drafts came over the TLS link to the drafter
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await plaintext.info()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()
        await plaintext.close()
        await running.stop(0, 0.5)


def test_missing_certificate_files_fail_at_startup_with_the_path(tmp_path):
    missing = tmp_path / "nope.crt"
    with pytest.raises(ValueError, match="nope.crt"):
        server_credentials(missing, missing)
    with pytest.raises(ValueError, match="nope.crt"):
        channel_credentials(missing)
    with pytest.raises(ValueError, match="both"):
        server_credentials(missing, None)
