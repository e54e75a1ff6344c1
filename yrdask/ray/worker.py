"""Ray's core functions (``ray.init``, ``get``, ``put``, ``wait``, ``cancel``, ``kill``, ...)
over yrdask's runtime, with Ray's semantics where they differ from ``yr``'s:

* ``get`` waits forever by default (``timeout=None``), ``timeout=0`` only checks, and errors
  come back as Ray's types (:mod:`yrdask.ray.exceptions`);
* ``wait`` returns after ``num_returns=1`` ready refs by default, takes float timeouts and
  ``timeout=0`` returns what is ready now;
* ``put`` stores ``None`` and empty bytes too; bytes come back as ``bytes``;
* the first ``.remote()``, ``put``, ``get`` or ``wait`` starts a session (``ray.init()``).
"""

from __future__ import annotations

import logging
from typing import Any

import yrdask
from yrdask.api.generators import ObjectRefGenerator
from yrdask.runtime import context as _rtctx
from yrdask.runtime.dask_objects import as_given, is_dask, refs_for, to_ref
from yrdask.runtime.objects import ObjectRef, check_live
from yrdask.ray._context import current_ctx, speaks_ray
from yrdask.ray._session import (RayContext, ensure_init, failed_ref, init, is_initialized,
                                 shutdown, store)
from yrdask.errors import YRTimeoutError
from yrdask.ray.exceptions import GetTimeoutError, UnsupportedOptionError, from_yr_error

logger = logging.getLogger("yrdask.ray")

__all__ = ["init", "shutdown", "is_initialized", "get", "put", "wait", "cancel", "kill",
           "get_actor", "nodes", "cluster_resources", "available_resources", "RayContext",
           "ensure_init", "failed_ref"]


def _refs_of(object_refs: Any, what: str) -> tuple[list, bool]:
    if isinstance(object_refs, ObjectRef):
        return [object_refs], True
    if not isinstance(object_refs, list) or not all(isinstance(r, ObjectRef)
                                                     for r in object_refs):
        # Dask Futures or delayed values (alone or among refs): the refs of their results
        rt = _rtctx.current_runtime()
        if is_dask(object_refs):
            return [to_ref(rt, object_refs)], True
        converted = refs_for(rt, object_refs) if isinstance(object_refs, list) else None
        if converted is not None:
            return converted[0], False
        raise ValueError(f"'object_refs' must either be an ObjectRef or a list of ObjectRefs "
                         f"({what} got {type(object_refs).__name__})")
    return object_refs, False


def _plain(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value


def get(object_refs: Any, *, timeout: float | None = None) -> Any:
    """Value(s) of ``object_refs``; waits ``timeout`` s (None: forever; 0: only if ready).

    A failed task raises ``RayTaskError(E)`` (also an ``E``); a dead actor ``ActorDiedError``;
    running out of time ``GetTimeoutError``.  An ``ObjectRefGenerator`` comes back as it is
    (Ray's rule, so code written for ``num_returns="dynamic"`` reads a streaming one too).
    """
    ensure_init()
    if isinstance(object_refs, ObjectRefGenerator):
        return object_refs
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout < 0):
        raise ValueError(f"'timeout' must be None or a non-negative number, got {timeout!r}")
    refs, single = _refs_of(object_refs, "ray.get")
    if not refs:
        return []
    check_live(refs, "ray.get")
    rt = _rtctx.current_runtime()
    try:
        values = rt.get(refs, -1 if timeout is None else timeout)
    except YRTimeoutError:
        raise GetTimeoutError(
            f"Get timed out: some object(s) not ready after {timeout} s; pass a longer "
            "timeout, or timeout=None to wait until they are") from None
    except BaseException as e:  # noqa: BLE001 - re-raised as Ray's type
        mapped = from_yr_error(e)
        if mapped is e:
            raise
        raise mapped from None
    values = [_plain(v) for v in values]
    return values[0] if single else values


def _error_words() -> Any:
    """The runtime's error mapper for the code running now: Ray's errors for Ray code (what
    ``await ref`` and a ref's futures raise there), None for yr code."""
    return from_yr_error if speaks_ray() else None


_rtctx.error_words = _error_words


