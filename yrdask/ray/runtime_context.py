"""``ray.get_runtime_context()``: ids and resources of the code that is running."""

from __future__ import annotations

import uuid
import warnings
from typing import Any

from yrdask.runtime.context import current_runtime, current_task_cancelled, running_call_id
from yrdask.ray._context import current_ctx, current_method, hosted_instance

__all__ = ["RuntimeContext", "get_runtime_context"]


class _ID(str):
    """An id (a str) with Ray's ``hex()``."""

    def hex(self) -> str:  # noqa: A003 - Ray's name
        return str(self)


class RuntimeContext:
    """What is running here: node, job, task or actor, namespace, assigned resources."""

    def get_node_id(self) -> str:
        """This node's id (its host, docs/nodes.md); in a driver, the node of the driver's
        host, as Ray's driver belongs to the node it started or joined."""
        from yrdask.api.nodes import get_node_id

        rt = current_runtime()
        if getattr(rt, "agent", None) is not None:
            return get_node_id()
        import os

        import dask

        named = os.environ.get("YRDASK_NODE_ID") or dask.config.get("yrdask.worker.node", None)
        if named:
            return str(named)
        from distributed.comm import get_address_host

        return get_address_host(rt.address)

    def get_node_labels(self) -> dict[str, str]:
        """This node's labels (``yrdask.worker.labels``, docs/nodes.md) and its id under
        ``ray.io/node-id``, as Ray gives them."""
        from yrdask.config import node_labels
        from yrdask.ray._options import NODE_ID_LABEL

        return {**node_labels(), NODE_ID_LABEL: self.get_node_id()}

    def get_accelerator_ids(self) -> dict[str, list[str]]:
        """``{"GPU": ["0"], "NPU": []}``: the accelerator ids this task or actor holds
        (strings, as Ray gives them); empty lists elsewhere."""
        return {"GPU": assigned_gpus(), "NPU": assigned_npus()}

    @property
    def node_id(self) -> _ID:
        """This node's id (Ray's deprecated property; ``.hex()`` gives the str)."""
        _deprecated("node_id", "get_node_id")
        return _ID(self.get_node_id())

    @property
    def job_id(self) -> _ID:
        """Ray's deprecated property: ``get_job_id()`` with ``.hex()``."""
        _deprecated("job_id", "get_job_id")
        return _ID(self.get_job_id())

    @property
    def task_id(self) -> _ID | None:
        """Ray's deprecated property: ``get_task_id()`` with ``.hex()``."""
        _deprecated("task_id", "get_task_id")
        found = self.get_task_id()
        return None if found is None else _ID(found)

    @property
    def actor_id(self) -> _ID | None:
        """Ray's deprecated property: ``get_actor_id()`` with ``.hex()``."""
        _deprecated("actor_id", "get_actor_id")
        found = self.get_actor_id()
        return None if found is None else _ID(found)

    def get_placement_group_id(self) -> str | None:
        """The placement group this task or actor was scheduled in (None elsewhere)."""
        if hosted_instance() is None and current_ctx().get("task_id") is None:
            return None  # a driver
        return current_ctx().get("placement_group_id")

    @property
    def current_placement_group_id(self) -> _ID | None:
        """Ray's deprecated property: ``get_placement_group_id()`` with ``.hex()``."""
        _deprecated("current_placement_group_id", "get_placement_group_id")
        found = self.get_placement_group_id()
        return None if found is None else _ID(found)

    def get_task_name(self) -> str | None:
        """The running task's name: its ``options(name=)`` or its function's name; in an
        actor method ``Class.method``; None in a driver."""
        names = current_method.get()
        if names is not None:
            return names[0]
        return current_ctx().get("task_name")

    def get_task_function_name(self) -> str | None:
        """The running task's function as ``module.qualname`` (``module.Class.method`` in an
        actor method); None in a driver."""
        names = current_method.get()
        if names is not None:
            return names[1]
        return current_ctx().get("function_name")

    def is_canceled(self) -> bool:
        """Whether the running task or actor task has been cancelled (``ray.cancel``).  A
        cancelled task is interrupted at its next Python bytecode, so code rarely sees True
        there; a sync actor task goes on and sees True.  RuntimeError in an async actor (as
        Ray: its tasks get ``asyncio.CancelledError`` instead)."""
        inst = hosted_instance()
        if inst is not None:
            if getattr(type(inst.obj), "__ray_async__", False):
                raise RuntimeError("This method is not supported in an async actor.")
            check = getattr(inst, "running_call_cancelled", None)
            return bool(check is not None and check())
        return current_task_cancelled()

    def get_job_id(self) -> str:
        return current_ctx().get("job_id", "")

    def get_session_name(self) -> str:
        """The session name of the cluster this process works in (Ray's form,
        ``session_2025-01-01_00-00-00_000000_1234``): the same in the driver and in the tasks
        and actors of every job on that cluster, another one after the scheduler restarts."""
        return current_ctx().get("session_name", "")

    def get_task_id(self) -> str | None:
        """An id unique to this execution of the task, or the actor method call's id (the
        ``task_id`` ``ray.util.state.list_tasks`` lists it under, as Ray); None in a driver."""
        call = current_method.get()
        if call is not None:  # an actor method: its call's id (made up where this thread
            if call[2] is None:  # does not know it)
                call[2] = running_call_id() or uuid.uuid4().hex
            return call[2]
        return current_ctx().get("task_id")

    def get_actor_id(self) -> str | None:
        """The actor's id inside an actor method, else None."""
        inst = hosted_instance()
        return inst.instance_id if inst is not None else None

    def get_actor_name(self) -> str | None:
        """The actor's name; ``""`` in an unnamed actor, None outside actors (as Ray)."""
        inst = hosted_instance()
        return (inst.spec.get("name") or "") if inst is not None else None

    @property
    def namespace(self) -> str:
        return current_ctx().get("namespace", "")

    def get_namespace(self) -> str:
        return self.namespace

    def get_assigned_resources(self) -> dict[str, float]:
        """The resources this task or actor asked for, in Ray units ({} in a driver)."""
        if hosted_instance() is None and current_ctx().get("task_id") is None:
            return {}
        return {k: v for k, v in current_ctx().get("resources", {}).items() if v}

    @property
    def current_actor(self) -> Any:
        """A handle to the actor running this method."""
        from yrdask.api.instances import InstanceProxy
        from yrdask.ray.actor import ActorHandle

        inst = hosted_instance()
        if inst is None:
            raise RuntimeError("This method is only available in an actor.")
        rt = current_runtime()
        return ActorHandle(InstanceProxy(inst.instance_id, inst.spec["meta"], rt))

    @property
    def was_current_actor_reconstructed(self) -> bool:
        """Whether this actor is a restart (after its process died, within ``max_restarts``),
        as Ray's property; only in an actor."""
        inst = hosted_instance()
        if inst is None:
            raise RuntimeError("was_current_actor_reconstructed is only available in an actor")
        return bool(inst.spec.get("incarnation"))

    def get(self) -> dict:
        """Ray's (deprecated) dict: ``task_id`` and ``actor_id`` only where there are ones."""
        out = {"job_id": _ID(self.get_job_id()), "node_id": _ID(self.get_node_id()),
               "namespace": self.namespace}
        for key, value in (("task_id", self.get_task_id()), ("actor_id", self.get_actor_id())):
            if value is not None:
                out[key] = _ID(value)
        return out


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(f"Use {instead}() instead", DeprecationWarning, stacklevel=3)


def assigned_gpus() -> list[str]:
    """The device ids of the GPUs the running work holds: yrdask runs such work in a process
    whose ``CUDA_VISIBLE_DEVICES`` names exactly them (docs/nodes.md)."""
    import os

    ids = os.environ.get("YRDASK_GPU_IDS")
    if not ids or os.environ.get("CUDA_VISIBLE_DEVICES") != ids:
        return []
    return [g for g in ids.split(",") if g]


def assigned_npus() -> list[str]:
    """The device ids of the Ascend NPUs the running work holds: it runs in a process whose
    ``ASCEND_RT_VISIBLE_DEVICES`` names exactly them (docs/nodes.md)."""
    import os

    ids = os.environ.get("YRDASK_NPU_IDS")
    if not ids or os.environ.get("ASCEND_RT_VISIBLE_DEVICES") != ids:
        return []
    return [g for g in ids.split(",") if g]


def get_runtime_context() -> RuntimeContext:
    """The runtime context of the caller (starts a session in a driver, as Ray does)."""
    from yrdask.ray._session import ensure_init

    ensure_init()
    return RuntimeContext()
