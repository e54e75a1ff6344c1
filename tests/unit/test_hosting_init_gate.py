"""No method call runs before the instance's ``__init__`` finished, whatever the executor.

Drives :class:`~yrdask.worker.hosting.HostedInstance` (the code both the worker and an
isolated child host instances with) through an agent that keeps values in memory: calls
arrive while a slow ``__init__`` is still running, as they do when a caller's first call
reaches the worker right after ``START_INSTANCE``.
"""
from __future__ import annotations

import threading
import time

import cloudpickle
import pytest

from yrdask import protocol as P
from yrdask.serialization import dumps, dumps_value, loads, pack_args, unpack_args, wire
from yrdask.worker.hosting import HostedInstance

pytestmark = pytest.mark.timeout(30)


class _Agent:
    """What HostedInstance needs of an agent: payloads in, results out, the ALIVE report."""

    def __init__(self) -> None:
        self.alive = threading.Event()

    def payloads(self, deps: list) -> list:
        return []

    def pack_results(self, task_id: str, result, nret: int, caller=None) -> tuple:
        return [[P.VALUE, wire(dumps_value(result))]], None

    def unpack_call(self, msg: dict) -> tuple:
        return unpack_args(msg["args"], []), []

    def load_value(self, payload):  # pragma: no cover - no ref arguments here
        return loads(payload)

    def refs_report(self, borrowed, nested) -> None:
        return None

    def report_state(self, instance_id: str, state: str, error) -> None:
        self.alive.set()

    def item_sender(self, peer, task_id: str):  # pragma: no cover - no generator here
        raise AssertionError("no generator methods in this test")


class _Peer:
    def __init__(self, expected: int) -> None:
        self.replies: list[dict] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = expected

    def reply(self, msg: dict) -> None:
        with self.lock:
            self.replies.append(msg)
            if len(self.replies) >= self.expected:
                self.done.set()


class SlowInit:
    def __init__(self) -> None:
        time.sleep(0.3)  # calls arrive meanwhile
        self.seen = set()

    def add(self, x):
        self.seen.add(x)
        return len(self.seen)


class SlowInitAsync:
    def __init__(self) -> None:
        time.sleep(0.3)
        self.counter = 0

    async def incr(self, _x):
        self.counter += 1
        return self.counter


def _spec(cls, concurrency, is_async):
    args, _refs = pack_args((), {}, lambda v: False)
    return {"instance_id": "i1", "cls_name": cls.__name__, "cls": cloudpickle.dumps(cls),
            "args": args, "concurrency": concurrency, "is_async": is_async}


def _call(call_id: str, method: str, *a) -> dict:
    args, _refs = pack_args(a, {}, lambda v: False)
    return {"task_id": call_id, "method": method, "args": args, "deps": [], "nret": 1}


@pytest.mark.parametrize("cls,method,concurrency,is_async", [
    (SlowInit, "add", 1, False),
    (SlowInit, "add", 2, False),
    (SlowInit, "add", 8, False),
    (SlowInitAsync, "incr", None, True),
    (SlowInitAsync, "incr", 1, True),
])
def test_calls_wait_for_the_constructor(cls, method, concurrency, is_async):
    agent = _Agent()
    inst = HostedInstance(agent, _spec(cls, concurrency, is_async), [])
    n = 6
    peer = _Peer(n)
    for k in range(n):
        inst.call(peer, _call(f"c{k}", method, k))
    try:
        assert peer.done.wait(10), f"only {len(peer.replies)} of {n} calls answered"
        errors = [loads(m["error"]) for m in peer.replies if m.get("error")]
        assert not errors, f"calls ran before __init__ finished: {errors[0].to_exception()!r}"
        assert agent.alive.wait(5), "the instance never reported ALIVE"
    finally:
        inst.stop("test over")