def put(value: Any, *, _owner: Any = None) -> ObjectRef:
    """Store ``value`` (any picklable value, ``None`` included); returns its ObjectRef."""
    ensure_init()
    if _owner is not None:
        raise UnsupportedOptionError("ray.put(_owner=...) is not supported: the caller owns "
                                     "what it puts")
    if isinstance(value, ObjectRef):
        raise TypeError("Calling 'put' on an ray.ObjectRef is not allowed. If you really want "
                        "to do this, you can wrap the ray.ObjectRef in a list and call 'put' "
                        "on it.")
    return store(value)


def wait(object_refs: list, *, num_returns: int = 1, timeout: float | None = None,
         fetch_local: bool = True) -> tuple[list, list]:
    """``(ready, not_ready)`` once ``num_returns`` refs are ready or ``timeout`` s passed.

    Both lists keep the input order; failed refs count as ready.  An ``ObjectRefGenerator``
    in the list is ready when ``next()`` on it would not wait: its next item is ready, or
    the generator is over (``next()`` raises ``StopIteration``), as on Ray.
    ``fetch_local=True`` pulls each value another node keeps into this node's store as it
    gets ready, and counts it ready once it is here; ``False`` counts it where it is.
    """
    ensure_init()
    if isinstance(object_refs, (ObjectRef, ObjectRefGenerator)):
        raise TypeError("wait() expected a list of ray.ObjectRef or ray.ObjectRefGenerator, "
                        f"got a single {type(object_refs).__name__}")
    if not isinstance(object_refs, list):
        raise TypeError("wait() expected a list of ray.ObjectRef or ray.ObjectRefGenerator, "
                        f"got {type(object_refs)}")
    if timeout is not None and (isinstance(timeout, bool) or
                                not isinstance(timeout, (int, float)) or timeout < 0):
        raise ValueError(f"The 'timeout' argument must be nonnegative. Received {timeout}")
    if not isinstance(fetch_local, bool):
        raise TypeError(f"fetch_local must be a bool, got {fetch_local!r}")
    given = None
    if not all(isinstance(ref, ObjectRef) for ref in object_refs):
        object_refs, given = _waitables(object_refs)
    if not object_refs:
        return [], []
    if len(set(object_refs)) != len(object_refs):
        raise ValueError("Wait requires a list of unique object refs.")
    if isinstance(num_returns, bool) or not isinstance(num_returns, int) or num_returns <= 0:
        raise ValueError(f"Invalid number of objects to return {num_returns}.")
    if num_returns > len(object_refs):
        raise ValueError("num_returns cannot be greater than the number of objects provided "
                         "to ray.wait.")
    check_live(object_refs if given is None else  # generators were checked by _waitables
               [r for r in object_refs if isinstance(r, ObjectRef)], "ray.wait")
    ready, not_ready = _rtctx.current_runtime().wait(object_refs, num_returns, timeout,
                                                     fetch_local)
    if given:  # the Dask objects come back as given
        return as_given(ready, given), as_given(not_ready, given)
    return ready, not_ready


def _waitables(items: list) -> tuple[list, dict]:
    """``ray.wait``'s list with a generator's stream for each generator and a ref for each
    Dask object, and ``{stream or ref: the item given}`` to put them back."""
    rt = _rtctx.current_runtime()
    out, given = [], {}
    for item in items:
        if isinstance(item, ObjectRef):
            out.append(item)
        elif isinstance(item, ObjectRefGenerator):
            stream = item._stream
            check_live([stream.end_ref], "ray.wait")
            given[stream] = item
            out.append(stream)
        else:
            converted = refs_for(rt, [item])
            if converted is None:
                raise TypeError("wait() expected a list of ray.ObjectRef or "
                                f"ray.ObjectRefGenerator, got list containing {type(item)}")
            (ref,), more = converted
            given.update(more)
            out.append(ref)
    return out, given


