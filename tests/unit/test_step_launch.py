"""A step's device work is launched before the engine's loop serves anything else (Engine.step).

The compute thread builds a step's inputs and launches its replay in Python, under the interpreter lock; the loop
waits (the lock released) until then, so that the sends the last step woke run while the device computes, not
before it starts. On CPU graphs replay by running the forward again (RerunOnReplay), so the order is observable.
"""

from __future__ import annotations

import asyncio

import pytest

from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.step_graphs import StepGraphs
from services.verifier import engine as engine_module
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams
from tests.tiny_models import tiny_llama
from tests.unit.test_step_graphs import RerunOnReplay


class RecordingReplays(RerunOnReplay):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    def capture(self, forward):
        replay, outputs = super().capture(forward)

        def recorded() -> None:
            self.order.append("replay")
            replay()

        return recorded, outputs


def engine_over(runner: LlamaFamilyRunner) -> Engine:
    return Engine(runner, EngineConfig(adaptive_speculation=False, log_stats_interval_s=0))


async def decode_step_order(engine: Engine, order: list[str], monkeypatch) -> list[str]:
    """The order of the replay or forward, the launch signal and a loop callback in one decode step."""
    launches = engine_module.execute_isolating_faults

    def recording(runner, prefill, decode, drafts, launched):
        def signal() -> None:
            order.append("launched")
            launched()

        return launches(runner, prefill, decode, drafts, signal)

    monkeypatch.setattr(engine_module, "execute_isolating_faults", recording)
    monkeypatch.setattr(engine_module, "LAUNCH_WAIT_S", 60.0)  # a slow CI machine's thread hop must not decide
    request = GenerationRequest("r", list(range(1, 20)), SamplingParams(max_tokens=4, temperature=0.0))
    stream = engine.add_request(request)
    await engine.step()  # the prompt (its first token too)
    order.clear()
    asyncio.get_running_loop().call_soon(order.append, "loop")
    await engine.step()
    await asyncio.sleep(0)
    assert len(stream.ready_outputs()) == 2
    await engine.shutdown()
    return order


async def test_the_loop_serves_others_only_once_a_captured_step_is_launched(monkeypatch):
    order: list[str] = []
    runner = LlamaFamilyRunner(tiny_llama(seed=1), max_num_seqs=2, max_model_len=128)
    runner.graphs = StepGraphs(runner._body, RecordingReplays(order), (1, 2), runner.device, max_width=8,
                               head=runner._head)
    order = await decode_step_order(engine_over(runner), order, monkeypatch)
    # "launched" is signalled right after the replay (and again as the step returns, which changes nothing); the
    # callback the loop had ready ran after both
    assert order[:2] == ["replay", "launched"], order
    assert order.index("loop") > order.index("launched")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-refused"])
async def test_a_forward_on_the_host_is_signalled_before_it_runs(monkeypatch, graphs):
    """An eager forward (CPU, or a shape no graph takes) would hold the loop for its whole length: the launch is
    signalled before it starts."""
    order: list[str] = []
    runner = LlamaFamilyRunner(tiny_llama(seed=1), max_num_seqs=2, max_model_len=128)
    if graphs:  # graphs that take no tail: the captured verify is refused and the step runs forward()
        runner.graphs = StepGraphs(runner._body, RecordingReplays(order), (1, 2), runner.device, max_width=8)
    forward = runner.forward

    def recorded(rows):
        order.append("forward")
        return forward(rows)

    runner.forward = recorded
    order = await decode_step_order(engine_over(runner), order, monkeypatch)
    assert order.index("launched") < order.index("forward"), order
