"""The pool of isolated task processes (worker/isolated/pool.py ``ProcessPool``) keeps a process
whose nested calls started a runtime there: it may own objects that others still hold
(docs/isolation.md#nested-calls); idle processes without one are reaped."""

from __future__ import annotations

import time
from types import SimpleNamespace

from yrdask.worker.isolated.pool import ProcessPool, _PooledProcess


class FakeProc:
    stdin = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        return -9


class FakeComm:
    """The agent's connection to a pooled process (connected once it listens)."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class FakeLoop:
    def __init__(self) -> None:
        self.later: list = []

    def call_later(self, delay: float, fn, *args) -> None:
        self.later.append((delay, fn))

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)


def test_an_idle_process_that_owns_a_runtime_is_kept_the_others_are_reaped():
    loop = FakeLoop()
    pool = ProcessPool(SimpleNamespace(loop=loop), idle_s=10)
    long_ago = time.monotonic() - 60
    plain, owner, fresh = (_PooledProcess(FakeProc(pid), f"tcp://127.0.0.1:{pid}", FakeComm())
                           for pid in (1, 2, 3))
    owner.owner = True
    plain.idle_since = owner.idle_since = long_ago
    fresh.idle_since = time.monotonic()
    pool.every = {plain, owner, fresh}
    pool.idle = {"k": [plain, owner, fresh]}
    pool._reap()
    assert plain.proc.killed and not owner.proc.killed and not fresh.proc.killed
    assert plain.comm.aborted and not owner.comm.aborted  # its connection goes with it
    assert pool.idle == {"k": [owner, fresh]} and pool.every == {owner, fresh}
    assert pool._reaping and loop.later  # it looks again while any is left
    fresh.idle_since = long_ago
    loop.later.clear()
    pool._reap()
    assert fresh.proc.killed and not owner.proc.killed and pool.idle == {"k": [owner]}
    assert not pool._reaping and not loop.later  # owners alone: no timer ticks for nothing
