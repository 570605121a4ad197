"""The target's hidden states a drafter that needs them (EAGLE) receives: for every committed token the target
has run on, exactly transformers' own hidden states (`output_hidden_states`) of the layers it declared (by
default the final one, after the final norm; an EAGLE-3 head reads several, side by side), row i for token i,
across chunked prefill, partial acceptance, bonus tokens and rows of different lengths; the last committed token
(the bonus) has none yet. Drafters that do not ask get none."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import pytest
import torch
from safetensors import safe_open

from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.modeling import llama_runner
from services.modeling.generic_runner import GenericRunner
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.paged_kv_cache import PagedKVCache
from services.modeling.step_graphs import StepGraphs
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.hidden_state_files import file_for
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.tiny_models import tiny_llama
from tests.unit.test_step_graphs import RerunOnReplay


class RecordingProposer:
    """Drafts the target's own continuation half the time (accepted) and noise otherwise (rejected), so rows
    accept every number of drafts; records every DraftInput."""

    method = "recorder"

    def __init__(self, needs: bool, continuation: dict[Hashable, list[int]], seed: int = 0,
                 layers: tuple[int, ...] = (-1,), no_draft: float = 0.0) -> None:
        """no_draft: the share of asks answered with no draft."""
        self.capabilities = ProposerCapabilities(needs_hidden_states=needs, hidden_layers=layers)
        self.continuation = continuation
        self.seen: list[tuple[Hashable, list[int], torch.Tensor | None]] = []  # token_ids is live: copied
        self.rng = random.Random(seed)
        self.no_draft = no_draft

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        self.seen += [(item.seq_id, list(item.token_ids), item.hidden_states) for item in inputs]
        drafts = []
        for item in inputs:
            truth = self.continuation[item.seq_id][len(item.token_ids):][: item.num_speculative_tokens]
            cut = self.rng.randint(0, len(truth))
            drafts.append(Draft([]) if self.no_draft and self.rng.random() < self.no_draft else
                          Draft(truth[:cut] + [self.rng.randrange(96) for _ in range(len(truth) - cut)]))
        return drafts

    def release(self, seq_id: Hashable) -> None:
        pass


@pytest.mark.parametrize("needs,layers", [(True, (-1,)), (False, (-1,)), (True, (1, 0, -1)), (True, (1,))],
                         ids=["final", "none", "three-layers", "one-inner-layer"])
@pytest.mark.parametrize("runner_kind", ["llama", "generic", "llama-graphed"])
async def test_drafters_receive_the_targets_own_hidden_states(needs, layers, runner_kind):
    """llama-graphed: the llama runner with graphs replayed by rerunning them on CPU (test_step_graphs.py), where a
    plain step verifies inside its graph (captured_verify.py) and the states come from the graph's own output."""
    model = tiny_llama(seed=5)
    prompts = {"a": list(range(3, 40)), "b": [7, 8, 9, 10, 11], "c": list(range(50, 20, -1))}
    continuation = {}
    with torch.no_grad():
        for rid, prompt in prompts.items():
            continuation[rid] = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                               min_new_tokens=24)[0].tolist()
    proposer = RecordingProposer(needs, continuation, layers=layers)
    runner = (GenericRunner if runner_kind == "generic" else LlamaFamilyRunner)(model, max_num_seqs=4, max_model_len=128)
    if runner_kind == "llama-graphed":
        runner.graphs = StepGraphs(runner._body, RerunOnReplay(), (1, 2, 4), runner.device, max_width=8,
                                   head=runner._head)
    engine = Engine(runner, EngineConfig(max_num_batched_tokens=16, log_stats_interval_s=0, adaptive_speculation=False),
                    {"recorder": proposer})
    requests = [GenerationRequest(rid, tuple(p), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                  SpeculationParams("recorder", 4)) for rid, p in prompts.items()]
    results = await run_schedule(engine, {0: requests})
    for rid, prompt in prompts.items():
        assert prompt + results[rid].tokens == continuation[rid]  # greedy, whatever was drafted
    assert proposer.seen
    if not needs:
        assert all(states is None for _, _, states in proposer.seen)
        return
    with torch.no_grad():
        every = {rid: model(input_ids=torch.tensor([c]), output_hidden_states=True).hidden_states
                 for rid, c in continuation.items()}
    truth = {rid: torch.cat([states[i][0] for i in layers], dim=-1) for rid, states in every.items()}
    for seq_id, token_ids, states in proposer.seen:
        assert states is not None and states.shape == (len(token_ids) - 1, 64 * len(layers))
        assert torch.allclose(states, truth[seq_id][: states.shape[0]], atol=1e-4)
    stats = engine.stats
    accepted = stats.num_accepted_tokens
    assert 0 < accepted < stats.num_draft_tokens  # partial acceptance really happened


