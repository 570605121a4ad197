"""Hidden states over the gRPC link: a drafter that declares needs_hidden_states receives, for every committed
token but the last, the target's own final hidden state (float16 on the wire), across partial acceptance and
bonus tokens; a drafter that does not declare it receives none (no bytes on the link)."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import replace

import pytest
import torch

from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.drafter.server import serve
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.tiny_models import VOCAB, tiny_llama


class RecordingDrafter:
    """Drafts a prefix of the target's continuation then noise; records what it was given."""

    method = "recorder"

    def __init__(self, continuation: dict[str, list[int]]) -> None:
        self.continuation = continuation
        self.seen: list[tuple[str, list[int], torch.Tensor | None]] = []
        self.rng = random.Random(1)

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        drafts = []
        for item in inputs:
            seq = str(item.seq_id[1])  # (link id, verifier seq id)
            self.seen.append((seq, list(item.token_ids), item.hidden_states))
            truth = self.continuation[seq][len(item.token_ids):][: item.num_speculative_tokens]
            cut = self.rng.randint(0, len(truth))
            drafts.append(Draft(truth[:cut] + [self.rng.randrange(VOCAB) for _ in range(len(truth) - cut)]))
        return drafts

    def release(self, seq_id: Hashable) -> None:
        pass


@pytest.mark.parametrize(("needs", "budget"), [(True, None), (False, None), (True, 3 * 64 * 2)],
                         ids=["needs", "does-not-need", "three-rows-a-step"])
async def test_the_drafter_receives_the_targets_hidden_states(needs, budget):
    """With a budget of three rows of states a step (hidden_state_budget.py), a prompt's backlog reaches the
    drafter over several steps, drafting nothing meanwhile, and then all of it, exactly as in one step."""
    model = tiny_llama(seed=5)
    prompts = {"a": list(range(3, 30)), "b": [7, 8, 9, 10, 11]}
    with torch.no_grad():
        continuation = {rid: model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                                            min_new_tokens=20)[0].tolist() for rid, p in prompts.items()}
    drafter = RecordingDrafter(continuation)
    server, port = await serve(drafter, "127.0.0.1", 0, num_speculative_tokens=4, needs_hidden_states=needs)
    config = RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB, step_timeout_s=None)
    if budget is not None:
        config = replace(config, max_hidden_bytes_per_step=budget)
    remote = await RemoteProposer.connect(config)
    try:
        engine = Engine(LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=128),
                        EngineConfig(max_num_batched_tokens=16, log_stats_interval_s=0, adaptive_speculation=False,
                                     draft_timeout_s=2.0),
                        {"recorder": remote})
        requests = [GenerationRequest(rid, tuple(p), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                                      SpeculationParams("recorder", 4)) for rid, p in prompts.items()]
        results = await run_schedule(engine, {0: requests})
    finally:
        await remote.close()
        await server.server.stop(0)
    for rid, prompt in prompts.items():
        assert prompt + results[rid].tokens == continuation[rid]
    assert drafter.seen and engine.stats.num_fallbacks == 0
    if not needs:
        assert all(states is None for _, _, states in drafter.seen)
        return
    with torch.no_grad():
        truth = {rid: model(input_ids=torch.tensor([c]), output_hidden_states=True).hidden_states[-1][0]
                 for rid, c in continuation.items()}
    for seq, token_ids, states in drafter.seen:
        assert states is not None and states.shape[0] == len(token_ids) - 1, (seq, len(token_ids))
        assert torch.allclose(states.float(), truth[seq][: states.shape[0]], atol=2e-2, rtol=1e-2)  # float16 on the wire
    first_drafted = {seq: len(token_ids) for seq, token_ids, _ in reversed(drafter.seen)}
    if budget is not None:  # the 27-token prompt's 26 rows took several steps before its first draft
        assert first_drafted["a"] > len(prompts["a"]) + 2
    else:
        assert first_drafted["a"] == len(prompts["a"]) + 1  # its first decode step (the prefill's token committed)
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens


class DeclaringDrafter:
    method = "picky"

    def __init__(self, hidden_size: int, hidden_layers: tuple[int, ...]) -> None:
        self.capabilities = ProposerCapabilities(needs_hidden_states=True, hidden_size=hidden_size,
                                                 hidden_layers=hidden_layers)

    async def propose(self, inputs):
        return [Draft([]) for _ in inputs]

    def release(self, seq_id) -> None:
        pass


@pytest.mark.parametrize(("width", "layers", "served", "refused"), [
    (64, (-1,), None, None), (128, (-1,), None, "width 128"), (64, (0, 1, -1), None, None),
    (64, (0, 1, -1), (0, 1, -1), None), (64, (-1, 3, 7), None, "hidden layer 3 does not exist"),
    (64, (0, 1, -1), (-1,), r"reads target layers \[0, 1, -1\], but this verifier serves layers \[-1\]")])
async def test_a_verifier_refuses_a_drafter_whose_states_it_cannot_serve(width, layers, served, refused):
    """Layers the target has are accepted until the verifier fixes the ones it serves (at start-up); from then
    on a drafter declaring others is refused, as is one for another width or for layers the target lacks."""
    from services.verifier.remote_proposer import IncompatibleDrafterError

    server, port = await serve(DeclaringDrafter(width, layers), "127.0.0.1", 0)
    config = RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB, hidden_size=64, num_layers=2)  # the tiny models'
    remote = RemoteProposer(config)
    if served is not None:
        remote.serve_hidden_layers(served)
    try:
        if refused is None:
            await remote.info()
            assert remote.capabilities.needs_hidden_states and remote.capabilities.hidden_layers == layers
        else:
            with pytest.raises(IncompatibleDrafterError, match=refused):
                await remote.info()
    finally:
        await remote.close()
        await server.server.stop(0)


async def test_a_step_past_grpcs_default_message_size_reaches_the_drafter():
    """One step of 50,000 rows of 64-wide states is 6.4 MB, past gRPC's 4 MiB default, which made a drafter break
    the stream on a few long prompts (grpc_link_policy.py): the link allows it."""
    drafter = RecordingDrafter({"long": []})
    drafter.capabilities = ProposerCapabilities(needs_hidden_states=True, hidden_size=64)
    server, port = await serve(drafter, "127.0.0.1", 0, num_speculative_tokens=4)
    config = RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB, hidden_size=64, step_timeout_s=None,
                                  max_hidden_bytes_per_step=1 << 30)
    remote = await RemoteProposer.connect(config)
    states = torch.randn(50_000, 64)
    try:
        drafts = await remote.propose([DraftInput("long", [t % VOCAB for t in range(50_001)], 4, states)])
    finally:
        await remote.close()
        await server.server.stop(0)
    assert not drafts[0].token_ids and len(drafter.seen) == 1  # the continuation it was given is empty
    assert torch.equal(drafter.seen[0][2], states.half())
