"""``yr.get`` of many pending refs waits for them from the last one back
(``Runtime._wait_all``): a burst's results arrive about in order, so the waiting thread
sleeps once until the last is ready instead of catching up with the loop every few results
(a wake-up and a GIL hand-over each time).  Out-of-order results, timeouts and
``allow_partial`` behave as before; borrowed refs are all asked for before the wait.  A
real loop thread settles the entries; no cluster."""

from __future__ import annotations

import asyncio
import threading

import pytest

from yrdask.errors import YRTimeoutError
from yrdask.runtime import object_access as R
from yrdask.runtime.objects import Entry

pytestmark = pytest.mark.timeout(30)


class Ref:
    def __init__(self, i: int) -> None:
        self._id = f"o{i}"
        self._entry = Entry()


class LoopRuntime:
    """The parts of :class:`ObjectAccess` its ``get`` uses, over a real loop thread."""

    get = R.ObjectAccess.get
    _wait_all = R.ObjectAccess._wait_all
    _value_of = R.ObjectAccess._value_of

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.agent = None
        self.fetched: list[str] = []
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop_thread = threading.get_ident()
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    def _ensure_fetch(self, ref) -> None:
        if ref._id not in self.fetched:
            self.fetched.append(ref._id)

    def _lend(self, lease_id, blocked) -> bool:
        return False

    def settle_later(self, refs, gap_s: float = 0.002) -> None:
        """Settle ``refs`` one by one on the loop, in this order, ``gap_s`` apart."""
        for i, ref in enumerate(refs):
            self.loop.call_soon_threadsafe(
                self.loop.call_later, gap_s * (i + 1), ref._entry.set_value, int(ref._id[1:]))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def rt():
    rt = LoopRuntime()
    yield rt
    rt.close()


def waited(refs) -> list[str]:
    """The refs the thread slept on (an entry gets its event only when a thread waits)."""
    return [ref._id for ref in refs if ref._entry.event is not None]


def test_get_of_many_refs_in_order_sleeps_once(rt):
    refs = [Ref(i) for i in range(20)]
    refs[0]._entry.set_value(0)  # the first is ready: the wait starts at the second
    rt.settle_later(refs[1:], gap_s=0.005)
    assert rt.get(refs, 10) == list(range(20))
    assert waited(refs) == ["o19"]  # only the last one was waited for
    assert rt.fetched == [f"o{i}" for i in range(1, 20)]  # every pending one asked first


def test_get_of_refs_out_of_order_still_gets_every_value(rt):
    refs = [Ref(i) for i in range(12)]
    rt.settle_later(refs[6:] + refs[:6], gap_s=0.005)  # the last ones first
    assert rt.get(refs, 10) == list(range(12))
    # it slept on the last; then maybe on o5 (unless o0..o5 were in by the time it looked)
    assert waited(refs) in (["o11"], ["o5", "o11"])


def test_get_of_few_pending_refs_waits_front_to_back(rt):
    refs = [Ref(i) for i in range(R.GATHER_MIN_PENDING - 1)]
    rt.settle_later(refs, gap_s=0.005)
    assert rt.get(refs, 10) == list(range(len(refs)))
    assert waited(refs)[0] == "o0"  # front to back: it slept on the first


def test_get_timeout_still_raises_naming_the_first_missing_ref(rt):
    refs = [Ref(i) for i in range(8)]
    rt.settle_later([refs[0], refs[1], refs[2], refs[7]])  # 3..6 never become ready
    with pytest.raises(YRTimeoutError, match="failed to get object o3 within 0.2 s"):
        rt.get(refs, 0.2)


def test_get_allow_partial_returns_what_is_ready(rt):
    refs = [Ref(i) for i in range(6)]
    rt.settle_later(refs[:2])
    assert rt.get(refs, 0.2, allow_partial=True) == [0, 1, None, None, None, None]
