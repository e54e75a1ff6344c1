"""Streaming generators: the owner's side of a generator call, and the worker's producer loop.

A ``@yr.invoke`` generator function or a generator method is submitted with ``nret``
:data:`~yrdask.protocol.STREAMING`.  The worker runs it and sends each yielded value back at
once as a :class:`~yrdask.protocol.GeneratorItem` (stored like a task result: small values
inline, large ones kept on the worker), then the call's ordinary ``TaskDone``, whose single
result (the item count) or error settles the call's *end entry*.  The owner turns items
into ``ObjectRef`` s (ids ``<call id>.<index>``) that ``ObjectRefGenerator`` hands out in
order.

Rules (the pure :class:`StreamState`, unit-tested in ``tests/unit/test_generators.py``):

* items are handed out by index, each exactly once; an item whose index was already received
  is dropped.  That is what makes a rerun safe: a task rerun after its worker died, or after
  a user exception with ``retry_times``, yields its first items again and only the new ones
  reach the consumer (Ray's rule for streaming generators);
* the end carries the item count, or an error; after an error the consumer gets one more
  ref, which raises it, then the end;
* a consumer that drops its generator (``abandon``) makes later items be dropped at once.

Threads: items and the end arrive on the runtime's loop thread; consumers take from any
thread or event loop.  The stream's lock may be held while the object table's ``REFS_LOCK``
is taken (a kept item's ref is made under it), never the reverse: nothing takes the stream's
lock under ``REFS_LOCK`` (a generator the garbage collector drops only queues its abandon on
the loop).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

from yrdask import protocol as P
from yrdask.errors import YRError, YRInvokeError, YRRuntimeError, YRTimeoutError
from yrdask.runtime.context import current_lease
from yrdask.runtime.objects import Entry, ObjectRef
from yrdask.statemachine import Event, Instruction, Story

# --- the pure machine -----------------------------------------------------------------------


@dataclass(frozen=True)
class ItemArrived(Event):
    """A ``GeneratorItem`` for this stream (``location``: the worker keeping a large one)."""

    index: int
    location: str | None = None


@dataclass(frozen=True)
class Ended(Event):
    """The call's end entry settled: ``count`` items (``None`` if unknown), or ``failed``."""

    count: int | None
    failed: bool = False


@dataclass(frozen=True)
class Take(Event):
    """A consumer asks for the next ref."""


@dataclass(frozen=True)
class Abandoned(Event):
    """The consumer dropped its generator: nothing more will be taken."""


@dataclass(frozen=True)
class KeepItem(Instruction):
    """Make the ref of item ``index`` and hold it for the consumer."""

    index: int


@dataclass(frozen=True)
class DropItem(Instruction):
    """Item ``index`` is a duplicate (a rerun's) or nobody will take it: forget it, and free
    the copy ``location`` keeps unless a live ref of this process reads that copy."""

    index: int
    location: str | None


@dataclass(frozen=True)
class HandOut(Instruction):
    """Give the consumer the held ref of item ``index``."""

    index: int


@dataclass(frozen=True)
class HandOutError(Instruction):
    """Give the consumer a ref at ``index`` that raises the stream's error."""

    index: int


@dataclass(frozen=True)
class Stop(Instruction):
    """The stream is over: ``StopIteration``."""


@dataclass(frozen=True)
class Wait(Instruction):
    """The next item has not arrived yet: wait for an item or the end."""


