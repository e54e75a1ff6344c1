"""The owner's stream machine of a generator call (yrdask/runtime/generators.py), no I/O."""

from __future__ import annotations

import asyncio
import pytest

from yrdask.runtime import generators as G
from yrdask.runtime.generators import (Abandoned, DropItem, Ended, HandOut, HandOutError,
                                       ItemArrived, KeepItem, Stop, StreamState, Take, Wait,
                                       drain, drain_async)
from .harness import MachineHarness

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def h() -> MachineHarness:
    return MachineHarness(StreamState("t1"))


def kinds(out: list) -> list[type]:
    return [type(i) for i in out]


def test_items_are_handed_out_in_order_then_stop(h):
    assert kinds(h(Take)) == [Wait]  # nothing yet: the consumer waits
    assert h(ItemArrived, 0) == [KeepItem("s2", 0)]
    assert h(ItemArrived, 1, "tcp://w:1") == [KeepItem("s3", 1)]
    assert h(Take) == [HandOut("s4", 0)]
    assert h(Ended, 2) == []
    assert not h.m.finished
    assert h(Take) == [HandOut("s6", 1)]
    assert h.m.finished
    assert kinds(h(Take)) == [Stop]
    assert kinds(h(Take)) == [Stop]


def test_a_rerun_repeats_items_that_are_dropped(h):
    h(ItemArrived, 0)
    h(ItemArrived, 1, "tcp://w:1")
    h(Take)
    # the worker died; the rerun yields 0 and 1 again, then 2
    assert h(ItemArrived, 0) == [DropItem("s4", 0, None)]
    assert h(ItemArrived, 1, "tcp://w:2") == [DropItem("s5", 1, "tcp://w:2")]
    assert h(ItemArrived, 2) == [KeepItem("s6", 2)]
    h(Ended, 3)
    assert [type(i) for i in h(Take)] == [HandOut]
    assert h(Take) == [HandOut("s9", 2)]
    assert kinds(h(Take)) == [Stop]


def test_an_error_becomes_the_ref_after_the_last_item(h):
    h(ItemArrived, 0)
    h(Ended, None, True)
    assert h(Take) == [HandOut("s3", 0)]
    assert not h.m.finished
    assert h(Take) == [HandOutError("s4", 1)]
    assert h.m.finished
    assert kinds(h(Take)) == [Stop]


def test_an_error_before_any_item_is_the_first_ref(h):
    h(Ended, None, True)
    assert h(Take) == [HandOutError("s2", 0)]
    assert kinds(h(Take)) == [Stop]


def test_items_after_the_end_are_dropped_and_a_second_end_is_ignored(h):
    h(Ended, 0)
    assert kinds(h(ItemArrived, 0)) == [DropItem]
    assert h(Ended, None, True) == []
    assert not h.m.failed
    assert kinds(h(Take)) == [Stop]


def test_abandoning_drops_held_and_later_items(h):
    h(ItemArrived, 0)
    h(ItemArrived, 1)
    assert h(Abandoned) == [DropItem("s3", 0, None), DropItem("s3", 1, None)]
    assert kinds(h(ItemArrived, 2, "tcp://w:1")) == [DropItem]
    assert kinds(h(Take)) == [Stop]
    assert h.m.finished


def test_next_ready_says_whether_a_take_would_wait(h):
    assert not h.m.next_ready
    h(ItemArrived, 0)
    assert h.m.next_ready  # item 0 is held
    h(Take)
    assert not h.m.next_ready  # item 1 has not come
    h(Ended, 1)
    assert h.m.next_ready  # over: the next take stops at once
    assert kinds(h(Take)) == [Stop]


def test_next_ready_after_an_error_and_after_abandoning():
    failed = MachineHarness(StreamState("t2"))
    failed(Ended, None, True)
    assert failed.m.next_ready  # the error ref is ready to hand out
    gone = MachineHarness(StreamState("t3"))
    gone(Abandoned)
    assert gone.m.next_ready