async def test_a_cached_prefix_comes_with_its_hidden_states():
    """Prefix caching serves requests whose drafter reads hidden states too: the runner keeps each position's
    state beside its K/V, so a request that starts from cached blocks gets the prefix's states from there (and
    computes only the rest), still exactly the target's own."""
    model = tiny_llama(seed=5)
    shared = list(range(3, 43))  # 40 tokens: two full blocks of 16 are cached after the first request
    prompts = {"first": shared, "second": shared + [60, 61, 62]}
    continuation = {}
    with torch.no_grad():
        for rid, prompt in prompts.items():
            continuation[rid] = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                               min_new_tokens=12)[0].tolist()
    proposer = RecordingProposer(True, continuation)
    engine = Engine(LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=128),
                    EngineConfig(max_num_batched_tokens=64, log_stats_interval_s=0, adaptive_speculation=False),
                    {"recorder": proposer})
    assert engine.runner.caches_hidden_states
    requests = {rid: GenerationRequest(rid, tuple(p), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                       SpeculationParams("recorder", 4)) for rid, p in prompts.items()}
    results = await run_schedule(engine, {0: [requests["first"]], 8: [requests["second"]]})
    assert results["first"].outputs[-1].num_cached_tokens == 0
    assert results["second"].outputs[-1].num_cached_tokens == 32  # two blocks: the prefill ran from 32 on
    with torch.no_grad():
        truth = model(input_ids=torch.tensor([continuation["second"]]), output_hidden_states=True).hidden_states[-1][0]
    seen = [(token_ids, states) for seq_id, token_ids, states in proposer.seen if seq_id == "second"]
    assert seen and all(torch.allclose(states, truth[: states.shape[0]], atol=1e-4) for _, states in seen)
    assert prompts["second"] + results["second"].tokens == continuation["second"]


async def test_engines_on_one_runner_serve_their_own_layers_and_never_reuse_another_sets_states():
    """A runner shared by engines whose drafters read other layers (a benchmark's engines, one after another):
    each gets its own layers' states, and a prefix cached with another set's states (even one as wide) is not
    served as its own."""
    model = tiny_llama(seed=5)
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=128)
    prompt = list(range(3, 43))  # two full blocks of 16: cached after the first engine's request
    with torch.no_grad():
        full = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0].tolist()
        every = model(input_ids=torch.tensor([full]), output_hidden_states=True).hidden_states
    for n, layers in enumerate([(-1,), (1, 0, -1), (0, 1, -1), (0, 1, -1)]):
        rid = f"r{n}"
        proposer = RecordingProposer(True, {rid: full}, layers=layers)
        engine = Engine(runner, EngineConfig(max_num_batched_tokens=64, log_stats_interval_s=0,
                                             adaptive_speculation=False), {"recorder": proposer})
        request = GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                    SpeculationParams("recorder", 4))
        results = await run_schedule(engine, {0: [request]})
        assert prompt + results[rid].tokens == full
        # the same layers as the engine before: the prefix comes from the cache; other layers: computed again
        assert results[rid].outputs[-1].num_cached_tokens == (32 if n == 3 else 0)
        truth = torch.cat([every[i][0] for i in layers], dim=-1)
        assert proposer.seen and all(torch.allclose(states, truth[: states.shape[0]], atol=1e-4)
                                     for _, _, states in proposer.seen)