class StreamState:
    """Which item the consumer gets next, and which arrivals to keep (module docstring)."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.taken = 0  # refs handed out (items, and the error ref)
        self.held: set[int] = set()  # received, not taken yet
        self.received = 0  # items 0 .. received-1 arrived (in order)
        self.ended = False
        self.count: int | None = None
        self.failed = False
        self.error_taken = False
        self.abandoned = False
        self.log = Story(1000)

    def handle(self, event: Event) -> list[Instruction]:
        kind = type(event)
        sid = event.stimulus_id
        out: list[Instruction]
        if kind is ItemArrived:
            i = event.index
            if i < self.received or self.abandoned or self.ended:
                out = [DropItem(sid, i, event.location)]
            else:  # in order on one channel; a gap would be a protocol error, kept anyway
                self.received = i + 1
                self.held.add(i)
                out = [KeepItem(sid, i)]
        elif kind is Ended:
            if self.ended:
                out = []
            else:
                self.ended, self.count, self.failed = True, event.count, event.failed
                out = []
        elif kind is Take:
            out = [self._take(sid)]
        elif kind is Abandoned:
            self.abandoned = True
            out = [DropItem(sid, i, None) for i in sorted(self.held)]
            self.held.clear()
        else:
            raise TypeError(f"StreamState cannot handle {event!r}")
        self.log.log(sid, event, (self.stream_id,))
        for ins in out:
            self.log.log(sid, ins, (self.stream_id,))
        return out

    def _take(self, sid: str) -> Instruction:
        if self.abandoned or self.error_taken:
            return Stop(sid)
        i = self.taken
        if i in self.held:
            self.held.discard(i)
            self.taken += 1
            return HandOut(sid, i)
        if not self.ended:
            return Wait(sid)
        if self.failed:
            self.error_taken = True
            self.taken += 1
            return HandOutError(sid, i)
        return Stop(sid)

    def expects(self, index: int) -> bool:
        """Whether item ``index`` would be kept if it arrived now (not received yet, and the
        stream neither over nor abandoned)."""
        return index >= self.received and not self.abandoned and not self.ended

    @property
    def next_ready(self) -> bool:
        """A ``Take`` now would not wait: the next item is here, or the stream is over (Ray's
        readiness of a generator in ``ray.wait``)."""
        return (self.abandoned or self.error_taken or self.taken in self.held
                or self.ended)

    @property
    def finished(self) -> bool:
        """Nothing more will be handed out."""
        return self.abandoned or self.error_taken or (
            self.ended and not self.failed and self.taken >= self.received)

    def validate(self) -> None:
        assert all(self.taken <= i < self.received for i in self.held), (self.held, self.taken)
        assert self.taken <= self.received + self.error_taken
        assert not self.error_taken or self.failed
        assert not (self.abandoned and self.held)

    def story(self, *keys: str) -> str:
        return self.log.dump(*keys)


# --- the owner's adapter ----------------------------------------------------------------------


class Stream:
    """The owner's stream of one generator call: what ``ObjectRefGenerator`` reads.

    Built by the runtime when it submits the call (before the call can answer), registered
    in ``runtime.streams`` until its end entry settles.  ``end_ref`` is the call's own ref:
    its value is the item count, its error the stream's error.
    """

    def __init__(self, runtime: Any, call_id: str, end_ref: ObjectRef, what: str) -> None:
        self.rt = runtime
        self.call_id = call_id
        self.end_ref = end_ref
        self.what = what  # "function f" / "method C.m", for messages
        self.state = StreamState(call_id)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.refs: dict[int, ObjectRef] = {}  # held items, by index
        self.early: set[int] = set()  # items polled for (lent via them) before they came
        self.error: Any = None
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.ready_callbacks: list[Callable[[], None]] = []  # loop thread, see on_next_ready
        runtime.streams[call_id] = self
        runtime.on_loop(end_ref._entry.add_callback, self._on_end)

    # -- loop thread -------------------------------------------------------------------------

    def on_item(self, index: int, result: list, refs: list | None = None) -> None:
        """A ``GeneratorItem`` (loop thread).  ``refs``: those its producer lent to this
        process via the item; the item's value holds them while the item lives."""
        kind, payload = result
        location = payload if kind == P.LOCATION else None
        oid = f"{self.call_id}.{index}"
        with self.lock:
            ins = self.state.handle(ItemArrived(f"item-{index}", index, location))[0]
            early = index in self.early
            self.early.discard(index)
            if type(ins) is KeepItem:  # held before a consumer can be told it is there
                entry = Entry()
                entry.set_result(kind, payload)
                self.refs[index] = self.rt.objects.new_ref(oid, entry)
                if refs:
                    self.rt.objects.contains(oid, refs)
                if location is not None:  # its lineage: this call (tasks)
                    self.rt.submitter.item_kept(self.call_id, oid)
                self._wake()
                return
        if not self.rt.submitter.rebuilt_item(self.call_id, oid, result):
            free_duplicate(self.rt, oid, location)
        if early:
            self.rt.objects.release_unreceived(oid)

    def expect(self, index: int) -> bool:
        """A poll (loop thread), or a lend from a generator in this very process (its
        thread), names item ``index``, not received yet, as the holder of refs lent to this
        process: whether the item will be kept when it comes."""
        with self.lock:
            if self.state.expects(index):
                self.early.add(index)
                return True
        return False

    def _on_end(self) -> None:
        entry = self.end_ref._entry
        self.rt.streams.pop(self.call_id, None)
        failed = entry.state == P.ERROR
        count = None
        if not failed:
            try:
                count = int(entry.get_value())
            except Exception:  # noqa: BLE001 - a count that cannot be read changes nothing
                count = None
        with self.lock:
            self.error = entry.error if failed else None
            self.state.handle(Ended("end", count, failed))
            self._wake()
            never, self.early = self.early, set()  # lent via items that never came
        for index in sorted(never):
            self.rt.objects.release_unreceived(f"{self.call_id}.{index}")

    def _abandon(self) -> None:
        with self.lock:
            self.state.handle(Abandoned("abandon"))
            refs, self.refs = self.refs, {}
            self._wake()
        refs.clear()  # the refs die here, outside the lock (their drop may free copies)

    def _wake(self) -> None:
        """Under the lock (loop thread): wake blocked and awaiting consumers, and those
        waiting for the next item to be ready."""
        self.cond.notify_all()
        waiters, self.waiters = self.waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)
        if self.ready_callbacks and self.state.next_ready:
            callbacks, self.ready_callbacks = self.ready_callbacks, []
            for cb in callbacks:
                cb()

    def on_next_ready(self, cb: Callable[[], None]) -> None:
        """Run ``cb`` (loop thread) once taking would not wait (:meth:`next_ready`), or now
        if it would not.  ``cb`` runs under the stream's lock: it must take no other."""
        with self.lock:
            if self.state.next_ready:
                cb()
            else:
                self.ready_callbacks.append(cb)

    def next_ready(self) -> bool:
        """Whether ``next()`` would return at once (the next item is here, or the end)."""
        with self.lock:
            return self.state.next_ready

    # -- consumers (any thread) --------------------------------------------------------------

    def _take(self) -> tuple[str, Any]:
        """Under the lock: ``("ref", ref)``, ``("error", index)``, ``("stop", None)`` or
        ``("wait", None)``."""
        ins = self.state.handle(Take("take"))[0]
        kind = type(ins)
        if kind is HandOut:
            return "ref", self.refs.pop(ins.index)
        if kind is HandOutError:
            return "error", ins.index
        if kind is Stop:
            return "stop", None
        return "wait", None

    def _ref_of(self, kind: str, value: Any) -> ObjectRef | None:
        """Outside the lock: the ref to hand out (``None`` at the end)."""
        if kind == "ref":
            return value
        if kind == "error":
            entry = Entry()
            entry.set_error(self.error)  # unseen by other threads until returned
            return self.rt.objects.new_ref(f"{self.call_id}.{value}", entry)
        return None

    def next(self, timeout: float | None = None) -> ObjectRef | None:
        """The next ref, waiting for it; ``None`` once the stream is over."""
        with self.lock:
            kind, value = self._take()
        if kind == "wait":
            kind, value = self._wait(timeout)
        return self._ref_of(kind, value)

    def _wait(self, timeout: float | None) -> tuple[str, Any]:
        if threading.get_ident() == self.rt.loop_thread:
            raise YRRuntimeError(f"next() on the generator of {self.what} would block the yr "
                                 "event loop; use 'async for ref in gen' in async code")
        deadline = None if timeout is None else time.monotonic() + timeout
        lease_id = current_lease()
        blocked = False
        try:
            if lease_id is not None:  # a task waiting here lends its CPU, as in yr.get
                blocked = True
                self.rt.connector.notify_blocked(lease_id, True)
            with self.lock:
                while True:
                    kind, value = self._take()
                    if kind != "wait":
                        return kind, value
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise YRTimeoutError(
                            f"the generator of {self.what} ({self.call_id}) yielded no item "
                            f"within {timeout} s (raise the timeout, or wait without one)")
                    self.cond.wait(left)
        finally:
            if blocked:
                self.rt.connector.notify_blocked(lease_id, False)

    async def anext(self) -> ObjectRef | None:
        """Like :meth:`next`, for a coroutine: waits without blocking its event loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self.lock:
                kind, value = self._take()
                if kind == "wait":
                    fut = loop.create_future()
                    self.waiters.append((loop, fut))
            if kind != "wait":
                return self._ref_of(kind, value)
            await fut

    def finished(self) -> bool:
        with self.lock:
            return self.state.finished

    def abandon(self) -> None:
        """The consumer's generator is gone (any thread, even inside the garbage collector)."""
        if not self.rt.closed:
            self.rt.on_loop(self._abandon)

    def cancel(self) -> None:
        self.rt.cancel([self.end_ref])

    def story(self) -> str:
        with self.lock:
            return self.state.story()


