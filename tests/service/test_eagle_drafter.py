"""The EAGLE drafter as a real gRPC service (a tiny random target and a tiny random head, EAGLE-1 or EAGLE-3): it
receives the target's hidden states (of the layers its head reads), drafts, and the output is lossless — greedy
output identical to speculation off, and sampled output distributed as the target's (chi-square on the first
tokens, as the engine distribution test)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
import torch

from services.drafter.head_kernels import use_chosen_kernels
from services.drafter.methods.eagle import EagleProposer
from services.drafter.server import serve
from services.modeling.eagle_head import EagleConfig, EagleHead
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.cpu_features import needs_bf16_linear
from tests.engine_harness import run_schedule
from tests.stats import ALPHA, chi_square_p_value, reference_processed, total_variation
from tests.tiny_heads import random_eagle3_head
from tests.tiny_models import tiny_llama

V = 12
PROMPT = (1, 5, 2, 7, 1, 5)


TREE = {"tree_nodes": 6, "tree_topk": 3, "tree_depth": 3}  # EAGLE-2 trees of 6 tokens, 3 deep


EAGLE3_LAYERS = (0, 1, -1)  # the tiny target has two layers: its embeddings, the second's input and the final state


def bf16_wins(name, rows, step) -> float:
    """A fake draft-step timer under which the bfloat16 copies are always the fastest (every step still runs)."""
    step()
    return 0.1 if name == "bf16" else 1.0


def eagle_for(target, draft_vocab: tuple[int, ...] = (), trees: bool = False, eagle3: bool = False,
              sampled_trees: bool = False, bf16: bool = False) -> EagleProposer:
    """A random head; with `draft_vocab`, one that drafts from those tokens only (a reduced vocabulary); with
    `trees`, sending token trees (TREE), drawn with q for sampled requests where `sampled_trees`; `eagle3`: an
    EAGLE-3 head reading EAGLE3_LAYERS; `bf16`: its linears and draft rows on packed bfloat16 copies, as a CPU
    drafter runs where they measure faster (head_kernels.py)."""
    if bf16:
        proposer = eagle_for(target, draft_vocab, trees, eagle3, sampled_trees)
        proposer.draft_rows = use_chosen_kernels(proposer.head, proposer._draft_rows(), bf16_wins)
        assert proposer.draft_rows.linear.choice.describe() == "bf16 at all M"
        return proposer
    if sampled_trees:
        proposer = eagle_for(target, draft_vocab, trees, eagle3)
        proposer.sampled_trees = True
        return proposer
    if eagle3:
        head = random_eagle3_head(target.config, EAGLE3_LAYERS, draft_vocab)
        return EagleProposer(head, target.get_input_embeddings(), target.get_output_embeddings(), V,
                             **(TREE if trees else {}))
    torch.manual_seed(0)
    config = EagleConfig.for_target(target.config)
    if draft_vocab:
        config = EagleConfig(**{**asdict(config), "draft_vocab_size": len(draft_vocab)})
    head = EagleHead(config).eval()
    if draft_vocab:
        head.draft_vocab.copy_(torch.tensor(draft_vocab))
    return EagleProposer(head, target.get_input_embeddings(), target.get_output_embeddings(), V,
                         **(TREE if trees else {}))


async def with_eagle(proposer: EagleProposer, run):
    server, port = await serve(proposer, "127.0.0.1", 0, num_speculative_tokens=proposer.tree_nodes or 3)
    remote = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{port}", V, step_timeout_s=None))
    assert remote.method == "eagle" and remote.capabilities.needs_hidden_states and remote.capabilities.pre_drafts
    assert remote.capabilities.hidden_layers == proposer.head.config.hidden_layers
    try:
        return await run(remote)
    finally:
        await remote.close()
        await server.server.stop(0)


def engine(target, proposers, slots: int = 8) -> Engine:
    return Engine(LlamaFamilyRunner(target, max_num_seqs=slots, max_model_len=64),
                  EngineConfig(max_num_batched_tokens=4096, max_waiting_requests=4000, log_stats_interval_s=0,
                               adaptive_speculation=False, draft_timeout_s=5.0),
                  proposers)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=21, vocab_size=V)


@pytest.mark.parametrize(("draft_vocab", "pipelining", "trees", "eagle3", "bf16"),
                         [((), None, False, False, False), ((1, 3, 4, 5, 6, 7, 9), None, False, False, False),
                          ((), True, False, False, False), ((), None, True, False, False),
                          ((1, 3, 4, 5, 6, 7, 9), None, False, True, False), ((), True, True, True, False),
                          pytest.param((), True, True, False, True, marks=needs_bf16_linear)],
                         ids=["whole vocabulary", "reduced vocabulary", "pipelined", "trees", "eagle3",
                              "eagle3 pipelined trees", "pipelined trees on bf16 kernels"])
async def test_greedy_output_is_identical_with_the_eagle_drafter(target, draft_vocab, pipelining, trees, eagle3,
                                                                  bf16):
    prompts = [PROMPT, (3, 3, 4, 4, 5, 5, 6), tuple(range(1, 12))]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = await run_schedule(engine(target, {}), {0: [GenerationRequest(f"r{i}", p, params)
                                                        for i, p in enumerate(prompts)]})

    async def run(remote):
        e = engine(target, {"eagle": remote})
        spec = SpeculationParams("eagle", TREE["tree_nodes"] if trees else 3, pipelining)
        results = await run_schedule(e, {0: [GenerationRequest(f"r{i}", p, params, spec)
                                             for i, p in enumerate(prompts)]})
        return results, e.stats

    proposer = eagle_for(target, draft_vocab, trees, eagle3, bf16=bf16)
    results, stats = await with_eagle(proposer, run)
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == plain[f"r{i}"].tokens
    assert stats.num_draft_tokens > 0 and stats.num_fallbacks == 0
    counts = proposer.pipeline_counts
    assert (counts.used + counts.discarded > 0) if pipelining else counts == type(counts)()


def exact_joint(model, params: SamplingParams) -> np.ndarray:
    with torch.inference_mode():
        p1 = reference_processed(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy(), params)
        one = model(input_ids=torch.tensor([PROMPT + (a,) for a in range(V)])).logits[:, -1].numpy()
        two = model(input_ids=torch.tensor([PROMPT + (a, b) for a in range(V) for b in range(V)])).logits[:, -1]
        two = two.numpy().reshape(V, V, V)
    joint = np.zeros((V, V))
    for a in range(V):
        p2 = reference_processed(one[a], params)
        for b in range(V):
            joint[b] += p1[a] * p2[b] * reference_processed(two[a, b], params)
    return joint


@pytest.mark.parametrize(("pipelining", "trees", "eagle3", "sampled_trees", "bf16"),
                         [(False, False, False, False, False), (True, False, False, False, False),
                          (False, True, False, False, False), (False, False, True, False, False),
                          (False, True, True, True, False),
                          pytest.param(False, True, True, True, True, marks=needs_bf16_linear)],
                         ids=["plain", "pipelined", "trees", "eagle3", "eagle3 sampled trees with q",
                              "eagle3 sampled trees with q on bf16 kernels"])
async def test_sampled_output_follows_the_target_with_the_eagle_drafter(target, pipelining, trees, eagle3,
                                                                        sampled_trees, bf16):
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    samples = 2000

    async def run(remote):
        e = engine(target, {"eagle": remote}, slots=200)
        requests = [GenerationRequest(f"s{i}", PROMPT, SamplingParams(**{**params.__dict__, "seed": 7000 + i}),
                                      SpeculationParams("eagle", 6 if trees else 2, pipelining))
                    for i in range(samples)]
        return await run_schedule(e, {0: requests}), e.stats

    # a q-tree's q over half the vocabulary or less crosses the link as its support (drafter_wire.probs_support)
    proposer = eagle_for(target, (1, 3, 4, 5, 6, 7) if sampled_trees else (), trees, eagle3, sampled_trees, bf16)
    sent = []  # what the drafter answered: q-trees where asked, for sampled requests
    propose = proposer.propose
    async def recording(inputs):
        drafts = await propose(inputs)
        sent.extend(d.probs is not None and d.parents is not None for d in drafts if d.token_ids)
        return drafts
    proposer.propose = recording
    results, stats = await with_eagle(proposer, run)
    assert set(sent) == {sampled_trees}
    counts = proposer.pipeline_counts
    assert (counts.used + counts.discarded > 0) == pipelining  # pre-drafts were made (the request asked), or none
    joint = np.zeros((V, V))
    for result in results.values():
        joint[result.tokens[1], result.tokens[2]] += 1
    assert stats.num_drafts > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


async def test_a_verifier_serves_the_layers_its_eagle3_drafter_reads_or_refuses_it_for_hidden_layers(target):
    """Started beside an EAGLE-3 drafter, the verifier serves that drafter's layers (and holds later drafters to
    them); with --hidden-layers naming others, it refuses the drafter at start-up, saying why."""
    from services.verifier.remote_proposer import IncompatibleDrafterError
    from services.verifier.server import start_verifier
    from services.verifier.settings import VerifierSettings

    proposer = eagle_for(target, eagle3=True)
    server, port = await serve(proposer, "127.0.0.1", 0, num_speculative_tokens=3)
    base = {"port": 0, "metrics_port": 0, "max_num_seqs": 4, "max_model_len": 64, "log_stats_interval_s": 0,
            "drafters": [f"eagle3=127.0.0.1:{port}"]}
    try:
        running = await start_verifier(target, "tiny", VerifierSettings(**base))
        try:
            assert running.engine.hidden_layers == EAGLE3_LAYERS
            assert running.drafters[0].proposer.served_hidden_layers == EAGLE3_LAYERS
        finally:
            await running.stop(0, 0.5)
        with pytest.raises(IncompatibleDrafterError, match=r"this verifier serves layers \[-1\]"):
            await start_verifier(target, "tiny", VerifierSettings(**base, hidden_layers=[-1]))
    finally:
        await server.server.stop(0)
