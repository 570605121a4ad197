"""The engine-host-cost bench's scripted model is followed exactly, and n-gram drafts of it are accepted."""

from __future__ import annotations

import pytest

from services.bench.engine_host_cost import run_case
from services.bench.request_lengths import request_tokens


async def test_the_scripted_model_is_followed_and_ngram_drafts_it_in_fewer_forwards():
    plain = await run_case(rows=2, speculate=False, tokens=64, vocab=64)
    # K fixed at 4: adaptive K follows measured step costs, which on a loaded machine once gave 34 forwards, not < 32
    drafted = await run_case(rows=2, speculate=True, tokens=64, vocab=64, adaptive=False)
    assert plain["follows_script"] and drafted["follows_script"]
    assert plain["tokens"] == drafted["tokens"] == 128
    assert drafted["forwards"] < plain["forwards"] / 2  # the script repeats: drafts from the context land
    assert plain["host_ms_per_forward"] > 0 and drafted["host_ms_per_forward"] > 0


async def test_on_novel_text_over_the_link_the_script_is_followed_and_the_drafter_rarely_asked():
    """The bench's --text novel --link rows: a real ngram drafter process that never has a draft costs a round trip
    per call, so adaptive speculation stops asking it (it was asked every step: 191 calls in 200)."""
    from services.bench.drafter_process import drafter_process

    with drafter_process(["--method", "ngram", "--num-speculative-tokens", "4"], lambda message: None) as (address, _):
        drafted = await run_case(rows=2, speculate=True, tokens=100, vocab=512, text="novel", drafter=address)
    assert drafted["follows_script"] and drafted["tokens"] == 200
    assert drafted["drafter_calls"] < 30  # the first asks and a few probes in 100 steps


async def test_the_chat_script_gives_some_drafts_a_token_or_two_and_the_simulated_device_takes_its_time():
    """--text chat: n-gram drafts of it are neither always right (repeating) nor never there (novel); the output
    still follows the script, with --rounds too. --simulated-step-ms: each forward takes at least the simulated step."""
    from services.bench.scripted_model import ScriptedRunner, Script, SimulatedDevice
    from services.modeling.runner import RowInput

    drafted = await run_case(rows=4, speculate=True, tokens=64, vocab=512, adaptive=False, text="chat")
    assert drafted["follows_script"] and drafted["tokens"] == 256
    accepted_a_draft = drafted["accepted"] / drafted["drafts"]
    assert drafted["drafts"] > 20 and 0.2 < accepted_a_draft < 2.5, drafted
    steady = await run_case(rows=2, speculate=True, tokens=32, vocab=512, text="chat", rounds=3)
    assert steady["follows_script"] and steady["tokens"] == 2 * 3 * 32  # every request of every round, scripted
    assert steady["plans"].startswith(("asked", "probed", "plain"))  # the planner's steps by kind (plan_audit.py)
    varied = await run_case(rows=2, speculate=False, tokens=32, vocab=512, text="chat", rounds=3, varied_lengths=True)
    lengths = [request_tokens(offset, 32, varied=True) for offset in range(2 * 3)]
    assert varied["follows_script"] and varied["tokens"] == sum(lengths)
    assert len(set(lengths)) == 6 and min(lengths) > 16 and max(lengths) == 32  # each its own, from 32 to over 16
    device = SimulatedDevice(base_ms=20.0, row_ms=1.0, token_ms=0.5)
    runner = ScriptedRunner(4, Script("chat", 512), simulated=device)
    for seq in range(4):
        runner.add_sequence(seq)
    runner.forward([RowInput(seq, [1, 2, 3], 3) for seq in range(4)])
    assert runner.forward_s >= device.seconds(rows=4, tokens=12) == (20.0 + 3 * 1.0 + 8 * 0.5) / 1000
    verifying = SimulatedDevice(base_ms=20.0, row_ms=1.0, token_ms=0.5, verify_ms=3.0, verify_row_ms=0.25)
    assert verifying.seconds(rows=4, tokens=4) == device.seconds(rows=4, tokens=4)  # a decode step pays no verify
    assert verifying.seconds(rows=4, tokens=12) == pytest.approx(device.seconds(rows=4, tokens=12) + 0.004)