def ref_of_items(gen: Any, wrap: Callable[[list], Any]) -> ObjectRef:
    """A ref this process owns to ``wrap(refs)``: once the generator call ``gen`` reads
    (an ``ObjectRefGenerator``) is over, ``refs`` are all its item refs, then the ref that
    raises its error if the generator raised (Ray's ``num_returns="dynamic"``).  A failure
    of the call itself (a crash, a failed argument, a cancel) fails the ref instead.  The
    items stay the stream's: owned here, rebuilt by running the call again if their worker
    is lost.  The ref's id is the call's (``<call id>.dynamic``), so cancelling it cancels
    the call, as cancelling a task's result does."""
    stream = gen._stream
    rt = stream.rt
    ref = rt.objects.new_ref(f"{stream.call_id}.dynamic")
    entry, object_id = ref._entry, ref._id

    def over() -> None:  # (loop) after the stream's own end: nothing is left to wait for
        error = stream.error
        if isinstance(error, YRError) and not isinstance(error, YRInvokeError):
            entry.set_error(error)
            return
        refs = []
        while (item := stream.next()) is not None:
            refs.append(item)
        rt.settle_value(object_id, entry, wrap(refs))
        gen.task_id  # noqa: B018 - held until now (its drop abandons the stream's items)

    rt.on_loop(stream.end_ref._entry.add_callback, over)
    return ref


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def free_duplicate(rt: Any, object_id: str, location: str | None) -> None:
    """Free a dropped item's copy on ``location``, unless a live ref here reads that very copy
    (a rerun on the same worker stored it again under the same id)."""
    if location is None:
        return
    entry = rt.objects.entries.get(object_id)
    if entry is not None and entry.location == location:
        return
    rt.free_remote(location, [object_id])