def test_the_story_names_the_stream(h):
    h(ItemArrived, 0)
    assert "KeepItem index=0" in h.m.story("t1")


def test_unknown_events_are_refused(h):
    with pytest.raises(TypeError, match="cannot handle"):
        h.m.handle(G.KeepItem("x", 0))


# -- the producer loops ---------------------------------------------------------------------


class _Guard:
    """Records shield/unshield like an Execution record."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def shield(self) -> None:
        self.calls.append("shield")

    def unshield(self) -> None:
        self.calls.append("unshield")


def test_drain_emits_each_item_with_its_index_under_the_guard():
    out, guard = [], _Guard()
    assert drain(iter("abc"), lambda i, v: out.append((i, v)), guard) == 3
    assert out == [(0, "a"), (1, "b"), (2, "c")]
    assert guard.calls == ["shield", "unshield"] * 3


def test_drain_lets_the_generator_error_through_after_the_items_before_it():
    def gen():
        yield 1
        raise KeyError("k")

    out = []
    with pytest.raises(KeyError):
        drain(gen(), lambda i, v: out.append(v))
    assert out == [1]


class _ItemPeer:
    """A call's peer: who made the call, and the replies sent to it."""

    def __init__(self, caller: str | None) -> None:
        if caller is not None:
            self.caller = caller
        self.sent: list = []

    def reply(self, msg: dict) -> None:
        self.sent.append(msg)


class _Producer:
    address = "tcp://me:1"


@pytest.mark.parametrize("caller, lent_to, refs", [
    ("tcp://other:2", "tcp://other:2", [["r1", "tcp://me:1"]]),  # told in the item
    ("tcp://me:1", "tcp://me:1", None),  # lent here already: the item's stream counts it
    (None, None, None),  # no caller known (a peer without one): pack_results pins them
])
def test_item_sender_lends_an_items_refs_to_its_caller(caller, lent_to, refs):
    """Worker and isolated process share this rule: refs nested in an item are lent to the
    call's caller via the item; only another process is told of them in the message."""
    packed = []

    def pack_results(oid, value, nret, to):
        packed.append((oid, value, nret, to))
        nested = [[oid, [["r1", "tcp://me:1"]]]] if to is not None else None
        return [["value", b"v"]], nested

    peer = _ItemPeer(caller)
    emit = G.item_sender(pack_results, _Producer(), peer, "c1")
    emit(0, "x")
    emit(1, "y")
    assert packed == [("c1.0", "x", 1, lent_to), ("c1.1", "y", 1, lent_to)]
    assert [(m["index"], m["refs"]) for m in peer.sent] == [(0, refs), (1, refs)]
    assert {m["op"] for m in peer.sent} == {G.P.GENERATOR_ITEM}


def test_drain_async():
    async def agen():
        for i in range(3):
            await asyncio.sleep(0)
            yield i * 2

    out = []
    assert asyncio.run(drain_async(agen(), lambda i, v: out.append((i, v)))) == 3
    assert out == [(0, 0), (1, 2), (2, 4)]


# -- the owner adapter without a cluster: a fake runtime whose loop is the calling thread ----


class _Submitter:
    """The submitter's lineage calls: no call here runs again to rebuild lost items."""

    def item_kept(self, call_id, oid):
        pass

    def rebuilt_item(self, call_id, oid, result):
        return False


class _Runtime:
    """Just what :class:`Stream` touches: streams, on_loop, objects, free_remote, cancel,
    the submitter's lineage."""

    def __init__(self) -> None:
        from yrdask.runtime.object_table import ObjectTable

        self.streams: dict = {}
        self.objects = ObjectTable(self, 512 * 1024)
        self.loop_thread = -1
        self.closed = False
        self.address = "tcp://owner:1"
        self.freed: list = []
        self.cancelled: list = []
        self.submitter = _Submitter()

    def on_loop(self, fn, *args):
        fn(*args)

    def free_remote(self, worker, ids):
        self.freed.append((worker, list(ids)))

    def cancel(self, refs):
        self.cancelled.extend(r.id for r in refs)


