"""Calls to a process instance go straight to its own process (docs/isolation.md,
"Instances"): the scheduler registers the process's endpoint as the instance's address,
callers send calls there, and the worker agent only supervises (it relays nothing).  When
the process dies with calls in flight, each caller delivers them again by its own
``CallOrder`` rule: the oldest ``concurrency`` may have been running and are charged a
crash (bounded by the method's own bound), the others run once.

The embedded cluster has one worker process.
"""

from __future__ import annotations

import os

import psutil
import pytest

import yrdask as yr
from yrdask import protocol as P

pytestmark = pytest.mark.timeout(120)

T = 60
BIG = 2 << 20  # over the inline limit: kept in the node's store


def small(**kw) -> yr.InvokeOptions:
    return yr.InvokeOptions(cpu=50, memory=10, **kw)


@yr.instance
class Logged:
    def __init__(self, log: str) -> None:
        self.log = log

    def _note(self, tag: str) -> None:
        with open(self.log, "a") as f:
            f.write(tag + "\n")

    def note(self, tag: str) -> str:
        self._note(tag)
        return tag

    def pid(self) -> int:
        return os.getpid()

    def big(self) -> bytes:
        return b"x" * BIG

    def count(self, n: int):
        yield from range(n)

    def die_once(self, marker: str, tag: str) -> str:
        self._note(tag)
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(9)
        return "back"

    def die_always(self, tag: str) -> None:
        self._note(tag)
        os._exit(9)

    die_always.__yr_max_redeliveries__ = 0  # its own bound (Ray's max_task_retries=0)


@yr.instance
class Wide:
    """Calls that may overlap, and how many ran at once at most."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.running = self.most = 0

    def echo(self, i: int) -> int:
        import time

        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.002)
        with self.lock:
            self.running -= 1
        return i

    def count(self, n: int):
        yield from range(n)

    def widest(self) -> int:
        return self.most


@yr.invoke
def count_relayed(start: bool) -> int:
    """In the worker: count the calls its agent receives from now on (``start``), or say
    how many it received and put its own handler back."""
    from yrdask.runtime.context import installed_runtime

    agent = installed_runtime().agent
    handlers = agent.channel_handlers
    if start:
        real = handlers[P.CALL_METHOD]
        seen: list = []

        def counting(peer, msg):
            seen.append(msg["task_id"])
            real(peer, msg)
        counting.real, counting.seen = real, seen
        handlers[P.CALL_METHOD] = counting
        return 0
    counting = handlers[P.CALL_METHOD]
    handlers[P.CALL_METHOD] = counting.real
    return len(counting.seen)


def located(h) -> str:
    """The address the scheduler gives callers for ``h``'s instance."""
    from yrdask.runtime.context import current_runtime

    rt = current_runtime()
    reply = rt.run_sync(rt.connector.request(P.LocateInstance(h.instance_id)), T)
    assert reply[0] == P.ALIVE, reply
    return reply[1]


def test_callers_reach_the_process_at_its_own_endpoint_not_through_the_agent(cluster,
                                                                             tmp_path):
    """The instance's address at the scheduler is its process's listening endpoint on the
    worker's host, and calls, a large result, a generator's items and a cancel all work
    while the worker agent receives none of its calls."""
    cluster(kind="embedded", num_cpus=1)
    h = Logged.options(small(light=False)).invoke(str(tmp_path / "log"))
    pid = yr.get(h.pid.invoke(), T)
    worker = h.status()["worker"]
    address = located(h)
    assert address != worker
    assert address.rsplit(":", 1)[0] == worker.rsplit(":", 1)[0]  # the worker's host
    port = int(address.rsplit(":", 1)[1])
    listening = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert port in listening, (port, listening)

    yr.get(count_relayed.invoke(True), T)
    try:
        assert yr.get([h.note.invoke(str(i)) for i in range(20)], T) == [str(i) for i in
                                                                          range(20)]
        assert len(yr.get(h.big.invoke(), T)) == BIG
        assert list(yr.get(r, T) for r in h.count.invoke(5)) == list(range(5))
    finally:
        relayed = yr.get(count_relayed.invoke(False), T)
    assert relayed == 0
    assert yr.get(h.pid.invoke(), T) == pid
    h.terminate()


def test_a_crash_with_calls_in_flight_redelivers_them_by_the_callers_rule(cluster, tmp_path):
    """Concurrency 1: the call that was running when the process died is charged and runs
    again (bound 1); the calls behind it had not started and run once, in order, on the
    restarted process.  A method whose own bound is 0 fails at its first crash
    (``CallCrashedError`` naming the exit), and the call behind it runs once."""
    cluster(kind="embedded", num_cpus=1)
    log = tmp_path / "log"
    h = Logged.options(small(light=False, recover_retry_times=3)).invoke(str(log))
    assert yr.get(h.note.invoke("up"), T) == "up"
    address = located(h)
    refs = [h.die_once.invoke(str(tmp_path / "marker"), "d"), h.note.invoke("a"),
            h.note.invoke("b")]
    assert yr.get(refs, T) == ["back", "a", "b"]
    assert log.read_text().split() == ["up", "d", "d", "a", "b"]
    assert h.status()["restarts"] == 1
    assert located(h) != address  # the restarted process serves elsewhere

    poison, after = h.die_always.invoke("x"), h.note.invoke("c")
    with pytest.raises(yr.CallCrashedError, match="exited with code 9"):
        yr.get(poison, T)
    assert yr.get(after, T) == "c"
    assert log.read_text().split() == ["up", "d", "d", "a", "b", "x", "c"]
    assert h.status()["restarts"] == 2
    h.terminate()


def test_the_answers_before_a_call_that_ends_the_process_reach_their_caller(cluster,
                                                                            tmp_path):
    """Calls sent back to back, the last of which ends the process: the method thread
    hands each answer to the process's loop and starts its next call only once that answer
    is written, so the calls before the exit are answered (once, not charged a crash and
    run again) and only the exiting call fails."""
    cluster(kind="embedded", num_cpus=1)
    log = tmp_path / "log"
    h = Logged.options(small(light=False, recover_retry_times=1)).invoke(str(log))
    assert yr.get(h.note.invoke("up"), T) == "up"
    tags = [f"n{i}" for i in range(8)]
    refs = [h.note.invoke(tag) for tag in tags]
    poison = h.die_always.invoke("x")
    assert yr.get(refs, T) == tags
    with pytest.raises(yr.CallCrashedError, match="exited with code 9"):
        yr.get(poison, T)
    assert log.read_text().split() == ["up", *tags, "x"]
    h.terminate()


def test_concurrent_calls_of_a_process_instance_are_each_answered_once(cluster):
    """Four calls at a time: answers that several method threads hand over together go out
    together, each on its caller's channel, to its own call; a generator's items and its
    end arrive in order among them."""
    cluster(kind="embedded", num_cpus=1)
    h = Wide.options(small(light=False, concurrency=4)).invoke()
    refs = [h.echo.invoke(i) for i in range(64)]
    items = h.count.invoke(5)
    assert yr.get(refs, T) == list(range(64))
    assert [yr.get(r, T) for r in items] == list(range(5))
    assert yr.get(h.widest.invoke(), T) > 1  # the calls did overlap
    h.terminate()

