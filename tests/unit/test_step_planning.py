"""Prefill planning (step_planning.plan_prefill): short prompts are not held behind long prefills, the oldest long
prompt keeps moving, and the budget is never exceeded."""

from __future__ import annotations

import asyncio

from services.verifier.request_state import RequestState
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from services.verifier.step_planning import PrefillBacklog, plan_prefill, speculation_cap


def state(request_id: str, prompt_len: int, computed: int = 0) -> RequestState:
    request = GenerationRequest(request_id, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=4))
    return RequestState(request, seed=0, token_ids=list(request.prompt_token_ids), outputs=asyncio.Queue(),
                        num_computed=computed)


def planned(chunks) -> dict[str, int]:
    return {chunk.state.request_id: len(chunk.tokens) for chunk in chunks}


def test_short_prompts_behind_long_ones_are_prefilled_whole_in_this_step():
    running = [state("long0", 6000), state("long1", 6000), state("chat0", 40), state("chat1", 60)]
    chunks = plan_prefill(running, decode_tokens=0, max_num_batched_tokens=512)
    sizes = planned(chunks)
    assert sizes["chat0"] == 40 and sizes["chat1"] == 60
    assert sizes["long0"] == 512 - 100 and "long1" not in sizes  # the rest, oldest long first
    assert [c.state.request_id for c in chunks] == ["long0", "chat0", "chat1"]  # running order
    assert all(c.final for c in chunks if c.state.request_id.startswith("chat"))


def test_the_oldest_long_prompt_keeps_a_quarter_of_the_budget_whatever_short_prompts_wait():
    running = [state("long0", 6000, computed=1000)] + [state(f"chat{i}", 200) for i in range(10)]
    sizes = planned(plan_prefill(running, decode_tokens=0, max_num_batched_tokens=512))
    assert sizes["long0"] >= 128
    assert sum(sizes.values()) <= 512
    assert sizes["chat0"] == 200  # first come, first served among the short ones


def test_the_budget_holds_with_decode_rows_and_long_prompts_share_it_in_arrival_order():
    running = [state("long0", 900, computed=850), state("long1", 3000), state("long2", 3000)]
    sizes = planned(plan_prefill(running, decode_tokens=100, max_num_batched_tokens=512))
    assert sizes == {"long0": 50, "long1": 362}  # long0's last 50 count as short; then long1 with the rest
    sizes = planned(plan_prefill(running[1:], decode_tokens=600, max_num_batched_tokens=512))
    assert sizes == {"long1": 128}  # never less than a quarter of the budget for prompts


def test_drafts_displace_prompt_tokens_only_where_the_budget_binds():
    running = [state("a", 300, computed=100), state("b", 500)]
    backlog = PrefillBacklog.of(running, max_num_batched_tokens=512)
    assert backlog.waiting == 200 + 500
    assert backlog.displaced(narrow_tokens=64, wide_tokens=64 * 4) == 448 - 256  # each draft token pushes one out
    assert backlog.displaced(narrow_tokens=64, wide_tokens=64 * 9) == 448 - 128  # a quarter always prefills
    assert backlog.displaced(narrow_tokens=64, wide_tokens=64) == 0
    small = PrefillBacklog.of([state("c", 200, computed=150)], max_num_batched_tokens=512)
    assert small.displaced(narrow_tokens=64, wide_tokens=64 * 4) == 0  # 50 waiting fit either way
    assert PrefillBacklog.of([], 512).waiting == 0


async def test_a_chat_sent_after_long_prompts_gets_its_first_token_in_the_first_step():
    """On the engine: two long prompts (seven steps of prefill each at 64 tokens a step) and then a short chat,
    all at once; the chat's first token comes from the first step, the long prompts' after the chat's is done;
    every output equals the one the request gets alone (greedy)."""
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from tests.engine_harness import run_schedule
    from tests.tiny_models import tiny_llama

    model = tiny_llama(seed=4)

    def engine() -> Engine:
        runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=512)
        return Engine(runner, EngineConfig(max_num_batched_tokens=64, log_stats_interval_s=0), {})

    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = {"long0": tuple(3 + i % 80 for i in range(420)), "long1": tuple(5 + i % 70 for i in range(400)),
               "chat": (7, 8, 9, 10, 11, 12)}
    requests = [GenerationRequest(rid, prompt, greedy) for rid, prompt in prompts.items()]
    together = engine()
    streams = {r.request_id: together.add_request(r) for r in requests}
    await together.step()
    first_step = {rid: [o for o in stream.ready_outputs() if o.token_ids] for rid, stream in streams.items()}
    assert first_step["chat"] and not first_step["long0"] and not first_step["long1"]
    while together.num_running or together.num_waiting:
        await together.step()
    for request in requests:
        alone = (await run_schedule(engine(), {0: [request]}))[request.request_id].tokens
        got = [t for o in first_step[request.request_id] + streams[request.request_id].ready_outputs()
               for t in o.token_ids]
        assert got == alone, request.request_id


async def test_a_row_asked_for_drafts_that_has_none_leaves_its_room_to_prompts():
    """The prompt chunks are planned once the drafts are in hand: a decoding row asked for 8 draft tokens whose
    drafter had none feeds one token, and the other 63 of a 64-token budget prefill a waiting prompt (planned
    before drafting, the 8 tokens asked for were held back from it: 55)."""
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.sampling_params import SpeculationParams
    from tests.proposers import EmptyProposer
    from tests.tiny_models import tiny_llama

    runner = LlamaFamilyRunner(tiny_llama(seed=4), max_num_seqs=4, max_model_len=512)
    engine = Engine(runner, EngineConfig(max_num_batched_tokens=64, adaptive_speculation=False,
                                         log_stats_interval_s=0), {"empty": EmptyProposer()})
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    engine.add_request(GenerationRequest("chat", (7, 8, 9), greedy, SpeculationParams("empty", 8)))
    await engine.step()  # the chat's prefill gives its first token: it decodes from the next step on
    engine.add_request(GenerationRequest("long", tuple(3 + i % 80 for i in range(400)), greedy))
    await engine.step()
    (long,) = [s for s in engine._running if s.request_id == "long"]
    assert long.num_computed == 63


def test_a_rows_cap_is_its_k_within_its_drafters_limit_its_output_budget_and_the_context():
    def speculating(k: int, max_tokens: int, method: str = "ngram", output: int = 0) -> RequestState:
        request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=max_tokens), SpeculationParams(method, k))
        return RequestState(request, seed=0, token_ids=[1, 2, 3] + [7] * output, outputs=asyncio.Queue())

    unlimited = {"ngram": 0}
    assert speculation_cap(speculating(5, 100), 1000, unlimited) == 5
    assert speculation_cap(speculating(5, 100), 1000, {"ngram": 3}) == 3  # the drafter's declared limit
    assert speculation_cap(speculating(5, 100), 1000, {}) == 5  # a method without a proposer: no limit
    assert speculation_cap(speculating(5, 10, output=7), 1000, unlimited) == 2  # 3 tokens left: 2 drafts + 1
    assert speculation_cap(speculating(5, 10, output=9), 1000, unlimited) == 0
    assert speculation_cap(speculating(5, 100, output=4), 10, unlimited) == 2  # 7 positions used of 10
    assert speculation_cap(speculating(5, 100, output=6), 9, unlimited) == 0
    assert speculation_cap(speculating(5, 100, method="none"), 1000, unlimited) == 0
    assert speculation_cap(speculating(0, 100), 1000, unlimited) == 0
    assert speculation_cap(state("plain", 3), 1000, unlimited) == 0
