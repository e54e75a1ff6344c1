"""``yr.get``, ``yr.wait``, ``yr.put`` and ``yr.cancel``: argument checks, then the runtime."""

from __future__ import annotations

from typing import Any

from yrdask.api.generators import ObjectRefGenerator
from yrdask.runtime.objects import MAX_TIMEOUT, ObjectRef
from yrdask.runtime.objects import check_live as _check_live
from yrdask.runtime.objects import check_timeout as _check_timeout
from yrdask.runtime.context import current_runtime
from yrdask.runtime.dask_objects import as_given, is_dask, refs_for, to_ref
from yrdask.errors import YRTypeError, YRValueError


def put(obj: Any, create_param: Any = None) -> ObjectRef:
    """Store ``obj`` in the cluster's object store; returns its ObjectRef.

    The value is pickled here, so a value that cannot travel fails at this call (``TypeError``)
    rather than in a task that receives it; the pickle is kept for the tasks that do.
    ``create_param`` (yr's data-system options): objects live in their owner's memory and never
    change, so ``WriteMode.NONE_L2_CACHE``, ``CacheType.MEMORY`` and either consistency type
    hold; a second-level cache or a disk tier is refused by name.
    """
    rt = current_runtime()
    if create_param is not None:
        _check_create_param(create_param)
    return rt.put(obj)


def _check_create_param(param: Any) -> None:
    from yrdask.api.kv import CacheType, CreateParam, WriteMode

    if not isinstance(param, CreateParam):
        raise YRTypeError(f"yr.put: create_param must be a yr.CreateParam, got "
                          f"{type(param).__name__}")
    if param.write_mode is not WriteMode.NONE_L2_CACHE:
        raise YRValueError(
            f"yr.put: create_param.write_mode={param.write_mode} is not supported: objects live "
            "in their owner's memory, with no second-level cache or eviction; use "
            "WriteMode.NONE_L2_CACHE (the default)")
    if param.cache_type is not CacheType.MEMORY:
        raise YRValueError(
            f"yr.put: create_param.cache_type={param.cache_type} is not supported: objects live "
            "in their owner's memory; use CacheType.MEMORY (the default)")


def get(obj_refs: ObjectRef | list[ObjectRef], timeout: int = 300, allow_partial: bool = False) -> Any:
    """Value of one ref, or the list of values of a list of refs, waiting up to ``timeout`` s.

    ``timeout=-1`` waits forever; on time-out raises ``YRTimeoutError`` unless
    ``allow_partial`` (then values not ready are ``None``).  A failed task re-raises its error.
    """
    rt = current_runtime()
    _check_timeout(timeout)
    if not isinstance(allow_partial, bool):
        raise YRTypeError(f"yr.get: allow_partial must be a bool, got {allow_partial!r}")
    if isinstance(obj_refs, ObjectRef):
        _check_live([obj_refs], "yr.get")
        return rt.get([obj_refs], timeout, allow_partial)[0]
    if isinstance(obj_refs, tuple) and not obj_refs:
        return []
    if not isinstance(obj_refs, list):
        if is_dask(obj_refs):  # a Dask Future or delayed value: its result
            return rt.get([to_ref(rt, obj_refs)], timeout, allow_partial)[0]
        raise YRTypeError(
            f"yr.get takes an ObjectRef or a list of ObjectRefs, got {type(obj_refs).__name__}")
    obj_refs = _refs_or_dask(rt, obj_refs, "yr.get")[0]
    _check_live(obj_refs, "yr.get")
    return rt.get(obj_refs, timeout, allow_partial)


def wait(obj_refs: ObjectRef | list[ObjectRef], wait_num: int | None = None,
         timeout: int | None = None) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """Wait until ``wait_num`` refs (default: all) are ready or ``timeout`` s pass.

    Returns ``(ready, not_ready)``, both in input order; failed refs count as ready.
    """
    rt = current_runtime()
    refs = [obj_refs] if isinstance(obj_refs, ObjectRef) else obj_refs
    if not isinstance(refs, list):
        raise YRTypeError(f"obj_refs type error, actual: {type(refs)}, expect: list of ObjectRef")
    refs, given = _refs_or_dask(rt, refs, "yr.wait")
    _check_live(refs, "yr.wait")
    if len(set(refs)) != len(refs):
        raise YRValueError("yr.wait: duplicate obj_ref exists in the list")
    if wait_num is None:
        wait_num = len(refs)
    if isinstance(wait_num, bool) or not isinstance(wait_num, int):
        raise YRTypeError(f"yr.wait: wait_num must be an int, got {type(wait_num).__name__}")
    if not 0 <= wait_num <= len(refs):
        raise YRValueError(f"yr.wait: wait_num must be in [0, {len(refs)}], got {wait_num}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int):
            raise YRTypeError(
                f"yr.wait: timeout must be an int (seconds) or None, got {type(timeout).__name__}")
        if timeout < -1 or timeout > MAX_TIMEOUT:
            raise YRValueError(
                f"yr.wait: timeout must be -1 (forever) or in [0, {MAX_TIMEOUT}], got {timeout}")
        if timeout == -1:
            timeout = None
    if wait_num == 0 or timeout == 0:
        ready, not_ready = [], list(refs)
    else:
        ready, not_ready = rt.wait(refs, wait_num, timeout)
    if given:  # the Dask objects come back as given
        return as_given(ready, given), as_given(not_ready, given)
    return ready, not_ready


def cancel(obj_refs: ObjectRef | list[ObjectRef], allow_force: bool = True,
           allow_recursive: bool = False) -> None:
    """Cancel stateless tasks; ``yr.get`` of a cancelled ref raises a ``CancelledError``.
    ``allow_recursive``: the tasks a cancelled task submitted are cancelled too."""
    rt = current_runtime()
    refs = [obj_refs] if isinstance(obj_refs, (ObjectRef, ObjectRefGenerator)) else obj_refs
    if not isinstance(refs, list):
        raise YRTypeError(f"obj_refs type error, actual: [{type(obj_refs)}], "
                          f"element expect: {ObjectRef}")
    # A generator is cancelled through the ref of its call (the stream's end).
    refs = [r.completed() if isinstance(r, ObjectRefGenerator) else r for r in refs]
    _check_refs(refs, "yr.cancel")
    rt.cancel(refs, recursive=bool(allow_recursive))


def _refs_or_dask(rt: Any, refs: list, what: str) -> tuple[list, dict | None]:
    """``(refs, None)`` if all are refs; with Dask Futures or delayed values among them,
    ``(their refs, {ref: the object given})`` (docs/objects.md); else ``YRTypeError``."""
    for r in refs:
        if not isinstance(r, ObjectRef):
            break
    else:
        return refs, None
    converted = refs_for(rt, refs)
    if converted is None:
        _check_refs(refs, what)
    return converted


def _check_refs(refs: list, what: str) -> None:
    bad = [type(r) for r in refs if not isinstance(r, ObjectRef)]
    if bad:
        raise YRTypeError(f"obj_refs type error, actual: {bad}, element expect: {ObjectRef} "
                          f"({what} takes ObjectRefs)")
