"""yrdask.ray: Ray Core's API over yrdask (``import yrdask.ray as ray``).

Ray's names and semantics on yrdask's machinery: ``@ray.remote`` functions and actors,
``get``/``put``/``wait``/``cancel``/``kill``, named and detached actors, Ray's exception
types, runtime context, ``ray.util`` (ActorPool, Queue, multiprocessing.Pool, the joblib
backend, placement groups, scheduling strategies).  ``python -m yrdask.ray script.py`` runs
a script that says ``import ray`` unchanged.  Differences from Ray are listed in
docs/migrating-from-ray.md.
"""

from __future__ import annotations

import inspect
from typing import Any

from yrdask.api.generators import ObjectRefGenerator
from yrdask.runtime.objects import ObjectRef
from yrdask.ray import _raylet, actor, exceptions, job_config, util
from yrdask.ray.actor import ActorClass, ActorHandle, method
from yrdask.ray.generators import DynamicObjectRefGenerator
from yrdask.ray.remote_function import RemoteFunction
from yrdask.ray.runtime_context import get_runtime_context
from yrdask.ray._timeline import timeline
from yrdask.ray.worker import (available_resources, cancel, cluster_resources, get, get_actor,
                               get_gpu_ids, init, is_initialized, kill, nodes, put, shutdown,
                               wait)

__version__ = "2.0.0+yrdask"

ObjectID = ObjectRef




def remote(*args: Any, **options: Any) -> Any:
    """``@ray.remote`` / ``@ray.remote(**options)`` on a function (a task) or a class (an actor)."""

    def make(target: Any) -> Any:
        if inspect.isclass(target):
            return ActorClass(target, options)
        if inspect.isfunction(target) or inspect.ismethod(target) or callable(target):
            return RemoteFunction(target, options)
        raise TypeError("The @ray.remote decorator must be applied to either a function or a "
                        f"class, got {type(target).__name__}")

    if len(args) == 1 and not options and (callable(args[0]) or inspect.isclass(args[0])):
        return make(args[0])
    if args:
        raise TypeError("The @ray.remote decorator must be applied either with no arguments "
                        "and no parentheses, for example '@ray.remote', or it must be applied "
                        "using some of the arguments in the list ['num_cpus', 'num_gpus', ...],"
                        " for example '@ray.remote(num_returns=2, resources={\"CustomResource\": 1})'.")
    return make


__all__ = sorted([
    "ActorClass", "ActorHandle", "DynamicObjectRefGenerator", "ObjectID", "ObjectRef",
    "ObjectRefGenerator", "RemoteFunction", "actor", "available_resources", "cancel", "cluster_resources",
    "exceptions", "get", "get_actor", "get_gpu_ids", "get_runtime_context", "init",
    "is_initialized", "job_config", "kill",
    "method", "nodes", "put", "remote", "shutdown", "timeline", "util", "wait",
])
