"""``expertd.server.batching.offload.run``: a request's host work on the loop when small, on a worker
thread when it touches OFFLOAD_ELEMENTS elements or more; results and errors come back alike."""
import asyncio
import threading

import pytest

from expertd.server.batching import offload


def where(value):
    return threading.current_thread().name, value


def test_small_work_runs_on_the_loop_and_large_work_on_a_thread():
    async def main():
        loop_thread = threading.current_thread().name
        small = await offload.run(where, "small", elements=offload.OFFLOAD_ELEMENTS - 1)
        large = await offload.run(where, "large", elements=offload.OFFLOAD_ELEMENTS)
        return loop_thread, small, large

    loop_thread, small, large = asyncio.run(main())
    assert small == (loop_thread, "small")
    assert large[1] == "large" and large[0] != loop_thread


def test_the_loop_keeps_running_while_large_work_runs():
    release = threading.Event()
    ticks = []

    def blocking():
        assert release.wait(10)
        return "done"

    async def main():
        work = asyncio.ensure_future(offload.run(blocking, elements=offload.OFFLOAD_ELEMENTS))
        for _ in range(3):  # the loop is free: it runs other callbacks while the work waits
            ticks.append(await asyncio.sleep(0.001, "tick"))
        release.set()
        return await work

    assert asyncio.run(main()) == "done" and ticks == ["tick"] * 3


@pytest.mark.parametrize("elements", [1, offload.OFFLOAD_ELEMENTS], ids=["inline", "thread"])
def test_errors_come_back_to_the_caller(elements):
    def failing():
        raise ValueError("bad body")

    with pytest.raises(ValueError, match="bad body"):
        asyncio.run(offload.run(failing, elements=elements))
