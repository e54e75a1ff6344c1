"""``yr.get`` of many pending refs waits once for all of them (``AllReady``), not entry by
entry: the waiting thread is woken when the last one is ready (a burst's gather no longer
hands the GIL to the caller every few results), timeouts and ``allow_partial`` behave as
before, and a timed-out wait leaves no callbacks on the entries.  A real loop thread
settles the entries; no cluster."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from yrdask.errors import YRTimeoutError
from yrdask.runtime import runtime as R
from yrdask.runtime.objects import AllReady, Entry

pytestmark = pytest.mark.timeout(30)


class Ref:
    def __init__(self, i: int) -> None:
        self._id = f"o{i}"
        self._entry = Entry()


class LoopRuntime:
    """The parts of :class:`Runtime` its ``get`` uses, over a real loop thread."""

    get = R.Runtime.get
    _wait_all = R.Runtime._wait_all
    _value_of = R.Runtime._value_of

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.agent = None
        self.armed: list = []
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop_thread = threading.get_ident()
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    def on_loop(self, fn, *args) -> None:
        self.armed.append(getattr(fn, "__name__", fn))
        self.loop.call_soon_threadsafe(fn, *args)

    def _ensure_fetch(self, ref) -> None:
        pass

    def _lend(self, lease_id, blocked) -> bool:
        return False

    def settle_later(self, refs, gap_s: float = 0.002) -> None:
        """Settle ``refs`` one by one on the loop, ``gap_s`` apart."""
        for i, ref in enumerate(refs):
            self.loop.call_soon_threadsafe(
                self.loop.call_later, gap_s * (i + 1), ref._entry.set_value, i)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def rt():
    rt = LoopRuntime()
    yield rt
    rt.close()


def test_all_ready_sets_its_event_once_the_last_entry_is_ready():
    entries = [Entry() for _ in range(3)]
    entries[0].set_value("ready before")
    waiter = AllReady(len(entries))
    waiter.arm(entries)
    entries[1].set_value(1)
    assert not waiter.event.is_set()
    entries[2].set_error(ValueError("failed"))  # an error is ready too
    assert waiter.event.is_set()


def test_all_ready_disarm_leaves_no_callback_on_pending_entries():
    entries = [Entry() for _ in range(3)]
    other = []
    entries[0].add_callback(lambda: other.append(1))  # someone else's callback stays
    waiter = AllReady(len(entries))
    waiter.arm(entries)
    waiter.disarm(entries)
    assert [len(e.callbacks or ()) for e in entries] == [1, 0, 0]
    entries[0].set_value(0)
    assert other == [1] and not waiter.event.is_set()


def test_get_of_many_pending_refs_waits_once_for_all(rt):
    refs = [Ref(i) for i in range(20)]
    refs[0]._entry.set_value(0)  # the first is ready: the wait starts at the second
    rt.settle_later(refs[1:])
    t0 = time.monotonic()
    values = rt.get(refs, 10)
    assert values == [0] + list(range(19))
    assert rt.armed == ["arm"]  # one AllReady for the 19 pending refs
    # the thread never waited on an entry of its own: no per-entry event was made
    assert all(ref._entry.event is None for ref in refs)
    assert time.monotonic() - t0 < 10


def test_get_of_few_pending_refs_waits_entry_by_entry(rt):
    refs = [Ref(i) for i in range(R.GATHER_MIN_PENDING - 1)]
    rt.settle_later(refs)
    assert rt.get(refs, 10) == list(range(len(refs)))
    assert rt.armed == []


def test_get_timeout_still_raises_and_disarms(rt):
    refs = [Ref(i) for i in range(8)]
    rt.settle_later(refs[:3])  # the rest never become ready
    with pytest.raises(YRTimeoutError, match="within 0.2 s"):
        rt.get(refs, 0.2)
    assert rt.armed == ["arm", "disarm"]
    done = threading.Event()
    rt.loop.call_soon_threadsafe(done.set)  # the disarm ran before this
    assert done.wait(5)
    assert [len(ref._entry.callbacks or ()) for ref in refs[3:]] == [0] * 5


def test_get_allow_partial_returns_what_is_ready(rt):
    refs = [Ref(i) for i in range(6)]
    rt.settle_later(refs[:2])
    values = rt.get(refs, 0.2, allow_partial=True)
    assert values == [0, 1, None, None, None, None]
    assert rt.armed == ["arm", "disarm"]  # one gather for the whole call, not one per ref
