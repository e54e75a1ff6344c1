"""Object access of a process's runtime: ``put``, ``get``, ``wait``, fetching values from
their owners or the workers keeping them, and the reference counting messages it sends.

:class:`ObjectAccess` is one part of :class:`~yrdask.runtime.runtime.Runtime` (which mixes
it in): it works on the runtime's object table (``objects``), loop and connector, and never
on the submitter's or router's state.  User threads call ``put``/``get``/``wait``; the loop
answers ``FETCH_OBJECT`` (:meth:`ObjectAccess.handle_fetch`) and the reference counting ops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from yrdask import protocol as P
from yrdask.errors import (OwnerDiedError, RemoteError, YRRuntimeError, YRTimeoutError,
                           YRTypeError, YRValueError)
from yrdask.runtime import context as _rtctx
from yrdask.runtime.context import current_lease
from yrdask.runtime.objects import (PENDING, REFS_LOCK, Entry, ObjectRef, pack_counting,
                                    unpickling)
from yrdask.runtime.store import node_store
from yrdask.serialization import Frames, dumps, dumps_value, loads, unpicklable, wire

if TYPE_CHECKING:
    from yrdask.runtime.generators import Stream
    from yrdask.runtime.node import LocalNode
    from yrdask.runtime.object_table import ObjectTable

logger = logging.getLogger("yrdask")

OWNER_PROBE_S = 1.0  # one connect try to a borrowed object's owner; then ask the scheduler
OWNER_UNREACHABLE_S = 4.0  # an owner not reached for this long (still listed) is given up
# a get with at least this many refs from its first pending one on (counted whether ready or
# not: _wait_all skips the ready ones) waits for them from the last one back
GATHER_MIN_PENDING = 4
LOST_WAIT_S = 30.0  # how long a failed fetch waits to hear that its worker is gone


def owner_timeouts() -> tuple[float, float]:
    """``(probe, unreachable)`` seconds: ``yrdask.object-store.owner-probe`` (one connect try
    to an owner) and ``yrdask.object-store.owner-unreachable`` (how long a reader keeps trying
    an owner the scheduler still lists before it fails), docs/faults.md."""
    import dask
    from dask.utils import parse_timedelta

    def get(key: str, default: float) -> float:
        value = dask.config.get(f"yrdask.object-store.{key}", None)
        seconds = default if value is None else parse_timedelta(value, default="s")
        if seconds is None or seconds <= 0:
            raise YRValueError(f"yrdask.object-store.{key} must be a positive duration such "
                               f"as '1s', got {value!r}")
        return float(seconds)

    return get("owner-probe", OWNER_PROBE_S), get("owner-unreachable", OWNER_UNREACHABLE_S)


def block(wait: Callable[[float | None], bool], timeout: float | None) -> bool:
    """``wait(timeout)`` (an ``Event.wait``) of a user thread in ``get``/``wait``; in a
    task's thread the worker layer's :data:`~yrdask.runtime.context.wait_hook` runs it, so
    that a cancel of the task ends the wait (a thread blocked in C never sees the exception
    a cancel raises in it)."""
    hook = _rtctx.wait_hook
    return wait(timeout) if hook is None else hook(wait, timeout)


class ObjectAccess:
    """Values in and out of a process, and the messages that count references to them
    (part of :class:`~yrdask.runtime.runtime.Runtime`; the attributes below are its)."""

    loop: asyncio.AbstractEventLoop
    loop_thread: int | None
    address: str
    connector: Any
    agent: "LocalNode | None"
    objects: "ObjectTable"
    closed: bool
    lost_workers: dict[str, None]  # (PeerLiveness) workers the scheduler removed, recent
    _lost_waiters: dict[str, list[Callable[[], None]]]  # (PeerLiveness) woken on a loss
    _refs_out: dict[tuple, list]  # reference counting messages for this loop pass
    new_id: Callable[[], str]
    on_loop: Callable[..., None]
    on_loop_later: Callable[..., None]
    run_sync: Callable[..., Any]

    def refs_message(self, address: str, cls: type, item: Any) -> None:
        """Queue one item of a :class:`P.WaitRefsRemoved`, :class:`P.RefsRemoved` or pinning
        :class:`P.AddBorrower` for ``address`` (any thread, :data:`REFS_LOCK` held): one
        message per kind and address goes out per loop pass."""
        batch = self._refs_out.get((cls, address))
        if batch is None:
            batch = self._refs_out[(cls, address)] = []
            if len(self._refs_out) == 1:
                self.on_loop_later(self._flush_refs)
        batch.append(item)

    def _flush_refs(self) -> None:
        with REFS_LOCK:
            out, self._refs_out = self._refs_out, {}
        if self.closed:
            return
        for (cls, address), items in out.items():
            if cls is P.AddBorrower:  # answered: the tokens' holds end (AddAcked)
                msg: P.Message = P.AddBorrower([i[:3] for i in items])
            else:
                msg, items = cls(self.address, items), None
            self.loop.create_task(self._send_refs(address, msg, items))

    async def _send_refs(self, address: str, msg: P.Message, acked: list | None = None) -> None:
        try:
            await P.request(self.connector.rpc(address), msg)
        except (OSError, asyncio.TimeoutError):  # gone: its borrowings end with it
            if not self.closed:
                self.objects.process_died(address)
            return
        except Exception:
            logger.debug("cannot send %s to %s", msg.op, address, exc_info=True)
            return
        if acked:
            self.objects.added(acked)

    def add_borrower(self, owner: str, items: list) -> None:
        """Register ``[[object_id, borrower, via], ...]`` with ``owner`` and wait for the
        answer (a user thread); on the loop it is sent without waiting."""
        msg = P.AddBorrower(items)
        if threading.get_ident() == self.loop_thread:
            self.loop.create_task(self._send_refs(owner, msg))
            return
        async def send() -> None:
            if await self.owner_gone(owner) is None:
                await P.request(self.connector.rpc(owner), msg)

        try:
            self.run_sync(send())
        except Exception:  # the owner is gone: reading those refs says so
            pass

    def load_borrowed(self, payload: Any) -> Any:
        """Unpickle the value of an object this process borrows; refs nested in it register
        with their owners before the value is handed on (docs/objects.md)."""
        value, found = unpickling(loads, payload)
        if found:
            self.objects.register_reads(found)
        return value

    def wait_refs_removed(self, sender: str, items: list) -> None:
        """:class:`P.WaitRefsRemoved` (rpc handler of workers and the owner server)."""
        self.objects.on_wait(sender, items)

    def refs_removed(self, sender: str, items: list) -> None:
        """:class:`P.RefsRemoved`."""
        self.objects.on_removed(sender, items)

    def handle_add_borrower(self, items: list) -> list:
        """:class:`P.AddBorrower`."""
        return self.objects.add_borrower(list(items))

    def put(self, obj: Any) -> ObjectRef:
        """Store ``obj`` (pickled now, a snapshot) under a new ref this process owns.

        The entry is settled, value and pickle, before its ref exists (objects.py's rule).
        """
        if obj is None or (isinstance(obj, (bytes, bytearray, memoryview)) and len(obj) == 0):
            raise YRValueError("yr.put: value is None or has zero length")
        if isinstance(obj, ObjectRef):
            raise YRTypeError(
                "Calling 'put' on an ObjectRef is not allowed; to store a reference, "
                "put it inside a list: yr.put([ref])")
        if isinstance(obj, (bytes, bytearray, memoryview)):
            obj = bytes(obj)
        return self.put_value(obj, "yr.put")

    def put_value(self, obj: Any, what: str = "yr.put") -> ObjectRef:
        """``put`` without the argument checks (``ray.put`` takes None too): pickled now, a
        snapshot; a large value's one copy goes to the node's store."""
        try:
            payload, _refs, counted = pack_counting(dumps_value, obj)
        except Exception as e:
            raise unpicklable(obj, f"{what}: the value", e) from e
        object_id = self.new_id()
        entry = Entry()
        _keep_payload(object_id, entry, payload)
        entry.settle(P.VALUE)
        ref = self.objects.new_ref(object_id, entry)
        if counted:  # refs nested in the value live as long as it does
            self.objects.contains(object_id, list(counted.items()))
        return ref

    def settle_value(self, object_id: str, entry: Entry, obj: Any) -> None:
        """(loop) Settle ``entry``, a pending one of ours, with ``obj`` as ``put_value``
        stores a value (a value computed here after its ref was handed out)."""
        payload, _refs, counted = pack_counting(dumps_value, obj)
        _keep_payload(object_id, entry, payload)
        entry.settle(P.VALUE)
        if counted:  # refs nested in the value live as long as it does
            self.objects.contains(object_id, list(counted.items()))

    def get(self, refs: Sequence[ObjectRef], timeout: float, allow_partial: bool = False) -> list:
        deadline = None if timeout == -1 else time.monotonic() + timeout
        lease_id = current_lease()
        blocked = False
        gather = True  # many refs left from the first pending one: waited for from the back, once
        try:
            for at, ref in enumerate(refs):
                entry = ref._entry
                if entry.state is not PENDING:  # ready (the property, inline: once per ref)
                    continue
                if threading.get_ident() == self.loop_thread:
                    raise YRRuntimeError(
                        "yr.get would block the yr event loop; use 'await ref' in async code")
                self._ensure_fetch(ref)
                if not blocked and (lease_id is not None or self.agent is not None):
                    blocked = self._lend(lease_id, True)
                if gather and at + GATHER_MIN_PENDING <= len(refs):  # few wake-ups for all
                    gather = False
                    self._wait_all(refs[at:], deadline)
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                hook = _rtctx.wait_hook  # block()'s, inline: no extra call on the hot path
                ready = entry.wait(remaining) if hook is None else hook(entry.wait, remaining)
                if not ready and not allow_partial:
                    raise YRTimeoutError(
                        f"failed to get object {ref._id} within {timeout} s: it is not ready "
                        "(raise the timeout, or use timeout=-1 to wait forever)")
        finally:
            if blocked:
                self._lend(lease_id, False)
        return [self._value_of(ref) for ref in refs]

    def _wait_all(self, refs: Sequence[ObjectRef], deadline: float | None) -> None:
        """Wait (bounded by ``deadline``) for the pending refs of ``refs`` from the last one
        back; the caller's loop then checks each ref as before.

        Results of a burst arrive about in submission order: waiting front to back, the
        thread caught up with them every few results, made an event, slept and was woken
        (a wake-up and a GIL hand-over per few results, paid by the loop too).  From the
        back it sleeps until the last is ready and then finds nearly all the others ready.
        Borrowed refs are all asked for first, so their owners answer in parallel."""
        pending = [r for r in refs if not r._entry.ready]
        for ref in pending:
            self._ensure_fetch(ref)
        for ref in reversed(pending):
            entry = ref._entry
            if entry.state is not PENDING:  # came while it waited for a later one: no wait
                continue  # (nor the cancel hook's shield, per ref of a burst)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not block(entry.wait, remaining):
                return  # timed out: the caller's loop says which ref

    def _lend(self, lease_id: str | None, blocked: bool) -> bool:
        """A thread waits in ``yr.get``/``yr.wait`` (or runs again): a task's lease lends its
        CPU; a thread with no lease in a worker (a Dask task) lends its share of the worker."""
        if lease_id is not None:
            self.connector.notify_blocked(lease_id, blocked)
            return True
        if self.agent is not None:
            self.agent.lend_slot("", blocked)
            return True
        return False

    def _value_of(self, ref: ObjectRef) -> Any:
        entry = ref._entry
        state = entry.state
        if state == P.VALUE:
            value = entry.get_value() if entry.owner is None else entry.get_value(self.load_borrowed)
        elif state == P.LOCATION:
            location = entry.location
            try:
                value = self._fetch_value(ref._id, entry)
            except YRRuntimeError:
                if not self._lost_meanwhile(entry, location):
                    raise
                return self.get([ref], -1)[0]  # computed again, or failed for good
        elif state == P.ERROR:
            raise entry.exception()
        else:  # allow_partial and not ready
            return None
        if isinstance(value, (bytes, bytearray)):
            return memoryview(value)
        return value

    def _lost_meanwhile(self, entry: Entry, location: str | None) -> bool:
        """A fetch from ``location`` failed: wait (bounded) to hear whether that worker is
        gone, and say whether the entry was handled since (reconstruction, docs/objects.md)."""
        if location is None or self.closed:
            return False

        async def heard() -> None:
            if location in self.lost_workers:
                return
            fut = self.loop.create_future()
            self._lost_waiters.setdefault(location, []).append(
                lambda: fut.done() or fut.set_result(None))
            await asyncio.wait_for(fut, LOST_WAIT_S)

        try:
            self.run_sync(heard())
        except Exception:
            return False
        return not (entry.state == P.LOCATION and entry.location == location)

    def _fetch_value(self, object_id: str, entry: Entry) -> Any:
        """The value of an entry a worker keeps: fetched once, cached (any thread)."""
        if entry.has_value:
            return entry.value
        payload = self.fetch_payload(object_id, entry.location)
        value = loads(payload) if entry.owner is None else self.load_borrowed(payload)
        return entry.cache_value(value)

    def fetch_payload(self, object_id: str, address: str) -> bytes:
        """Pickled value of an object, asking ``address`` (its owner, or the worker keeping it)
        and following the owner's answer to the worker that keeps it.  Not on the loop."""
        store = node_store()
        local = store.get(object_id)
        if local is not None:  # on this node already: mapped, not copied
            return local
        return store.pull(object_id, lambda: self._pull(object_id, address))

    def _pull(self, object_id: str, address: str) -> Any:
        """The payload of an object from another process (following the owner's redirect
        to the worker that keeps it); peer to peer, never through the scheduler."""
        while True:
            if self.agent is not None and address == self.address:
                return self.agent.store_get(object_id)
            kind, payload = self.run_sync(self._fetch(address, object_id, None))
            if kind == P.VALUE:
                return payload
            if kind == P.ERROR:
                raise loads(payload).to_exception()
            address = payload  # the owner says: a worker keeps it there

    async def owner_gone(self, address: str) -> str | None:
        """Why the owner at ``address`` is gone, or ``None`` if it is reached (or the
        scheduler cannot say).  Dask retries a refused connect until
        ``distributed.comm.timeouts.connect`` (30 s); instead each connect try lasts
        ``owner-probe`` (1 s), and after a failed one the scheduler is asked
        (:class:`~yrdask.protocol.OwnerAlive`): an owner it no longer lists is gone at once;
        one it still lists (its stream not closed yet, or a hung process) is tried again
        until ``owner-unreachable`` (4 s) has passed, then given up (:func:`owner_timeouts`)."""
        if address in self.lost_workers or address in self.objects.counter.dead:
            return "the scheduler reported it gone"
        probe, unreachable = owner_timeouts()
        rpc = self.connector.rpc(address)
        deadline = time.monotonic() + unreachable
        while True:
            began = time.monotonic()
            try:
                # bounded as a whole: Dask's handshake read after the connect has no
                # timeout, and a hung owner's kernel still accepts the connection
                comm = await asyncio.wait_for(rpc.pool.connect(address, timeout=probe),
                                              probe)
            except OSError as e:
                try:
                    alive = await self.connector.request(P.OwnerAlive(address))
                except Exception:  # the scheduler cannot say: keep trying the owner
                    return None
                if alive is False:  # (None: a scheduler without the rpc)
                    return f"the scheduler no longer knows it ({e})"
                if alive is None:
                    return None
                if time.monotonic() >= deadline:
                    return (f"no connection within {unreachable:g} s, though the scheduler "
                            f"still lists it (a hung process, or one whose death the scheduler "
                            f"has not seen yet; yrdask.object-store.owner-unreachable) ({e})")
                # one try per probe at most: a connect that fails at once does not turn
                # this into a tight loop of OwnerAlive requests
                await asyncio.sleep(max(0.0, began + probe - time.monotonic()))
                continue
            rpc.pool.reuse(address, comm)  # the request that follows takes it
            return None

    async def _fetch(self, address: str, object_id: str, timeout: float | None,
                     owner: bool = False) -> list:
        try:
            gone = await self.owner_gone(address) if owner else None
            if gone is not None:  # its other objects here fail too, at once
                self.objects.process_died(address)
                raise OSError(gone)
            return await P.request(self.connector.rpc(address),
                                   P.FetchObject(object_id, timeout=timeout))
        except Exception as e:
            if owner and isinstance(e, OSError):  # the owner cannot be reached: it died
                error: Exception = OwnerDiedError(
                    f"object {object_id} cannot be read: its owner {address} (the process that "
                    f"created it) is unreachable: {e}")
            else:
                error = YRRuntimeError(f"cannot fetch object {object_id} from {address}: {e}")
            return [P.ERROR, dumps(RemoteError.from_exception(error, ""))]

    def _ensure_fetch(self, ref: ObjectRef) -> None:
        """A borrowed ref nobody asked its owner for yet: ask (the owner answers when ready)."""
        entry = ref._entry
        if entry.owner is None or entry.ready or entry.fetching:
            return
        with REFS_LOCK:  # user threads race here: one fetch only
            if entry.fetching:
                return
            entry.fetching = True

        async def fetch() -> None:
            kind, payload = await self._fetch(entry.owner, ref._id, None, owner=True)
            entry.set_result(kind, payload)

        self.on_loop(lambda: self.loop.create_task(fetch()))

    async def handle_fetch(self, object_id: str, timeout: float | None = None) -> list:
        """``FETCH_OBJECT`` for an object this process owns: wait for it, then send it."""
        entry = self.objects.entries.get(object_id)
        if entry is None:
            raise YRRuntimeError(f"object {object_id} is unknown to its owner {self.address}"
                                 " (it was freed, or its owner restarted)")
        if not entry.ready:
            fut = self.loop.create_future()
            entry.add_callback(lambda: fut.done() or fut.set_result(None))
            await asyncio.wait_for(fut, timeout)
        kind, payload = entry.snapshot(float("inf"))
        return [kind, wire(payload)]

    def wait(self, refs: list[ObjectRef | Stream], wait_num: int, timeout: float | None,
             fetch_local: bool = False) -> tuple[list, list]:
        """``(ready, not_ready)`` once ``wait_num`` of ``refs`` are ready or ``timeout`` s
        passed, both in input order.  A generator's stream among them (``ray.wait``) is ready
        when its next item is, or its end.  ``fetch_local`` (Ray's): a value another node
        keeps is pulled into this node's store as soon as it is ready, and counts as ready
        once it is here; pulls go on after the wait returns."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = threading.Event()
        count = [0]
        lock = threading.Lock()
        pulled: set[str] = set()  # fetch_local: pulls that ended (stored, or failed: get says)

        def one() -> None:
            with lock:
                count[0] += 1
                if count[0] >= wait_num:
                    done.set()

        for ref in refs:
            if isinstance(ref, ObjectRef):
                self._ensure_fetch(ref)
                self.on_loop(ref._entry.add_callback, functools.partial(
                    self._pull_then, ref, pulled, one) if fetch_local else one)
            else:
                self.on_loop(ref.on_next_ready, one)
        lease_id = current_lease()
        blocked = False
        try:
            if lease_id is not None or self.agent is not None:
                blocked = True  # before the notice: if it raises, the finally still undoes it
                self._lend(lease_id, True)
            block(done.wait, None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            if blocked:
                self._lend(lease_id, False)
        ready, not_ready = [], []
        for ref in refs:
            is_ready = (ref._entry.ready and not (fetch_local and ref._id not in pulled
                                                  and self._elsewhere(ref))
                        if isinstance(ref, ObjectRef) else ref.next_ready())
            (ready if is_ready and len(ready) < wait_num else not_ready).append(ref)
        return ready, not_ready

    def _elsewhere(self, ref: ObjectRef) -> bool:
        """Whether ``ref``'s ready value is kept by another node only (not in this process,
        not in this node's store)."""
        entry = ref._entry
        return (entry.state == P.LOCATION and not entry.has_value
                and not node_store().contains(ref._id))

    def _pull_then(self, ref: ObjectRef, pulled: set, then: Callable[[], None]) -> None:
        """On the loop, once ``ref`` is ready: pull its value into this node's store if
        another node keeps it (off the loop), note it in ``pulled``, then call ``then``.
        A failed pull is left to ``get``, which reports it."""
        if not self._elsewhere(ref):
            return then()
        entry = ref._entry

        def pull() -> None:
            try:
                self.fetch_payload(ref._id, entry.location)
            except Exception:  # noqa: BLE001 - get fetches again and raises
                logger.debug("fetch_local of %s failed", ref._id, exc_info=True)
            finally:
                pulled.add(ref._id)
                then()

        self.loop.run_in_executor(None, pull)


def _keep_payload(object_id: str, entry: Entry, payload: Any) -> None:
    """A value's pickle kept for its entry: a large one's one copy goes to the node's shared
    memory, a small one is the snapshot (a get unpickles it, once)."""
    if type(payload) is Frames:
        entry.payload = node_store().put(object_id, payload)
        entry.stored = True
    else:
        entry.payload = payload
