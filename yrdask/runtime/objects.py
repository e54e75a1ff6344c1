"""ObjectRef, the entry that backs it, and the refs met while pickling and unpickling.

Every ``ObjectRef`` names an *entry* in the object table (``runtime/object_table.py``, the
owner's memory store) of the process that created it (its owner): pending, a value, the address of the worker keeping a large value, or an error.
Entries are reference counted by the live ``ObjectRef`` objects of this process.  When a ref
leaves the process (pickled into arguments, results or values) the owner counts its
*borrowers* with Ray's ownership protocol, the pure machine of ``runtime/refcount.py``: the
entry stays while a borrower may still read it (``FETCH_OBJECT``), and is freed, with the copy
a worker keeps, once the owner and the last borrower dropped it (docs/objects.md).

Who may change what (one rule per structure):

* ``ObjectTable.entries``, every ``Entry.refs`` / ``Entry.shared`` and the reference
  counting machine (``ObjectTable.counter``) change only under
  :data:`REFS_LOCK` (one re-entrant lock per process, held for a few dict and integer
  operations).  Refs are created and dropped on any thread (``yr.put`` and submissions on
  user threads, unpickling on task threads, ``ObjectRef.__del__`` wherever the garbage
  collector runs), so the count and the entry's presence must change atomically: a lost
  update would free a value that is still referenced.
* An entry's *state* (``state``, ``payload``/``location``/``error``, ``event``, callbacks)
  settles on the runtime's event loop thread only, except an entry no other thread can see
  yet: ``yr.put`` settles its entry (value and pickle) before the ref is returned.
* Local caches of a ready entry (the unpickled ``value``, a value fetched from the worker
  keeping it) may be filled by any reading thread; they are swapped in under the lock, so
  two readers never see a half-made cache.  User threads wait on a ``threading.Event``
  created under the lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
import types
from typing import Any, Callable

from yrdask import protocol as P
from yrdask.errors import RemoteError, YRRuntimeError, YRTypeError, YRValueError
from yrdask.runtime.context import current_runtime, error_mapper
from yrdask.serialization import dumps, dumps_value, loads, wire

PENDING = "pending"
MAX_TIMEOUT = 0x7FFFFFFF

#: Guards ``ObjectTable.entries``, ``Entry.refs``/``shared``, the counter and the value caches.
#: Re-entrant: the garbage collector may run ``ObjectRef.__del__`` while a thread holds it.
REFS_LOCK = threading.RLock()
# Per thread, while recording: .refs {id: ref} of refs this thread pickles, .counted {id: owner}
# of those the owner must count (pending or kept by a worker); .unpickled {id: owner} of
# counted refs this thread unpickles.
class _Recording(threading.local):
    rec: list | None = None  # [refs, counted] while pack_counting runs on this thread
    unpickled: dict | None = None  # while unpickling runs on this thread


_pickled = _Recording()


def recording() -> list | None:
    """While this thread packs for yr (``pack_counting``: a call's arguments, a value), that
    packing's record (its slot 2 is free for ``dask_objects``, and goes with it), else None."""
    return _pickled.rec


def check_timeout(timeout: Any) -> None:
    """A ``yr.get`` timeout: seconds in (0, MAX_TIMEOUT], or -1 for no limit."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise YRTypeError(f"yr.get: timeout must be a number of seconds, got {type(timeout).__name__}")
    if timeout != -1 and not 0 < timeout <= MAX_TIMEOUT:  # also rejects nan and inf
        raise YRValueError(
            "Parameter 'timeout' should be greater than 0 or equal to -1 (no timeout), "
            f"and at most {MAX_TIMEOUT}, got {timeout}")


def check_live(refs: list, what: str) -> None:
    """Refs of a finalized runtime would never become ready: say so instead of waiting."""
    for ref in refs:
        if ref._runtime.closed:
            raise YRRuntimeError(f"{what}: {ref} belongs to a yr runtime that was finalized; "
                                 "ObjectRefs do not outlive yr.finalize()")


class Entry:
    """One object as its process knows it (see module docstring for the states)."""

    __slots__ = ("state", "value", "has_value", "payload", "location", "error", "event",
                 "callbacks", "refs", "shared", "owner", "fetching", "stored")

    def __init__(self, owner: str | None = None) -> None:
        self.state = PENDING
        self.value: Any = None
        self.has_value = False
        self.payload: bytes | None = None  # pickled value
        self.location: str | None = None  # worker address keeping a large value
        self.error: BaseException | RemoteError | None = None
        self.event: threading.Event | None = None
        self.callbacks: list[Callable[[], None]] | None = None
        self.refs = 0
        self.shared = False  # pickled for other processes: keep the pickle
        self.owner = owner  # None when this process owns the object
        self.fetching = False
        self.stored = False  # payload is this node's store copy of the value (store.py)

    @property
    def ready(self) -> bool:
        return self.state is not PENDING

    def wait(self, timeout: float | None) -> bool:
        if self.state is not PENDING:
            return True
        ev = self.event
        if ev is None:
            fresh = threading.Event()
            with REFS_LOCK:  # two waiting threads must share one event
                ev = self.event
                if ev is None:
                    ev = self.event = fresh
            if self.state is not PENDING:  # settled before it saw the event
                return True
        return ev.wait(timeout)

    def settle(self, state: str) -> None:
        self.state = state
        if self.event is not None:
            self.event.set()
        cbs, self.callbacks = self.callbacks, None
        for cb in cbs or ():
            cb()

    def add_callback(self, cb: Callable[[], None]) -> None:
        """Run ``cb`` (on the loop thread) once the entry is ready, or now if it is."""
        if self.state is not PENDING:
            cb()
        else:
            if self.callbacks is None:
                self.callbacks = []
            self.callbacks.append(cb)

    # -- results ---------------------------------------------------------------------------

    def set_value(self, value: Any) -> None:
        self.value, self.has_value = value, True
        self.settle(P.VALUE)

    def set_result(self, kind: str, payload: Any) -> None:
        """Record ``[kind, payload]`` as carried by TASK_DONE / FETCH_OBJECT replies."""
        if self.state is not PENDING:
            return
        if kind == P.VALUE:
            self.payload = payload
        elif kind == P.LOCATION:
            self.location = payload
        else:
            self.error = loads(payload) if isinstance(payload, bytes) else payload
        self.settle(kind)

    def set_error(self, error: BaseException | RemoteError) -> None:
        if self.state is PENDING:
            self.error = error
            self.settle(P.ERROR)

    def lose(self, error: BaseException | None) -> None:
        """(loop) The worker keeping this value is gone: pending again (its task runs again,
        or its owner is asked again), or failed with ``error``."""
        with REFS_LOCK:
            self.location = None
            self.event = None
            self.fetching = False
            self.state = PENDING
        if error is not None:
            self.set_error(error)

    def exception(self) -> BaseException | None:
        """A fresh exception to raise: a shared one would keep each raiser's frames alive."""
        err = self.error
        if err is None:
            return None
        if isinstance(err, RemoteError):
            return err.to_exception()
        fresh = copy.copy(err)
        fresh.__traceback__ = None
        return fresh

    def get_payload(self) -> Any:
        """The pickled value (pickled once, then cached)."""
        payload = self.payload
        if payload is None:
            payload = dumps_value(self.value)
            with REFS_LOCK:
                if self.payload is None:
                    self.payload = payload
                else:
                    payload = self.payload
        return payload

    def get_value(self, load: Callable[[Any], Any] = loads) -> Any:
        """The value of a ready entry holding it locally (deserialized once, then cached)."""
        with REFS_LOCK:
            if self.has_value:
                return self.value
            payload = self.payload
        value = load(payload)
        with REFS_LOCK:
            if not self.has_value:
                self.value, self.has_value = value, True
                if not self.shared and not self.stored:
                    self.payload = None
            return self.value

    def cache_value(self, value: Any) -> Any:
        """Keep a value fetched from elsewhere (first one wins); returns the kept value."""
        with REFS_LOCK:
            if not self.has_value:
                self.value, self.has_value = value, True
            return self.value

    def snapshot(self, inline_limit: float) -> list | None:
        """``[kind, payload]`` of a ready entry (values up to ``inline_limit`` bytes), or None.

        None means the reader must fetch it from the owner: still pending, or too large.
        """
        if self.state == P.ERROR:
            err = self.error
            if not isinstance(err, RemoteError):
                err = RemoteError.from_exception(err, "")
            return [P.ERROR, dumps(err)]
        if self.state == P.LOCATION:
            return [P.LOCATION, self.location]
        if self.state == P.VALUE:
            payload = self.get_payload()
            if len(payload) <= inline_limit:
                return [P.VALUE, payload]
        return None


def when_ready(refs: list, then: Callable[[], None]) -> None:
    """Call ``then`` (on the loop) once every ref this process owns in ``refs`` is ready.

    Borrowed refs are not waited for: a worker reads them from their owner, who answers when
    the value exists.  (Nothing here would ever fetch them, so waiting could hang.)
    """
    pending = pending_owned(refs)
    if not pending:
        then()
        return
    left = [len(pending)]

    def one() -> None:
        left[0] -= 1
        if left[0] == 0:
            then()

    for entry in pending:
        entry.add_callback(one)


def pending_owned(refs: list) -> list[Entry]:
    """Entries of ``refs`` this process owns that are not ready yet."""
    return [r._entry for r in refs if not r._entry.ready and r._entry.owner is None]


def failed_dep(refs: list) -> BaseException | RemoteError | None:
    """The stored error of the first failed ref among ``refs`` (to store as is), if any."""
    for ref in refs:
        if ref._entry.state == P.ERROR:
            return ref._entry.error
    return None


def dep_of(ref: "ObjectRef") -> list:
    """``[id, kind, payload]`` telling a worker where a ref argument's value is.

    A value in this node's store goes by reference (its owner's address): a worker on this
    node maps it from the store, one elsewhere pulls it once for its node.  The caller keeps
    the ref alive until the call is done (borrowing: docs/objects.md).
    """
    entry = ref._entry
    if entry.state == P.LOCATION:
        return [ref._id, P.LOCATION, entry.location]
    if entry.stored:
        return [ref._id, P.LOCATION, entry.owner or ref._runtime.address]
    if entry.state == P.VALUE:
        return [ref._id, P.VALUE, wire(entry.get_payload())]
    return [ref._id, P.LOCATION, entry.owner]  # borrowed, not read here yet: ask its owner


class ObjectRef:
    """A reference to a value that a task, a method call or ``yr.put`` produces.

    Hashable and comparable by id, picklable (it can be passed inside arguments and values),
    awaitable, and convertible to a ``concurrent.futures.Future``.  Not built by users.
    """

    __slots__ = ("_id", "_runtime", "_entry", "__weakref__")

    #: ``ObjectRef[int]`` in type hints (Ray's actors page: ``ref: ray.ObjectRef[int]``)
    __class_getitem__ = classmethod(types.GenericAlias)

    def __init__(self, object_id: str, runtime: Any, entry: Entry) -> None:
        """Only :class:`ObjectTable` builds refs, with ``entry.refs`` already counted."""
        self._id = object_id
        self._runtime = runtime
        self._entry = entry

    def __del__(self) -> None:
        try:
            self._runtime.objects.drop_ref(self._id, self._entry)
        except Exception:
            pass

    # -- identity --------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def task_id(self) -> str:
        return self._id.split(".", 1)[0]

    def __repr__(self) -> str:
        return f"ObjectRef({self._id})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectRef) and other._id == self._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __copy__(self) -> "ObjectRef":
        return self

    def __deepcopy__(self, memo: dict) -> "ObjectRef":
        return self

    def __reduce__(self):
        return self._runtime.objects.reduce_ref(self)

    # -- completion ------------------------------------------------------------------------

    def done(self) -> bool:
        return self._entry.ready

    def is_exception(self) -> bool:
        return self._entry.state == P.ERROR

    def wait(self, timeout: float | None = None) -> None:
        """Block until the object is ready; raises its error if it failed."""
        self.get(-1 if timeout is None else timeout)

    def get(self, timeout: int = 300) -> Any:
        """Same as ``yr.get(ref, timeout)``."""
        check_timeout(timeout)
        check_live([self], "ObjectRef.get")
        return self._runtime.get([self], timeout)[0]

    def on_complete(self, callback: Callable[["ObjectRef"], Any]) -> None:
        """Call ``callback(ref)`` once, from a runtime thread, when the object is ready."""
        if not callable(callback):
            raise YRTypeError(f"on_complete: callback must be callable, got {callback!r}")
        rt = self._runtime

        def fire() -> None:
            rt.call_user_callback(callback, self)

        rt.on_loop(self._entry.add_callback, fire)

    def _on_completed(self, callback: Callable[[Any], Any]) -> None:
        """Ray's ``ObjectRef._on_completed``: ``callback(value)`` once the object is ready,
        with its error (the exception object) in place of the value if it failed."""
        if not callable(callback):
            raise YRTypeError(f"_on_completed: callback must be callable, got {callback!r}")
        rt = self._runtime
        mapper = error_mapper()  # Ray code calls this: Ray's error types

        def fire(_ref: ObjectRef) -> None:
            try:
                value = rt.get([self], -1)[0]
            except BaseException as e:  # noqa: BLE001 - Ray hands the error as the value
                value = e if mapper is None else mapper(e)
            callback(value)

        self.on_complete(fire)

    def get_future(self) -> concurrent.futures.Future:
        """A new ``concurrent.futures.Future`` resolved with the value (or the error, in the
        words of the API of the code that asked: Ray's error types for Ray code)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        rt = self._runtime
        mapper = error_mapper()

        def resolve(_ref: ObjectRef) -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the waiter gave up (a time-out, or asyncio.run ending): no one to tell
            try:
                fut.set_result(rt.get([self], -1)[0])
            except BaseException as e:  # noqa: BLE001 - handed to the future
                fut.set_exception(e if mapper is None else mapper(e))

        self.on_complete(resolve)
        return fut

    def as_future(self) -> asyncio.Future:
        """An ``asyncio.Future`` on the running event loop."""
        return asyncio.wrap_future(self.get_future())

    def future(self) -> concurrent.futures.Future:
        """Ray's name for :meth:`get_future` (``yrdask.ray`` code calls ``ref.future()``)."""
        return self.get_future()

    def hex(self) -> str:  # noqa: A003 - Ray's name
        """The object id as a string (Ray's ``ObjectRef.hex()``)."""
        return self._id

    def __await__(self):
        return self.as_future().__await__()


def _rebuild_ref(object_id: str, owner: str, snap: list | None) -> ObjectRef:
    return current_runtime().objects.borrow(object_id, owner, snap)


def failing_entries(entries: list) -> Callable[[BaseException], None]:
    """``fail(error)``: set ``error`` on every entry of ``entries`` (one call's refs)."""
    def fail(error: BaseException) -> None:
        for entry in entries:
            entry.set_error(error)
    return fail


def pack_recording_refs(pack: Callable[..., tuple], *args: Any) -> tuple[Any, list]:
    """``(pack(*args), refs)``: ``refs`` are the ObjectRefs the pickler met while packing,
    each once (the refs nested in a call's arguments; top-level ones become slots first).
    The pickler already visits every ref wherever it sits, so nothing walks the values."""
    packed, refs, _counted = pack_counting(pack, *args)
    return packed, refs


def pack_counting(pack: Callable[..., Any], *args: Any) -> tuple[Any, list, dict]:
    """``(pack(*args), refs, counted)``: as :func:`pack_recording_refs`, and ``counted``
    ``{id: owner}`` the refs among them whose readers need the owner (pending, or kept by a
    worker): the caller hands those to the counter (lend, contains), so none is pinned."""
    local = _pickled
    saved = local.rec
    rec = local.rec = [None, None, None]  # [2]: dask_objects' refs made in this packing
    try:
        packed = pack(*args)
    finally:
        local.rec = saved
    if rec[0] is None:  # the hot path: no ref met
        return packed, [], _NONE
    return packed, list(rec[0].values()), rec[1]


_NONE: dict = {}  # read only: "no counted refs"


REF_MARK = b"_rebuild_ref"  # in every pickle that holds an ObjectRef (its rebuild function)


def unpickling(load: Callable[..., Any], *args: Any) -> tuple[Any, dict]:
    """``(load(*args), found)``: ``found`` ``{id: owner}`` the counted refs of other owners
    this thread unpickled meanwhile (the borrower reports or registers them)."""
    local = _pickled
    saved = local.unpickled
    local.unpickled = found = {}
    try:
        value = load(*args)
    finally:
        local.unpickled = saved
    if saved is not None:
        saved.update(found)
    return value, found
