"""Pickling of user objects: functions, call arguments (with top-level refs set aside) and values.

The message envelopes are msgpack (Dask's comm); only user objects go through cloudpickle,
with protocol 5.  Used by both the caller side (``yrdask.api``) and the worker agent.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import cloudpickle

from yrdask.errors import YRRuntimeError, YRTypeError

__all__ = ["dumps", "dumps_definition", "loads", "pack_args", "unpack_args", "ArgSlot"]


def dumps(obj: Any) -> bytes:
    """Pickle a user object (cloudpickle, so lambdas and ``__main__`` code travel by value)."""
    return cloudpickle.dumps(obj, protocol=5)


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


loads: Callable[[bytes], Any] = pickle.loads


class ArgSlot:
    """Stands in for a top-level ``ObjectRef`` argument; the worker puts the value there."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (ArgSlot, (self.index,))


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
    try:
        return dumps((args, kwargs)), refs
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