def on_generator_item(rt: Any, msg: dict) -> None:
    """A ``GeneratorItem`` from a call channel (loop thread)."""
    stream = rt.streams.get(msg["task_id"])
    if stream is not None:
        stream.on_item(msg["index"], msg["result"], msg.get("refs"))
        return
    kind, payload = msg["result"]
    oid = f"{msg['task_id']}.{msg['index']}"
    if rt.submitter.rebuilt_item(msg["task_id"], oid, msg["result"]):
        return  # its stream is over, and the item was lost with its worker: a rerun's copy
    if kind == P.LOCATION:  # its stream is over: nobody will read it
        free_duplicate(rt, oid, payload)


# --- the producer side (worker) ---------------------------------------------------------------


def item_sender(pack_results: Callable[..., tuple], runtime: Any, peer: Any,
                task_id: str) -> Callable[[int, Any], None]:
    """``emit(index, value)`` for a generator call, in a worker or an isolated process: each
    value stored like a result (``pack_results(id, value, 1, caller)``) and sent at once as a
    ``GeneratorItem`` on ``peer``.  Refs nested in an item are lent to the caller (``peer``'s
    ``caller``) via the item, as a result's are: their owners free them once the caller drops
    the item and the refs it read out of it (``GeneratorItem.refs``; no caller known: pinned).
    A caller in this very process (``runtime``'s, a call it made to itself): the lend is
    told here, before the item exists, and the item holds them from the lend on as its
    stream will still keep it (:meth:`ObjectTable.lend`), so the message carries none."""
    caller = getattr(peer, "caller", None) or None

    def emit(index: int, value: Any) -> None:
        results, nested = pack_results(f"{task_id}.{index}", value, 1, caller)
        refs = nested[0][1] if nested and caller != runtime.address else None
        peer.reply(P.GeneratorItem(task_id, index, results[0], refs).to_msg())
    return emit


def drain(gen: Iterator, emit: Callable[[int, Any], None],
          guard: Any = None) -> int:
    """Run a generator to its end, ``emit(index, value)`` for each value; returns the count.

    ``guard`` (the task's cancel record) shields each emit: a cancel arriving while an item
    is stored and sent is raised after it, never inside yr's bookkeeping.
    """
    n = 0
    for value in gen:
        if guard is None:
            emit(n, value)
        else:
            guard.shield()
            try:
                emit(n, value)
            finally:
                guard.unshield()
        n += 1
    return n


async def drain_async(agen: AsyncIterator, emit: Callable[[int, Any], None]) -> int:
    """:func:`drain` for an async generator (on the instance's event loop)."""
    n = 0
    async for value in agen:
        emit(n, value)
        n += 1
    return n
