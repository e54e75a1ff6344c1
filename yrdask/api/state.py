"""``yr.save_state()`` / ``yr.load_state()``: checkpoints of a running instance.

The checkpoint is the pickled instance object, kept by the scheduler's lifecycle manager
(it outlives the worker).  When the instance restarts after its process died
(``recover_retry_times``), it resumes from the last checkpoint instead of a fresh
``__init__``.  Handles inside the state are pickled without a transit token: a checkpoint
does not keep other instances alive.
"""

from __future__ import annotations

from typing import Any

from yrdask import protocol as P
from yrdask.runtime.context import checkpoint, current_owner, current_runtime
from yrdask.errors import YRRuntimeError, YRTypeError, YRValueError
from yrdask.serialization import loads


def _hosted_instance(what: str) -> tuple[Any, Any]:
    rt = current_runtime()
    iid = current_owner()
    inst = rt.agent.instances.get(iid) if rt.agent is not None and iid else None
    if inst is None:
        raise YRRuntimeError(f"yr.{what}() can only be called inside a method of an instance")
    return rt, inst


def _check_timeout(what: str, timeout_sec: Any) -> float:
    if isinstance(timeout_sec, bool) or not isinstance(timeout_sec, (int, float)):
        raise YRTypeError(f"yr.{what}: timeout_sec must be a number, got {timeout_sec!r}")
    if not timeout_sec > 0:
        raise YRValueError(f"yr.{what}: timeout_sec must be > 0, got {timeout_sec!r}")
    return float(timeout_sec)


def save_state(timeout_sec: int = 30) -> None:
    """Checkpoint the calling instance; a restart resumes from the last checkpoint."""
    timeout = _check_timeout("save_state", timeout_sec)
    rt, inst = _hosted_instance("save_state")
    state = checkpoint(inst.obj)
    rt.run_sync(rt.connector.scheduler_rpc(P.SAVE_STATE, instance_id=inst.instance_id,
                                           state=state), timeout)


def load_state(timeout_sec: int = 30) -> None:
    """Restore the calling instance's attributes from its last checkpoint."""
    timeout = _check_timeout("load_state", timeout_sec)
    rt, inst = _hosted_instance("load_state")
    state = rt.run_sync(rt.connector.scheduler_rpc(P.LOAD_STATE, instance_id=inst.instance_id),
                        timeout)
    if state is None:
        raise YRRuntimeError(f"instance {inst.instance_id} has no saved state to load")
    restore(inst.obj, loads(state))


def restore(obj: Any, saved: Any) -> None:
    """Make ``obj`` (the live instance, which ``self`` points to) take ``saved``'s attributes."""
    if hasattr(obj, "__dict__") and hasattr(saved, "__dict__"):
        obj.__dict__.clear()
        obj.__dict__.update(saved.__dict__)
    for slot in getattr(type(saved), "__slots__", ()):
        if hasattr(saved, slot):
            setattr(obj, slot, getattr(saved, slot))
