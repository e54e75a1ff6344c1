"""Which runtime this process has, and which task or instance the current thread runs.

Kept apart from the runtime itself so that every layer (objects, the worker agent, the
facade) can ask "whose work is this?" without importing the runtime's machinery.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from yrdask.errors import YRRuntimeError

_runtime: Any = None  # a yrdask.runtime.runtime.Runtime (not imported: it imports us)


class _Context(threading.local):
    """``.lease_id`` / ``.owner`` while a thread runs a task or method.  The class defaults
    answer for every other thread (the driver's): reading an attribute a thread never set
    costs no ``AttributeError`` inside ``getattr`` (once per submitted task)."""

    lease_id: str | None = None
    owner: str | None = None


_ctx = _Context()


_driver_api = "yr"  # "ray" once yrdask.ray.init starts this process's session


def set_driver_api(api: str) -> None:
    """Which API this driver's program speaks (``"yr"`` or ``"ray"``): the scheduler
    explains its waits in that API's words.  Set by ``yrdask.ray.init``."""
    global _driver_api
    _driver_api = api


def driver_api() -> str:
    return _driver_api


def not_initialized() -> YRRuntimeError:
    return YRRuntimeError("system not initialized: call yr.init() first")


def current_runtime() -> Any:
    """The runtime of this process; ``YRRuntimeError`` if ``yr.init`` has not run."""
    rt = _runtime
    if rt is None:
        raise not_initialized()
    return rt


def installed_runtime() -> Any:
    """The runtime of this process, or None."""
    return _runtime


def install(rt: Any) -> None:
    """Make ``rt`` this process's runtime (None: there is none)."""
    global _runtime
    _runtime = rt


#: Set by the worker layer (``worker/execution.py``): whether the task this thread runs has
#: been cancelled.  None in processes that run no tasks.
cancel_probe: Any = None


#: Set by the Ray facade (``yrdask.ray``): ``error_words()`` is, for the code running now,
#: the function that turns a yrdask error into the one its API raises (Ray's for Ray code:
#: a Ray task or actor, or a driver after ``ray.init``), or None (yr's own).  Read where a
#: ref's error reaches user code without ``get``: ``await ref``, its futures, Ray's
#: ``_on_completed``.  None where ``yrdask.ray`` was never imported.
error_words: Any = None


def error_mapper() -> Callable[[BaseException], BaseException] | None:
    """The error mapper of the code running now (see :data:`error_words`), or None."""
    words = error_words
    return None if words is None else words()


#: Set by the worker layer (``worker/execution.py``): ``note(task_id)`` records a task that
#: the task this thread runs submitted (its child, which a recursive cancel of it cancels
#: too).  None in processes that run no tasks.
child_note: Any = None


#: Set by the worker layer (``worker/execution.py``): ``hook(wait, timeout)`` runs the
#: blocking ``wait(timeout)`` (an ``Event.wait``) of a thread in ``get``/``wait`` so that a
#: cancel of the task it runs ends the wait.  None in processes that run no tasks.
wait_hook: Any = None

#: Set by the worker layer (``worker/hosting.py``): ``probe()`` gives the method call this
#: thread (or asyncio task) runs as an object with ``tries`` (what its caller charged its
#: bound before this delivery) and ``retried()`` (tell the caller it runs again after an
#: exception), or None outside a method call.  None in processes that host no instances.
method_call_probe: Any = None


#: Set by the worker layer (``worker/hosting.py``): ``probe()`` gives the id of the method
#: call this thread (or asyncio task) runs (its callers' and the task records' id), or None.
#: None in processes that host no instances.
call_id_probe: Any = None


def running_call_id() -> str | None:
    """The id of the method call the current thread (or asyncio task) runs, or None."""
    probe = call_id_probe
    return probe() if probe is not None else None


def running_method_call() -> Any:
    """The method call the current thread (or asyncio task) runs (see
    :data:`method_call_probe`), or None."""
    probe = method_call_probe
    return probe() if probe is not None else None


def current_task_cancelled() -> bool:
    """Whether the task the current thread runs has been cancelled (False outside tasks)."""
    probe = cancel_probe
    return bool(probe is not None and probe())


def current_owner() -> str | None:
    """The lifetime owner that work created by this thread belongs to."""
    return _ctx.owner


def current_lease() -> str | None:
    """The lease (or instance) whose slot this thread runs in, if any."""
    return _ctx.lease_id


class task_context:
    """Marks the current thread as running a task (for blocking notices and ownership)."""

    __slots__ = ("lease_id", "owner", "saved")

    def __init__(self, lease_id: str | None, owner: str | None) -> None:
        self.lease_id, self.owner = lease_id, owner

    def __enter__(self) -> None:
        self.saved = (_ctx.lease_id, _ctx.owner)
        _ctx.lease_id, _ctx.owner = self.lease_id, self.owner

    def __exit__(self, *exc: Any) -> None:
        _ctx.lease_id, _ctx.owner = self.saved


_checkpointing = threading.local()


def is_checkpointing() -> bool:
    """True while this thread pickles a checkpoint (handles then carry no transit token)."""
    return getattr(_checkpointing, "on", False)


def checkpoint(obj: Any) -> bytes:
    """The pickled instance object ``obj``, as ``yr.save_state()`` and a scale-down move
    take it: handles inside are pickled without a transit token (a checkpoint does not
    keep other instances alive)."""
    from yrdask.serialization import dumps

    _checkpointing.on = True
    try:
        return dumps(obj)
    finally:
        _checkpointing.on = False