def cancel(object_ref: ObjectRef, *, force: bool = False, recursive: bool = True) -> None:
    """Cancel a task: ``ray.get`` of its ref raises ``TaskCancelledError`` at once.

    A queued task never runs; a running one is interrupted at its next Python bytecode, or
    with ``force=True`` its worker process is ended (as on Ray: code blocked in C stops too,
    and the CPU is free at once; the nanny starts a fresh process).  An actor task, as on
    Ray: one not started never runs, a running ``async def`` one gets
    ``asyncio.CancelledError``, a running sync one goes on (``is_canceled()`` is True), and
    ``ray.get`` raises ``TaskCancelledError`` once the actor is done with it; ``force=True``
    is refused for it.  ``recursive`` (Ray's default): the tasks a cancelled task submitted
    are cancelled too (with the same ``force``), and theirs; ``False``: they keep running.
    """
    ensure_init()
    if not isinstance(object_ref, ObjectRef):
        raise TypeError("ray.cancel() only supported for object refs. For actors, try "
                        f"ray.kill(). Got: {type(object_ref)}.")
    for name, value in (("force", force), ("recursive", recursive)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    rt = _rtctx.current_runtime()
    state = rt.cancel_call(object_ref, force, recursive)
    if state == "force":
        raise ValueError("force=True is not supported for actor tasks.")
    if state is None:  # not an actor task waiting for its answer
        rt.cancel([object_ref], force, recursive)


def kill(actor: Any, *, no_restart: bool = True) -> None:
    """End ``actor`` now; its pending and later calls raise ``ActorDiedError``.
    ``no_restart=False``: kill its process as if it crashed instead (it restarts while it has
    ``max_restarts`` left; its pending calls are retried per ``max_task_retries``)."""
    from yrdask.ray.actor import ActorHandle

    if not isinstance(actor, ActorHandle):
        raise ValueError("ray.kill() only supported for actors. For tasks, try ray.cancel(). "
                         f"Got: {type(actor)}.")
    if no_restart:
        actor._kill()
    else:
        actor._crash()


def get_actor(name: str, namespace: str | None = None) -> Any:
    """A handle to the live actor ``name`` in ``namespace`` (default: this job's)."""
    ensure_init()
    from yrdask.ray.actor import ActorHandle

    if not isinstance(name, str) or not name:
        raise ValueError("Please supply a non-empty value to get_actor")
    if namespace is not None:
        from yrdask.ray._options import check_namespace

        check_namespace(namespace)
    ns = namespace or current_ctx()["namespace"]
    try:
        proxy = yrdask.get_instance(name, ns, 60)
    except yrdask.YRTimeoutError:
        raise
    except yrdask.YRRuntimeError:
        raise ValueError(f"Failed to look up actor with name '{name}'. This could because "
                         "1. You are trying to look up a named actor you didn't create. "
                         "2. The named actor died. 3. You did not use a namespace matching "
                         f"the namespace of the actor (looked in namespace {ns!r}).") from None
    return ActorHandle(proxy)


def nodes() -> list[dict]:
    """One dict per node (a host: all its worker processes together, docs/nodes.md): NodeID,
    Alive, NodeManagerAddress, NodeManagerHostname, Resources (Ray units: CPU in cores,
    memory in bytes, GPU in devices)."""
    ensure_init()
    from yrdask.api.nodes import nodes_info
    from yrdask.ray._options import NODE_ID_LABEL

    out = []
    for node in nodes_info():
        host = node["host"]
        out.append({"NodeID": node["id"], "Alive": True, "alive": True,
                    "NodeManagerAddress": host, "NodeManagerHostname": host,
                    "NodeName": host, "Resources": _ray_units(node["capacity"]),
                    "Labels": {**node["labels"], NODE_ID_LABEL: node["id"]}})
    return out


def get_gpu_ids() -> list[int]:
    """The GPU ids the calling task or actor holds (Ray's ``ray.get_gpu_ids()``): those in
    its ``CUDA_VISIBLE_DEVICES``, as ints where they are numbers.  ``[]`` in work that
    holds no GPU and in a driver."""
    from yrdask.ray.runtime_context import assigned_gpus

    return [int(g) if g.isdigit() else g for g in assigned_gpus()]


def _ray_units(resources: dict) -> dict:
    out: dict[str, float] = {}
    for key, amount in resources.items():
        if key == "CPU":
            out["CPU"] = amount / 1000.0
        elif key == "Memory":
            out["memory"] = float(amount) * 2 ** 20
        else:
            out[key] = float(amount)
    return out


def _sum(field: str) -> dict:
    ensure_init()
    total: dict[str, float] = {}
    for node in yrdask.resources():
        for key, amount in _ray_units(node[field]).items():
            total[key] = total.get(key, 0.0) + amount
    return total


def cluster_resources() -> dict:
    """Total resources of the cluster in Ray units (CPU cores, memory bytes, custom tags)."""
    return _sum("capacity")


def available_resources() -> dict:
    """What running tasks and live actors leave free, in Ray units; a resource all used up
    is left out, as on Ray."""
    return {k: v for k, v in _sum("allocatable").items() if v > 0}
