"""Dask's objects in yr calls: a ``distributed.Future`` or a ``dask.delayed`` value given to a
task, a method, ``get`` or ``wait`` becomes an ObjectRef this process owns (docs/objects.md,
"Dask objects and ObjectRefs").

The ref is pending until the Dask result exists; then the result is fetched once (through the
Future's client) and stored as ``put`` stores a value (a large one in the node's store), or
the Dask error is kept as the ref's error.  From there on it is an ordinary owned ref: a
task waits for it, gets it by reference, and its error fails the task, in both APIs.

A delayed value is computed on the cluster by the Dask client of this runtime's scheduler
(:func:`dask_client`).  Nested ones (in lists, dicts, any value pickled for a call or a
``put``) are converted while yr pickles them: the picklers meet them through ``copyreg``
reducers that act only while this thread packs for yr, and pickle as Dask pickles them
everywhere else.
"""

from __future__ import annotations

import copyreg
import logging
import threading
from typing import Any

from yrdask import protocol as P
from yrdask.errors import YRRuntimeError, YRTypeError
from yrdask.runtime.objects import REFS_LOCK, ObjectRef, recording
from yrdask.runtime.store import drop_local_copy, node_store
from yrdask.serialization import Frames, dumps_value

logger = logging.getLogger(__name__)

#: The Dask types converted (filled by :func:`register`; empty until a runtime exists).
TYPES: frozenset = frozenset()
_FUTURE: Any = None
_CLIENT_LOCK = threading.Lock()


def register() -> None:
    """Install the reducers (idempotent).  Every runtime calls it when it is built, so that
    ``import yrdask`` imports neither distributed nor dask's collections."""
    global TYPES, _FUTURE
    if TYPES:
        return
    from dask.delayed import Delayed, DelayedAttr, DelayedLeaf
    from distributed import Future

    _FUTURE = Future
    kinds = (Future, Delayed, DelayedLeaf, DelayedAttr)
    for kind in kinds:
        copyreg.pickle(kind, _reduce)
    TYPES = frozenset(kinds)


def _reduce(obj: Any) -> Any:
    """A Dask object met by a pickler: a ref while this thread packs for yr (a call's
    arguments, a value), else Dask's own pickle.  One ref per object and packing, also when
    the packing pickles twice (``dumps_value`` of a small value with buffers)."""
    packing = recording()
    if packing is not None:
        from yrdask.runtime.context import current_runtime

        made = packing[2]
        if made is None:
            made = packing[2] = {}  # id(Dask object) -> (the object, its ref)
        kept = made.get(id(obj))
        if kept is None:
            kept = made[id(obj)] = (obj, to_ref(current_runtime(), obj))
        return kept[1].__reduce__()
    if type(obj) is _FUTURE:
        return _FUTURE.__reduce__(obj)
    return obj.__reduce_ex__(5)


def is_dask(value: Any) -> bool:
    return type(value) in TYPES


