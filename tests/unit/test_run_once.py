"""RunOnce: one run however often asked for, every caller waiting for it."""

from __future__ import annotations

import asyncio

from services.common.run_once import RunOnce


async def test_a_second_call_waits_for_the_first_run_and_starts_nothing():
    runs, done = [], asyncio.Event()

    async def stop() -> None:
        runs.append("started")
        await done.wait()

    once = RunOnce("test-stop")
    await once.wait()  # nothing started: returns at once
    first = asyncio.create_task(once.run(stop))
    second = asyncio.create_task(once.run(stop))
    waiting = asyncio.create_task(once.wait())
    await asyncio.sleep(0.01)
    assert runs == ["started"] and not any(t.done() for t in (first, second, waiting))
    done.set()
    await asyncio.gather(first, second, waiting)
    assert runs == ["started"]