async def test_with_a_simulated_device_decode_steps_verify_in_its_graph_as_on_an_accelerator():
    """On an accelerator a plain decode step's verification runs inside its captured graph (captured_verify.py), so
    the simulated device does the same: most forwards verify in it (greedy chains; steps with a prompt chunk run
    eagerly), the script is still followed, drafts are still accepted, and the device's time is waited."""
    from services.bench.scripted_model import ScriptedRunner, Script, SimulatedDevice
    from services.modeling.runner import RowInput
    from services.verifier.captured_verify import VerifyTail

    device = SimulatedDevice(1.0, 0.0, 0.0)
    for speculate in (False, True):
        figures = await run_case(rows=3, speculate=speculate, tokens=32, vocab=512, adaptive=False, text="chat",
                                 simulated=device, rounds=2)
        assert figures["follows_script"] and figures["tokens"] == 3 * 2 * 32
        assert figures["captured_forwards"] > 0.7 * figures["forwards"], figures
        if speculate:
            assert figures["accepted"] > 0
    runner = ScriptedRunner(2, Script("chat", 512), simulated=SimulatedDevice(20.0, 0.0, 0.0))
    for seq in (0, 1):  # two sequences of one prompt: the script gives them the same next tokens
        runner.add_sequence(seq)
        runner.forward([RowInput(seq, [1, 2, 3], 1)])
    t0, t1, t2 = runner.forward([RowInput(0, [7, 8, 9], 3)]).logits[0].argmax(dim=-1).tolist()
    tail = VerifyTail(sampled=False, drafts=((t0, t1),), positions=(4,), seeds=(0,), greedy=(True,),
                      temperatures=(1.0,))
    before = runner.forward_s
    out, _ = runner.forward_with_tail([RowInput(1, [7, t0, t1], 3)], tail)
    assert out.tolist() == [[t0, t1, t2, 2]] and runner.forward_s - before >= 0.02  # both drafts accepted
    assert ScriptedRunner(1, Script("chat", 512)).forward_with_tail([], tail) is None  # no device: forward()


async def test_through_the_verifiers_grpc_streams_the_scripted_engine_is_followed_and_timed():
    """verifier_stream_cost: the same scripted engine behind a real verifier server, read by a client process
    through a Generate call a request or one GenerateMany call; every token is the script's, and a step's wall,
    forward and the loop thread's CPU are measured over the measured rounds."""
    from services.bench.scripted_model import SimulatedDevice
    from services.bench.verifier_stream_cost import through_grpc

    for many in (False, True):  # a Generate call each, or one GenerateMany call a round
        figures = await through_grpc(rows=3, tokens=16, vocab=512, text="chat", simulated=SimulatedDevice(1.0, 0, 0),
                                     rounds=2, many=many)
        assert figures["follows_script"] and figures["tokens"] == 3 * 2 * 16
        assert figures["step_ms"] >= figures["forward_ms"] >= 1.0 and figures["loop_cpu_ms"] > 0


async def test_through_a_real_gateway_the_scripted_engine_is_followed_and_each_process_cpu_counted():
    """http_host_cost: the same scripted engine behind a real verifier and a `specserve gateway` process, read by a
    client process through POST /v1/completions, whole and streamed; every token is the script's (the answers'
    token ids), and the gateway's and the client's CPU per 1,000 tokens are measured."""
    from services.bench.http_host_cost import through_http
    from services.bench.scripted_model import SimulatedDevice

    for stream in (False, True):
        figures = await through_http(rows=3, tokens=12, vocab=512, text="chat", simulated=SimulatedDevice(1.0, 0, 0),
                                     rounds=1, stream=stream)
        assert figures["follows_script"] and figures["tokens"] == 3 * 12
        assert figures["step_ms"] >= figures["forward_ms"] >= 1.0
        assert figures["gateway_cpu_ms"] > 0 and figures["client_cpu_ms"] > 0


async def test_the_captured_step_bench_replays_every_decode_step_and_waits_the_simulated_device():
    """captured_host_cost: every decode step replays a graph (host_ms_per_step raises otherwise), with and without
    drafts, and --device-ms makes each step's wait last at least that long."""
    from services.bench.captured_host_cost import host_ms_per_step

    for speculate in (False, True):
        wall_ms, cpu_ms = await host_ms_per_step(rows=2, speculate=speculate, tokens=12)
        assert wall_ms > 0 and cpu_ms > 0
    wall_ms, _ = await host_ms_per_step(rows=2, speculate=False, tokens=12, device_ms=5.0)
    assert wall_ms >= 5.0


