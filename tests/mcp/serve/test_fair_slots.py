"""``serve.max_concurrent``'s slots between clients (``runner.mcp.serve.slots``): the logic
alone, on an event loop, and one client keeping many calls queued against the real
server, where another client's call waits for one of them, not for all."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
from conftest import ToolBench
from support.mcp_harness import SLEEPER, SLOW, HttpServer, add_token

from runner.mcp.serve.slots import FairSlots


def test_a_freed_slot_goes_to_the_client_with_the_fewest_calls_running() -> None:
    async def scenario() -> list[str]:
        slots = FairSlots(2)
        granted: list[str] = []

        async def call(client: str) -> None:
            await slots.acquire(client)
            granted.append(client)

        await slots.acquire("alice")
        await slots.acquire("alice")
        queued = [asyncio.ensure_future(call("alice")) for _ in range(5)]
        await asyncio.sleep(0)
        late = asyncio.ensure_future(call("bob"))
        await asyncio.sleep(0)
        slots.release("alice")
        await asyncio.sleep(0)
        slots.release("alice")
        await asyncio.sleep(0)
        for task in (*queued, late):
            task.cancel()
        return granted

    assert asyncio.run(scenario()) == ["bob", "alice"]


def test_a_cancelled_waiter_holds_no_slot_even_if_granted_as_it_was_cancelled() -> None:
    async def scenario() -> tuple[bool, bool]:
        slots = FairSlots(1)
        await slots.acquire("a")
        waiter = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0)
        slots.release("a")  # granted to b, and b cancelled before it resumes
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gone = asyncio.ensure_future(slots.acquire("c"))
        await asyncio.sleep(0)
        first = gone.done()
        other = asyncio.ensure_future(slots.acquire("d"))  # nothing left: it waits
        await asyncio.sleep(0)
        second = other.done()
        other.cancel()
        return first, second

    assert asyncio.run(scenario()) == (True, False)


def test_a_waiter_cancelled_in_the_turn_a_slot_is_freed_neither_takes_it_nor_breaks_the_release() -> None:
    async def scenario() -> tuple[bool, bool]:
        slots = FairSlots(1)
        await slots.acquire("a")
        waiter = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0)
        waiter.cancel()  # its deadline, in the same turn as the running call's end
        slots.release("a")
        with pytest.raises(asyncio.CancelledError):
            await waiter
        third = asyncio.ensure_future(slots.acquire("c"))
        await asyncio.sleep(0)
        return third.done(), bool(slots._waiting)

    assert asyncio.run(scenario()) == (True, False)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_one_client_queueing_many_calls_delays_anothers_by_one_call_not_by_its_queue(
    bench: ToolBench, anyio_backend: str
) -> None:
    # One queue in order of arrival: bob's call waited behind all of alice's (four rounds
    # of her 2 s calls here), and timed out at its deadline under more.
    bench.tool("sleeper", SLEEPER, limits=SLOW)
    bench.policy["roles"] = {"user": {"allow": ["sleeper"]}}
    bench.policy["serve"] = {"max_concurrent": 2}
    bench.policy["defaults"]["deadline_ms"] = 60000  # her last call waits for six of hers
    alice, bob = add_token(bench, "alice", "user"), add_token(bench, "bob", "user")
    server = HttpServer(bench)
    took: dict[str, float] = {}
    try:
        async with server.client(alice) as hers, server.client(bob) as his:

            async def queued(n: int) -> None:
                result = await hers.call_tool("sleeper", {"seconds": 2, "n": n})
                assert not result.is_error, result.content

            async def quick() -> None:
                await anyio.sleep(0.5)  # alice's eight are in by then: two run, six wait
                started = time.monotonic()
                result = await his.call_tool("sleeper", {"seconds": 0.01, "n": 99})
                took["bob"] = time.monotonic() - started
                assert not result.is_error, result.content

            started = time.monotonic()
            async with anyio.create_task_group() as tasks:
                for n in range(8):
                    tasks.start_soon(queued, n)
                tasks.start_soon(quick)
            took["alice"] = time.monotonic() - started
    finally:
        assert server.stop() == 0
    # Bob waits for one of alice's running calls (about 2 s), not for her queue (8 s).
    assert took["bob"] < took["alice"] / 2, took