def _stream():
    from yrdask.runtime.objects import Entry

    rt = _Runtime()
    end = rt.objects.new_ref("c1", Entry())
    return rt, end, G.Stream(rt, "c1", end, "function f")


def test_stream_adapter_hands_out_refs_and_frees_duplicate_copies():
    from yrdask import protocol as P
    from yrdask.serialization import dumps_value

    rt, end, stream = _stream()
    assert rt.streams == {"c1": stream}
    stream.on_item(0, [P.VALUE, dumps_value("a")])
    stream.on_item(1, [P.LOCATION, "tcp://w:1"])
    G.on_generator_item(rt, {"task_id": "c1", "index": 1, "result": [P.LOCATION, "tcp://w:2"]})
    assert rt.freed == [("tcp://w:2", ["c1.1"])]  # a rerun's copy elsewhere: freed
    stream.on_item(1, [P.LOCATION, "tcp://w:1"])
    assert len(rt.freed) == 1  # same copy the held ref reads: kept
    first = stream.next(1)
    assert first.id == "c1.0" and first._entry.get_value() == "a"
    end._entry.set_result(P.VALUE, dumps_value(2))
    assert rt.streams == {}
    second = stream.next(1)
    assert second.id == "c1.1" and second._entry.location == "tcp://w:1"
    assert stream.next(1) is None and stream.finished()


def test_stream_adapter_error_ref_and_async_waiter():
    from yrdask.errors import YRTimeoutError

    rt, end, stream = _stream()
    with pytest.raises(YRTimeoutError, match="yielded no item"):
        stream.next(0.01)

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(stream.anext())
        loop.run_until_complete(asyncio.sleep(0))  # the consumer runs until it waits
        assert not task.done() and len(stream.waiters) == 1
        end._entry.set_error(ValueError("broken"))  # the end wakes the waiting coroutine
        ref = loop.run_until_complete(asyncio.wait_for(task, 10))
    finally:
        loop.close()
    assert ref.id == "c1.0" and ref.is_exception()
    assert isinstance(ref._entry.exception(), ValueError)
    assert stream.next(1) is None


def test_stream_adapter_runs_next_ready_callbacks_once_an_item_or_the_end_comes():
    from yrdask import protocol as P
    from yrdask.serialization import dumps_value

    rt, end, stream = _stream()
    calls: list = []
    stream.on_next_ready(lambda: calls.append("first"))
    assert calls == [] and not stream.next_ready()
    stream.on_item(0, [P.VALUE, dumps_value("a")])
    assert calls == ["first"] and stream.next_ready()
    stream.on_next_ready(lambda: calls.append("now"))  # ready already: at once
    assert calls == ["first", "now"]
    stream.next(1)
    stream.on_next_ready(lambda: calls.append("end"))
    end._entry.set_result(P.VALUE, dumps_value(1))
    assert calls == ["first", "now", "end"] and stream.next_ready()
    assert stream.ready_callbacks == []


def test_stream_adapter_cancel_and_abandon():
    from yrdask import protocol as P

    rt, end, stream = _stream()
    stream.on_item(0, [P.LOCATION, "tcp://w:1"])
    stream.cancel()
    assert rt.cancelled == ["c1"]
    stream.abandon()
    assert stream.finished()
    assert rt.freed == [("tcp://w:1", ["c1.0"])]  # the held ref died: its copy is freed


