"""Pickling of user objects: functions, call arguments (with top-level refs set aside) and values.

The message envelopes are msgpack (Dask's comm); only user objects go through cloudpickle,
with protocol 5.  Used by both the caller side (``yrdask.api``) and the worker agent.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import cloudpickle

__all__ = ["dumps", "loads", "pack_args", "unpack_args", "ArgSlot"]


def dumps(obj: Any) -> bytes:
    """Pickle a user object (cloudpickle, so lambdas and ``__main__`` code travel by value)."""
    return cloudpickle.dumps(obj, protocol=5)


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
            refs.append(value)
            return ArgSlot(len(refs) - 1)
        return value

    if any(is_ref(a) for a in args) or any(is_ref(v) for v in kwargs.values()):
        args = tuple(slot(a) for a in args)
        kwargs = {k: slot(v) for k, v in kwargs.items()}
    if not args and not kwargs:
        return b"", refs
    return dumps((args, kwargs)), refs


def unpack_args(blob: bytes, values: list) -> tuple[tuple, dict]:
    """Inverse of :func:`pack_args`, with ``values[i]`` put in slot ``i``."""
    if not blob:
        return (), {}
    args, kwargs = loads(blob)
    if values:
        args = tuple(values[a.index] if type(a) is ArgSlot else a for a in args)
        kwargs = {k: values[v.index] if type(v) is ArgSlot else v for k, v in kwargs.items()}
    return args, kwargs
