"""A sync instance's run of chained calls takes its share of the worker once while no Dask
task is about, and each call takes its turn again while one is (worker/share.py).  (The
caller's plain answers: tests/unit/test_hot_paths.py.)"""
from __future__ import annotations

import threading

import cloudpickle
import pytest

from yrdask import protocol as P
from yrdask.serialization import dumps_value, pack_args, unpack_args, wire
from yrdask.worker.hosting import HostedInstance

pytestmark = pytest.mark.timeout(30)

W = "tcp://w1:1"
GATE = threading.Event()  # __init__ waits for it: the calls queue up behind it


class Gated:
    def __init__(self) -> None:
        GATE.wait(10)
        self.n = 0

    def inc(self, i):
        self.n += 1
        return i + 1


class _Share:
    """The share's instance-call side, counted (``dask``: Dask tasks about)."""

    wired = True

    def __init__(self, dask: int) -> None:
        self.dask = dask
        self.starts = self.ends = 0
        self.holding = 0  # calls holding a share now (never above one here)
        self.most = 0

    def call_start(self) -> None:
        self.starts += 1
        self.holding += 1
        self.most = max(self.most, self.holding)

    def call_end(self) -> None:
        self.ends += 1
        self.holding -= 1


class _Agent:
    def __init__(self, share: _Share) -> None:
        self.share = share

    def pack_results(self, task_id, result, nret, caller=None):
        return [[P.VALUE, wire(dumps_value(result))]], None

    def unpack_call(self, msg):
        return unpack_args(msg["args"], []), []

    def refs_report(self, borrowed, nested):
        return None

    def report_state(self, instance_id, state, error):
        pass


class _Peer:
    def __init__(self, expected: int) -> None:
        self.replies: list[dict] = []
        self.done = threading.Event()
        self.expected = expected

    def reply(self, msg: dict) -> None:
        self.replies.append(msg)
        if len(self.replies) >= self.expected:
            self.done.set()


def _run_chain(dask: int, n: int = 6) -> tuple[_Share, _Peer]:
    GATE.clear()
    share = _Share(dask)
    args, _ = pack_args((), {}, lambda v: False)
    inst = HostedInstance(_Agent(share), {"instance_id": "i1", "cls_name": "Gated",
                                          "cls": cloudpickle.dumps(Gated), "args": args,
                                          "concurrency": 1}, [])
    peer = _Peer(n)
    try:
        for k in range(n):  # all queued before __init__ ends: they run as one chain
            blob, _ = pack_args((k,), {}, lambda v: False)
            inst.call(peer, {"task_id": f"c{k}", "method": "inc", "args": blob, "deps": [],
                             "nret": 1})
        GATE.set()
        assert peer.done.wait(10), f"only {len(peer.replies)} of {n} calls answered"
    finally:
        inst.stop("test over")
    return share, peer


def test_a_run_of_calls_takes_the_share_once_without_dask_tasks():
    share, peer = _run_chain(dask=0)
    assert [m["task_id"] for m in peer.replies] == [f"c{k}" for k in range(6)]
    assert share.starts == share.ends == 2  # __init__'s turn, then the chain's
    assert share.most == 1 and share.holding == 0


def test_each_call_takes_its_turn_while_dask_tasks_are_about():
    share, peer = _run_chain(dask=1)
    assert len(peer.replies) == 6
    assert share.starts == share.ends == 7  # __init__ and each call
    assert share.most == 1 and share.holding == 0