async def test_states_left_in_the_runner_are_read_once_at_asks_and_survive_preemption(tmp_path):
    """The llama runner keeps every position's states beside its K/V, so requests leave theirs there
    (runner_kept_states.py): an ask reads the rows it asks in one call, each from where it has states (a step
    that verified a row's draft handed it that step's), a preempted request reads what it had before its slot
    goes, and the drafter and the extracted files still get exactly the target's states. A pool of 200 tokens for
    six requests of up to ~64 preempts some mid-decode."""
    model = tiny_llama(seed=5)
    rng = random.Random(4)
    prompts = {f"p{i}": [rng.randrange(3, 96) for _ in range(rng.randint(20, 40))] for i in range(6)}
    continuation = {}
    with torch.no_grad():
        for rid, prompt in prompts.items():
            continuation[rid] = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                               min_new_tokens=24)[0].tolist()
    proposer = RecordingProposer(True, continuation, no_draft=0.4)  # a step without a draft leaves its states
    per_token = PagedKVCache.bytes_per_token(model.config.num_hidden_layers, model.config.num_key_value_heads,
                                             model.config.hidden_size // model.config.num_attention_heads,
                                             torch.float32)
    runner = LlamaFamilyRunner(model, max_num_seqs=6, max_model_len=128, kv_cache=KVCacheConfig(200 * per_token, 4))
    reads: list[list[tuple[Hashable, int, int]]] = []  # each read of the runner's kept states: its ranges
    calls = []  # each drafting call: its rows
    read, propose = runner.kept_hidden_states_of, proposer.propose

    def counted_read(ranges):
        reads.append(list(ranges))
        return read(ranges)

    def counted_propose(inputs):
        calls.append(len(inputs))
        return propose(inputs)

    runner.kept_hidden_states_of, proposer.propose = counted_read, counted_propose
    engine = Engine(runner, EngineConfig(max_num_batched_tokens=32, log_stats_interval_s=0, adaptive_speculation=False,
                                         extract_hidden_states_dir=tmp_path), {"recorder": proposer})
    requests = [GenerationRequest(rid, tuple(p), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                  SpeculationParams("recorder", 4)) for rid, p in prompts.items()]
    results = await run_schedule(engine, {0: requests})
    assert engine.num_preemptions > 0
    with torch.no_grad():
        truth = {rid: model(input_ids=torch.tensor([c]), output_hidden_states=True).hidden_states[-1][0]
                 for rid, c in continuation.items()}
    for rid, prompt in prompts.items():
        assert prompt + results[rid].tokens == continuation[rid]
        with safe_open(str(file_for(tmp_path, rid)), "pt") as f:
            extracted = f.get_tensor("hidden_states")
        assert torch.allclose(extracted[:, 0].float(), truth[rid][:-1], atol=2e-2, rtol=1e-2)
    for seq_id, token_ids, states in proposer.seen:
        assert states is not None and states.shape == (len(token_ids) - 1, 64)
        assert torch.allclose(states, truth[seq_id][: states.shape[0]], atol=1e-4)
    # at most one read an ask, a preemption and an extraction; no position read twice
    assert reads and len(reads) <= len(calls) + engine.num_preemptions + len(prompts)
    read_up_to: dict[Hashable, int] = {}
    for ranges in reads:
        for seq_id, start, stop in ranges:
            assert start >= read_up_to.get(seq_id, 0) and stop > start
            read_up_to[seq_id] = stop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the states kept on the device, read pinned")
@pytest.mark.parametrize("pinned_max", [llama_runner.PINNED_READ_MAX_BYTES, 0], ids=["pinned", "pageable"])
async def test_on_cuda_drafters_read_the_targets_own_states_from_the_runners_store(pinned_max, monkeypatch):
    """On CUDA the runner writes every position's states into its store within the captured step, and an ask
    reads its rows' unread positions from there (into pinned memory, or pageable past PINNED_READ_MAX_BYTES):
    the drafter still gets the target's own."""
    monkeypatch.setattr(llama_runner, "PINNED_READ_MAX_BYTES", pinned_max)
    model = tiny_llama(seed=5).to("cuda")
    prompts = {"a": list(range(3, 40)), "b": [7, 8, 9, 10, 11], "c": list(range(50, 20, -1))}
    continuation = {}
    with torch.no_grad():
        for rid, prompt in prompts.items():
            continuation[rid] = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24,
                                               do_sample=False, min_new_tokens=24)[0].tolist()
    proposer = RecordingProposer(True, continuation)
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=128,
                               kv_cache=KVCacheConfig(memory_bytes=8 << 20, block_size=8))  # not the GPU's memory
    engine = Engine(runner, EngineConfig(max_num_batched_tokens=16, log_stats_interval_s=0, adaptive_speculation=False),
                    {"recorder": proposer})
    assert runner.caches_hidden_states and runner.graphs is not None
    requests = [GenerationRequest(rid, tuple(p), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                  SpeculationParams("recorder", 4)) for rid, p in prompts.items()]
    results = await run_schedule(engine, {0: requests})
    with torch.no_grad():
        truth = {rid: model(input_ids=torch.tensor([c], device="cuda"), output_hidden_states=True)
                 .hidden_states[-1][0].cpu() for rid, c in continuation.items()}
    for rid, prompt in prompts.items():
        assert prompt + results[rid].tokens == continuation[rid]
    assert proposer.seen
    for seq_id, token_ids, states in proposer.seen:
        assert states is not None and states.device.type == "cpu" and states.shape == (len(token_ids) - 1, 64)
        torch.testing.assert_close(states, truth[seq_id][: states.shape[0]], atol=1e-3, rtol=1e-3)