def convert_args(rt: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with top-level Dask objects replaced by refs (the task sees the
    value, as for a ref argument).  Off the plain-argument fast path only."""
    types = TYPES
    if not types or not (any(type(a) in types for a in args)
                         or any(type(v) in types for v in kwargs.values())):
        return args, kwargs
    args = tuple(to_ref(rt, a) if type(a) in types else a for a in args)
    kwargs = {k: to_ref(rt, v) if type(v) in types else v for k, v in kwargs.items()}
    return args, kwargs


def refs_for(rt: Any, objs: list) -> tuple[list, dict] | None:
    """For ``get``/``wait`` given Dask objects among refs: ``(refs, {ref: the object given})``,
    or None if some item is neither (the caller's type error)."""
    if not TYPES:
        return None
    refs, given = [], {}
    for obj in objs:
        if type(obj) in TYPES:
            ref = to_ref(rt, obj)
            given[ref] = obj
        elif isinstance(obj, ObjectRef):
            ref = obj
        else:
            return None
        refs.append(ref)
    return refs, given


def to_ref(rt: Any, obj: Any) -> ObjectRef:
    """An owned ref settled with ``obj``'s Dask result (a Future of this runtime's cluster,
    or a delayed value, computed on it)."""
    if type(obj) is _FUTURE:
        future = _checked_future(rt, obj)
    else:
        future = dask_client(rt).compute(obj)
    object_id = rt.new_id()
    ref = rt.objects.new_ref(object_id)
    entry = ref._entry

    def done(fut: Any) -> None:  # a Dask callback thread: fetch and store off the yr loop
        try:
            payload = dumps_value(fut.result())
            stored = type(payload) is Frames
            if stored:
                payload = node_store().put(object_id, payload)
        except BaseException as e:  # noqa: BLE001 - Dask's error is the ref's error
            rt.on_loop(entry.set_error, e)
            return
        rt.on_loop(_settle, rt, object_id, entry, payload, stored)

    future.add_done_callback(done)
    return ref


def _settle(rt: Any, object_id: str, entry: Any, payload: Any, stored: bool) -> None:
    """(loop) The Dask value is here: settle the entry, unless every ref to it died."""
    with REFS_LOCK:  # drop_ref decides under it whether a store copy is to be dropped
        live = rt.objects.entries.get(object_id) is entry
        if live:
            entry.payload, entry.stored = payload, stored
    if not live:
        if stored:
            drop_local_copy(object_id)
        return
    entry.settle(P.VALUE)


def _checked_future(rt: Any, future: Any) -> Any:
    client = future._client
    if client is None:
        raise YRTypeError(
            f"the Dask Future {future.key!r} is bound to no Client (it was unpickled outside "
            "a Client or Worker): pass Futures made by a Client of this cluster "
            "(yrdask.dask.get_client())")
    if client.status in ("closing", "closed"):
        raise YRRuntimeError(
            f"the Dask Future {future.key!r} belongs to a Client that is {client.status}: its "
            "result can no longer be read; pass Futures of a running Client "
            "(yrdask.dask.get_client())")
    theirs, ours = client.scheduler.address, scheduler_address(rt)
    if not same_address(theirs, ours):
        raise YRRuntimeError(
            f"the Dask Future {future.key!r} belongs to the cluster at {theirs}, and this yr "
            f"runtime runs on the cluster at {ours}: pass Futures of this cluster "
            "(yrdask.dask.get_client()), or its value")
    return future


def scheduler_address(rt: Any) -> str:
    """The address of the scheduler this runtime works with."""
    address = getattr(rt.connector, "scheduler_address", None)
    if address is None and rt.agent is not None:
        address = rt.agent.worker.scheduler.address
    if address is None:
        raise YRRuntimeError("this yr runtime is not connected to a scheduler yet")
    return address


def same_address(a: str, b: str) -> bool:
    from distributed.comm import resolve_address

    if a == b:
        return True
    try:
        return resolve_address(a) == resolve_address(b)
    except (ValueError, OSError):
        return False


def dask_client(rt: Any) -> Any:
    """A running Dask ``Client`` of this runtime's scheduler: the default client if it is
    one, a worker's own client in a worker, else one this runtime opens once (a connection
    of its own to the scheduler) and closes at its end (:func:`close_dask_client`)."""
    from distributed import Client, default_client

    ours = getattr(rt, "dask_client", None)
    if ours is not None and ours.status == "running":
        return ours
    try:
        client = default_client()
    except ValueError:
        client = None
    address = scheduler_address(rt)
    if client is not None and client.status == "running" and same_address(
            client.scheduler.address, address):
        return client
    if rt.agent is not None:
        return rt.agent.worker._get_client()  # as distributed.get_client() does in a task
    with _CLIENT_LOCK:
        ours = getattr(rt, "dask_client", None)
        if ours is None or ours.status != "running":
            conf = getattr(rt, "conf", None)
            if conf is not None:
                from yrdask.runtime.security import resolve_security

                security = resolve_security(conf)
            else:
                from distributed.security import Security

                security = Security()
            ours = rt.dask_client = Client(address, security=security, set_as_default=True)
    return ours


def close_dask_client(rt: Any) -> None:
    """Close the client :func:`dask_client` opened for ``rt`` (not on its loop)."""
    client = getattr(rt, "dask_client", None)
    if client is not None:
        rt.dask_client = None
        try:
            client.close()
        except Exception:  # the runtime's own close goes on
            logger.exception("closing yrdask's Dask client failed")


def as_given(refs: list, given: dict) -> list:
    """``refs`` with the refs :func:`refs_for` made put back as the Dask objects given."""
    return [given.get(r, r) for r in refs]
