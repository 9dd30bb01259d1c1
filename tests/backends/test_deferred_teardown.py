"""Teardown off the call's path (``sandboxes._deferred``): a call returns once every
process of its sandbox is dead, what is left (empty cgroups, a dead container, a uid
lease) goes after it, and closing the runner waits for all of it. Also the docker gate's
trailer (``sandboxes.docker._trailer``), read apart from the tool's own bytes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import TRACING_TOOL, ToolBench, our_cgroups, wait_for

from sandboxes._deferred import DeferredTeardown
from sandboxes._streams import TailBuffer
from sandboxes.docker._trailer import MARKER, TrailerReader, both_said
from sandboxes.subprocess._cgroup import CgroupFactory
from sandboxes.subprocess.sandbox import SubprocessSandbox
from sandboxes.testing import processes_with_env

TOKEN = "ab" * 16


def _trailer(status: int, token: str = TOKEN) -> bytes:
    return MARKER + b" " + token.encode() + b" " + str(status).encode() + b"\n"


def _read(chunks: list[bytes]) -> tuple[bytes, int | None]:
    sink = TailBuffer(1 << 20)
    reader = TrailerReader(sink, TOKEN)
    for chunk in chunks:
        reader.feed(chunk)
    if reader.status is None:
        reader.flush()
    return bytes(sink.text(), "utf-8"), reader.status


def test_the_trailer_is_taken_off_the_stream_even_split_byte_by_byte() -> None:
    data = b'{"ok": 1}' + _trailer(3) + b"a leftover's late words"
    assert _read([data]) == (b'{"ok": 1}', 3)
    assert _read([bytes([b]) for b in data]) == (b'{"ok": 1}', 3)


def test_a_trailer_with_another_token_or_a_bad_status_is_the_tools_own_output() -> None:
    assert _read([b'{"id": 1}\n']) == (b'{"id": 1}\n', None)  # nothing held back at a line's end
    forged = b"out" + _trailer(0, "cd" * 16)
    assert _read([forged]) == (forged, None)
    bad = b"out" + MARKER + b" " + TOKEN.encode() + b" 12345\n"
    assert _read([bad]) == (bad, None)
    assert _read([b"out" + _trailer(0)[:-3]]) == (b"out" + _trailer(0)[:-3], None)  # cut short


def test_the_status_counts_only_once_both_streams_said_the_same() -> None:
    out, err = TrailerReader(TailBuffer(100), TOKEN), TrailerReader(TailBuffer(100), TOKEN)
    out.feed(_trailer(7))
    assert both_said((out, err)) is None
    err.feed(_trailer(7))
    assert both_said((out, err)) == 7


def test_deferred_steps_run_in_order_and_wait_joins_the_worker() -> None:
    done: list[int] = []
    gate = threading.Event()
    teardowns = DeferredTeardown("runner-test-teardown")

    def held() -> None:
        gate.wait(5.0)

    teardowns.submit(held)
    for n in range(5):
        teardowns.submit(lambda n=n: done.append(n))  # type: ignore[misc]
    assert teardowns.pending() == 6
    gate.set()
    teardowns.wait()
    assert done == [0, 1, 2, 3, 4]
    assert teardowns.pending() == 0
    assert not [t for t in threading.enumerate() if t.name == "runner-test-teardown"]


def test_a_failed_step_does_not_stop_the_others_and_is_raised_by_wait() -> None:
    done: list[str] = []
    teardowns = DeferredTeardown("runner-test-teardown")

    def broken() -> None:
        raise ValueError("a bug")

    teardowns.submit(broken)
    teardowns.submit(lambda: done.append("after"))
    with pytest.raises(ValueError, match="a bug"):
        teardowns.wait()
    assert done == ["after"]
    teardowns.wait()  # reported once


def _members(group: Path) -> list[str]:
    try:
        return (group / "cgroup.procs").read_text().split()
    except OSError:
        return []  # removed meanwhile


@pytest.mark.skipif(os.geteuid() != 0, reason="the hardened sandbox runs as root here")
@pytest.mark.parametrize("pool", [0, 2])
def test_right_after_a_call_nothing_of_it_runs_and_after_close_nothing_is_left(
    bench: ToolBench, pool: int
) -> None:
    mark = os.urandom(8).hex()
    bench.tool("trace", TRACING_TOOL, env={"DEFER_MARK": mark})  # it leaves a sleeping child
    bench.policy["tools"] = {"trace": {"pool": pool}}
    runner = bench.runner()
    try:
        for n in range(5):
            if pool:
                wait_for(lambda: runner.warm_sandboxes()["trace"] == pool)
            answer = runner.handle({"toolName": "trace", "params": {"n": n}})
            assert answer["success"], answer
            # The call's own processes (the tool and the child it left) are all gone; only
            # idle warm sandboxes (one tool process each) may be alive.
            alive = processes_with_env(f"DEFER_MARK={mark}")
            assert len(alive) <= pool, alive
            busy = [g for g in our_cgroups(os.getpid()) if _members(g)]
            assert len(busy) <= pool * (3 if CgroupFactory().version == 1 else 1), busy
        # Cold calls are prepared by the backend's own threads, kept from call to call.
        backend = runner._sandbox_factory("subprocess")
        assert isinstance(backend, SubprocessSandbox)
        preparers = backend.preparers
        assert (preparers._pool is not None) == (pool == 0)
        threads = list(preparers._pool._threads) if preparers._pool is not None else []
    finally:
        runner.close()
    assert all(not thread.is_alive() for thread in threads)  # joined by the close
    assert processes_with_env(f"DEFER_MARK={mark}") == []
    assert our_cgroups(os.getpid()) == []
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("runner-teardown")], 1.0)