def test_each_chat_request_has_text_of_its_own_which_the_scripted_model_follows():
    """A suffix drafter drafts from every request it has seen: with one text for all, each answer was in the
    requests before it. The salt (the prompt's first token) gives each its own, and the model continues each."""
    from services.bench.scripted_model import ScriptedRunner, Script
    from services.modeling.runner import RowInput

    script = Script("chat", 512)
    first, second = script.prompt(0), script.prompt(1)
    assert sum(a != b for a, b in zip(first, second)) > 0.8 * len(first)
    runner = ScriptedRunner(2, script)
    for seq in (0, 1):
        runner.add_sequence(seq)
    out = runner.forward([RowInput(0, list(first), 1), RowInput(1, list(second[:len(first)]), 1)])
    next_first, next_second = (int(out.logits[b, 0].argmax()) for b in (0, 1))
    assert script.continues(first, [next_first]) and next_first == script.token(len(first), script.salt_of(first))
    assert next_second == script.token(len(first), script.salt_of(second)) != next_first


async def test_the_eagle_like_drafter_is_accepted_as_set_and_declares_the_states_it_reads():
    """--method eagle-sim: drafts right position by position with the chance set (K fixed at 4 here), an EAGLE
    drafter's declaration of the target states it reads (so the engine keeps them every step), and the output still
    the script's."""
    from services.bench.scripted_drafter import EagleLike, SimulatedAsk
    from services.bench.scripted_model import Script

    figures = await run_case(rows=2, speculate=True, tokens=64, vocab=512, adaptive=False, text="chat", rounds=2,
                             eagle_like=EagleLike(SimulatedAsk(0.5, 0.0), accept=0.55, state_width=24))
    assert figures["follows_script"] and figures["tokens"] == 2 * 2 * 64
    accepted_a_draft = figures["accepted"] / figures["drafts"]
    assert figures["drafter_calls"] > 20 and 0.7 < accepted_a_draft < 1.6, figures  # 0.55 + 0.3 + 0.17 + 0.09: 1.1
    drafter = EagleLike(SimulatedAsk(0.5, 0.0), accept=0.0, state_width=24).drafter(Script("chat", 512))
    prompt = Script("chat", 512).prompt(3)
    assert drafter.capabilities.needs_hidden_states and drafter.capabilities.state_width == 24
    assert not Script("chat", 512).continues(prompt, drafter.draft(prompt, 4)[:1])  # never right at accept 0
    drafter.close()


async def test_mixed_text_has_requests_that_repeat_among_chats_each_read_as_one_generatemany_call_reads_them():
    """--text mixed: one request in MIXED_REPEATING_EVERY repeats (drafts of it land), the others chat; a request's
    latency is reported by kind. The requests' outputs come through one RequestMux (muxed_clients.py) by default,
    the same tokens as a task a request reads (per_request_streams)."""
    from services.bench.scripted_model import MIXED_REPEATING_EVERY, Script

    script = Script("mixed", 512)
    repeating, chat = script.prompt(0), script.prompt(1)
    assert script.repeats(0) and not script.repeats(1) and script.repeats(MIXED_REPEATING_EVERY)
    assert repeating[41:80] == repeating[1:40]  # a period of 40 after the salt
    assert chat[41:80] != chat[1:40]  # chat text: phrases with words changed, no period
    muxed = await run_case(rows=MIXED_REPEATING_EVERY, speculate=True, tokens=48, vocab=512, adaptive=False,
                           text="mixed")
    assert muxed["follows_script"] and muxed["tokens"] == MIXED_REPEATING_EVERY * 48
    assert muxed["repeating_request_s"] > 0 and muxed["other_request_s"] > 0
    streamed = await run_case(rows=2, speculate=False, tokens=16, vocab=512, text="mixed", per_request_streams=True)
    assert streamed["follows_script"] and streamed["tokens"] == 32


def test_the_eagle_like_drafter_guesses_requests_that_repeat_at_their_own_chance():
    from services.bench.scripted_drafter import EagleLike, SimulatedAsk
    from services.bench.scripted_model import Script

    script = Script("mixed", 512)
    drafter = EagleLike(SimulatedAsk(0.5, 0.0), accept=0.0, state_width=24, repeating_accept=1.0).drafter(script)
    repeating, chat = script.prompt(0), script.prompt(1)
    assert script.continues(repeating, drafter.draft(repeating, 4))  # always right on the repeating request
    assert not script.continues(chat, drafter.draft(chat, 4)[:1])  # never on the chat
    drafter.close()