def test_refs_lent_via_an_item_are_answered_once_the_item_and_the_refs_go():
    """An isolated producer lends the refs nested in an item via the item
    (``GeneratorItem.refs``); its poll travels on another connection and may come first."""
    import gc

    from yrdask import protocol as P
    from yrdask.runtime.objects import REFS_LOCK
    from yrdask.serialization import dumps_value

    rt, end, stream = _stream()
    sent: list = []
    rt.refs_message = lambda address, cls, item: sent.append((address, cls.op, item))
    child = "tcp://child:1"
    # the poll of r0 comes before item 0: the item is expected, so nothing is answered yet
    rt.objects.on_wait(child, [["r0", 1, "c1.0"]])
    assert sent == []
    stream.on_item(0, [P.VALUE, dumps_value("box0")], [["r0", child]])
    stream.on_item(1, [P.VALUE, dumps_value("box1")], [["r1", child]])
    rt.objects.on_wait(child, [["r1", 1, "c1.1"]])  # the usual order: after its item
    assert sent == []
    item0 = stream.next(1)
    del item0
    gc.collect()  # the consumer dropped item 0 (and never read r0): r0 is answered
    assert sent == [(child, P.REFS_REMOVED, ["r0", 1])]
    # a poll via an item the stream will never keep (dropped: the consumer abandoned it)
    rt.objects.on_wait(child, [["r2", 1, "c1.2"]])
    stream.abandon()  # item 1, held and never taken, goes too
    assert (child, P.REFS_REMOVED, ["r1", 1]) in sent
    stream.on_item(2, [P.VALUE, dumps_value("box2")], [["r2", child]])
    assert (child, P.REFS_REMOVED, ["r2", 1]) in sent
    end._entry.set_result(P.VALUE, dumps_value(3))
    with REFS_LOCK:
        rt.objects.counter.validate()
        assert rt.objects.counter.figures() == {"owned": 0, "borrowed": 0, "freed": 3}


def test_refs_lent_via_items_that_never_come_are_answered_when_the_stream_ends():
    """A poll named an item not received yet (so the stream expected it); the call ends
    without it (it yielded fewer, or failed first): what was lent via it is answered at the
    end, and a poll via an item after the end is answered at once."""
    from yrdask import protocol as P
    from yrdask.runtime.objects import REFS_LOCK
    from yrdask.serialization import dumps_value

    rt, end, stream = _stream()
    sent: list = []
    rt.refs_message = lambda address, cls, item: sent.append((address, cls.op, item))
    child = "tcp://child:1"
    stream.on_item(0, [P.VALUE, dumps_value("box0")])
    rt.objects.on_wait(child, [["r1", 1, "c1.1"]])  # item 1 is expected: nothing answered
    assert sent == [] and stream.early == {1}
    end._entry.set_result(P.VALUE, dumps_value(1))  # one item only: item 1 never comes
    assert sent == [(child, P.REFS_REMOVED, ["r1", 1])] and stream.early == set()
    rt.objects.on_wait(child, [["r2", 1, "c1.2"]])  # the stream is over: answered at once
    assert (child, P.REFS_REMOVED, ["r2", 1]) in sent
    with REFS_LOCK:
        rt.objects.counter.validate()


def test_a_rerun_generator_yields_only_the_items_not_sent_yet():
    from yrdask.ray._util import rerun_items

    runs: list = []

    def make():
        attempt = len(runs)
        runs.append(attempt)
        for i in range(4):
            if attempt < 2 and i == 2 - attempt:  # run 0 breaks after two items, run 1 after one
                raise KeyError(attempt)
            yield (attempt, i)

    tries: list = []

    def again(e, attempt):
        tries.append((type(e), attempt))
        return attempt < 2

    # items already sent are skipped by position: the third run gives only index 2 and 3
    assert list(rerun_items(make, again)) == [(0, 0), (0, 1), (2, 2), (2, 3)]
    assert runs == [0, 1, 2]
    assert tries == [(KeyError, 0), (KeyError, 1)]


def test_a_rerun_generator_raises_once_no_rerun_is_left():
    from yrdask.ray._util import rerun_items

    def make():
        yield 1
        raise ValueError("no")

    out: list = []
    with pytest.raises(ValueError, match="no"):
        for item in rerun_items(make, lambda e, attempt: attempt < 1):
            out.append(item)
    assert out == [1]  # the rerun's first item was sent already
