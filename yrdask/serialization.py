"""Pickling of user objects: functions, call arguments (with top-level refs set aside) and values.

The message envelopes are msgpack (Dask's comm); only user objects go through cloudpickle,
with protocol 5.  Used by both the caller side (``yrdask.api``) and the worker agent.

Values that may be stored and fetched (results, ``yr.put``) are pickled with
:func:`dumps_value`: a large one becomes :class:`Frames`, the pickle stream plus its
out-of-band buffers (a NumPy array's memory, not a copy).  Dask sends each frame as a frame
of its own (:func:`wire` wraps them for a message) instead of copying them through msgpack,
and the receiver unpickles straight from the received memory.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import cloudpickle

from yrdask.errors import YRError, YRRuntimeError, YRTypeError

__all__ = ["dumps", "dumps_value", "dumps_definition", "loads", "wire", "Frames", "pack_args",
           "unpack_args", "ArgSlot"]

#: Types plain pickle handles exactly as cloudpickle does (no code, no classes).
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), complex})
PLAIN_TYPES = _PLAIN  # no ref can hide in these: callers skip the ref bookkeeping

#: Values whose pickle (with buffers) is larger than this travel as :class:`Frames`.
FRAMES_OVER = 512 * 1024


def dumps(obj: Any) -> bytes:
    """Pickle a user object (cloudpickle, so lambdas and ``__main__`` code travel by value)."""
    if type(obj) in _PLAIN:  # no code to carry: skip building a cloudpickle Pickler
        return pickle.dumps(obj, protocol=5)
    return cloudpickle.dumps(obj, protocol=5)


class Frames:
    """A pickled value as protocol-5 frames: ``[pickle stream, buffer, ...]``."""

    __slots__ = ("frames", "nbytes")

    def __init__(self, frames: list) -> None:
        self.frames = frames
        self.nbytes = sum(memoryview(f).nbytes for f in frames)

    def __len__(self) -> int:
        return self.nbytes

    def __reduce__(self) -> tuple:
        # Pickled (say, inside an instance spec the scheduler forwards): buffers out of band.
        return (Frames, ([pickle.PickleBuffer(f) for f in self.frames],))


def dumps_value(obj: Any) -> bytes | Frames:
    """Pickle a value that may be stored and fetched: bytes if small, else :class:`Frames`.

    The frames of a large value share its buffers' memory (no copy): ``yr.put`` and large
    results then write them once into the node's store (``runtime/store.py``), and that
    copy is the snapshot.
    """
    if type(obj) in _PLAIN:
        return dumps(obj)
    buffers: list = []
    head = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    size = len(head) + sum(r.nbytes for r in raws)
    if size <= FRAMES_OVER:
        return dumps(obj) if raws else head  # small: one in-band blob travels inline
    return Frames([head, *raws])


def loads(payload: Any) -> Any:
    """Unpickle bytes, or :class:`Frames` (from their buffers, without a copy)."""
    if type(payload) is _Serialize:  # wrapped by wire() and handed over in-process
        payload = payload.data
    if type(payload) is Frames:
        return pickle.loads(payload.frames[0], buffers=payload.frames[1:])
    return pickle.loads(payload)


def wire(payload: Any) -> Any:
    """A payload ready to be a message field: :class:`Frames` go as Dask frames of their own."""
    if type(payload) is Frames:
        from distributed.protocol.serialize import Serialize

        return Serialize(payload)
    return payload


_registered = False
_Serialize: Any = None  # distributed.protocol.serialize.Serialize, once registered


def register_with_dask() -> None:
    """Teach Dask's "dask" serialization family to send :class:`Frames` as they are.

    Called by every runtime (driver and worker) before it sends or receives any; lazy so
    that ``import yrdask`` does not import distributed.
    """
    global _registered, _Serialize
    if _registered:
        return
    _registered = True
    from distributed.protocol.serialize import Serialize, dask_deserialize, dask_serialize

    _Serialize = Serialize

    @dask_serialize.register(Frames)
    def _serialize(value: Frames) -> tuple[dict, list]:
        return {}, list(value.frames)

    @dask_deserialize.register(Frames)
    def _deserialize(header: dict, frames: list) -> Frames:
        return Frames(list(frames))


def dumps_definition(obj: Any, what: str) -> bytes:
    """Pickle a decorated function or class; ``YRTypeError`` naming ``what`` if it cannot be."""
    try:
        return dumps(obj)
    except Exception as e:
        raise YRTypeError(f"{what} cannot be pickled to send it to the workers: {e} "
                          "(a global or closure variable it uses cannot be pickled)") from e


def unpicklable(value: Any, what: str, error: BaseException | None = None) -> YRTypeError | None:
    """The ``YRTypeError`` naming ``what`` if ``value`` cannot be pickled (None if it can)."""
    if error is None:
        try:
            dumps(value)
            return None
        except Exception as e:
            error = e
    return YRTypeError(f"{what} ({type(value).__name__}) cannot be pickled to send it to "
                       f"the cluster: {error}")




class ArgSlot:
    """Stands in for a top-level ``ObjectRef`` argument; the worker puts the value there."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (ArgSlot, (self.index,))


def pack_plain_args(args: tuple, kwargs: dict) -> bytes | None:
    """:func:`pack_args`'s blob when every argument is a plain value (no ref can be among
    them or nested in them: callers skip the ref bookkeeping), else None."""
    for a in args:
        if type(a) not in _PLAIN:
            return None
    if kwargs:
        for v in kwargs.values():
            if type(v) not in _PLAIN:
                return None
    elif not args:
        return b""
    return pickle.dumps((args, kwargs), protocol=5)


def pack_args(args: tuple, kwargs: dict, is_ref: Callable[[Any], bool]) -> tuple[bytes, list]:
    """Pickle ``(args, kwargs)``, replacing top-level refs by slots; returns (blob, refs)."""
    refs: list = []

    def slot(value: Any) -> Any:
        if is_ref(value):
            if getattr(value._runtime, "closed", False):  # its task or put died with it
                raise YRRuntimeError(f"{value} belongs to a yr runtime that was finalized; "
                                     "ObjectRefs do not outlive yr.finalize()")
            refs.append(value)
            return ArgSlot(len(refs) - 1)
        return value

    if any(is_ref(a) for a in args) or any(is_ref(v) for v in kwargs.values()):
        args = tuple(slot(a) for a in args)
        kwargs = {k: slot(v) for k, v in kwargs.items()}
    if not args and not kwargs:
        return b"", refs
    if not kwargs and all(type(a) in _PLAIN for a in args):
        return pickle.dumps((args, kwargs), protocol=5), refs  # no cloudpickle Pickler needed
    try:
        return dumps((args, kwargs)), refs
    except YRError:
        raise  # a yr check met while pickling (a Dask Future of another cluster) says it all
    except Exception as e:
        named = [(f"argument {i}", a) for i, a in enumerate(args)]
        named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        for what, value in named:
            err = unpicklable(value, what)
            if err is not None:
                raise err from e
        raise unpicklable((args, kwargs), "the arguments", e) from e


def unpack_args(blob: bytes, values: list) -> tuple[tuple, dict]:
    """Inverse of :func:`pack_args`, with ``values[i]`` put in slot ``i``."""
    if not blob:
        return (), {}
    try:
        args, kwargs = loads(blob)
    except BaseException as e:
        e.add_note("yrdask: the call's arguments could not be unpickled in the worker process")
        raise
    if values:
        args = tuple(values[a.index] if type(a) is ArgSlot else a for a in args)
        kwargs = {k: values[v.index] if type(v) is ArgSlot else v for k, v in kwargs.items()}
    return args, kwargs

