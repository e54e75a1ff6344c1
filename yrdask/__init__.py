"""yrdask: the openYuanrong ``yr`` API (remote functions, objects, stateful instances) on Dask.

``import yrdask as yr`` (or ``import yr``) gives the ``yr`` names below.  The same module is
a Dask preload: ``dask scheduler --preload yrdask`` installs yr's scheduler extension, and
``dask worker ADDR --preload yrdask`` installs yr's worker agent (the scheduler also installs
it on every worker that joins).
"""

from yrdask.affinity import (Affinity, AffinityKind, AffinityScope, AffinityType, LabelOperator,
                             OperatorType)
from yrdask.api.functions import FunctionProxy, invoke
from yrdask.api.generators import ObjectRefGenerator
from yrdask.api.nodes import get_node_id, get_node_ip_address, resources
from yrdask.api.instances import (InstanceCreator, InstanceProxy, MethodProxy, exit,
                                  get_instance, get_namespace, instance, kill_instance,
                                  list_named_instances, method)
from yrdask.api.kv import (CacheType, ConsistencyType, CreateParam, ExistenceOpt, GetParam,
                           GetParams, MSetParam, SetParam, WriteMode, kv_del, kv_get,
                           kv_get_with_param, kv_m_write_tx, kv_read, kv_set, kv_write,
                           kv_write_with_param)
from yrdask.api.group import Group, GroupOptions
from yrdask.api.resource_groups import (ResourceGroup, ResourceGroupOptions,
                                        create_resource_group, remove_resource_group)
from yrdask.runtime.objects import ObjectRef
from yrdask.api.objects_api import cancel, get, put, wait
from yrdask.api.session import finalize, init, is_initialized
from yrdask.runtime.driver import ClientInfo
from yrdask.api.state import load_state, save_state
from yrdask.errors import (CallCrashedError, CancelledError, DependencyError, GetTimeoutError,
                           InstanceDiedError, KVExistsError, KVFullError, ScheduleError,
                           TaskCrashedError, YRError, YRInvokeError,
                           YRRuntimeError, YRTimeoutError, YRTypeError, YRValueError,
                           YRequestError)
from yrdask.options import Config, InvokeOptions
from yrdask import decorator  # noqa: E402,F401 - yr's module path, an attribute as in yr

__version__ = "0.1.0"

CancelError = CancelledError  # yr's name for it
StatelessFunction = FunctionProxy
StatefulInstance = InstanceProxy
StatefulInstanceCreator = InstanceCreator

__all__ = sorted([
    "Group",
    "GroupOptions",
    "ResourceGroup",
    "ResourceGroupOptions",
    "create_resource_group",
    "remove_resource_group",
    "Affinity",
    "AffinityKind",
    "AffinityScope",
    "AffinityType",
    "LabelOperator",
    "OperatorType",
    "CacheType",
    "CancelError",
    "CallCrashedError",
    "CancelledError",
    "ClientInfo",
    "ConsistencyType",
    "CreateParam",
    "DependencyError",
    "ExistenceOpt",
    "GetParam",
    "GetParams",
    "KVExistsError",
    "KVFullError",
    "MSetParam",
    "SetParam",
    "WriteMode",
    "exit",
    "get_namespace",
    "kv_del",
    "kv_get",
    "kv_get_with_param",
    "kv_m_write_tx",
    "kv_read",
    "kv_set",
    "kv_write",
    "kv_write_with_param",
    "Config",
    "FunctionProxy",
    "GetTimeoutError",
    "InstanceCreator",
    "InstanceDiedError",
    "InstanceProxy",
    "MethodProxy",
    "StatefulInstance",
    "StatefulInstanceCreator",
    "get_instance",
    "get_node_id",
    "get_node_ip_address",
    "instance",
    "kill_instance",
    "list_named_instances",
    "load_state",
    "method",
    "InvokeOptions",
    "ObjectRef",
    "ObjectRefGenerator",
    "ScheduleError",
    "TaskCrashedError",
    "StatelessFunction",
    "YRError",
    "YRInvokeError",
    "YRRuntimeError",
    "YRTimeoutError",
    "YRTypeError",
    "YRValueError",
    "YRequestError",
    "cancel",
    "finalize",
    "get",
    "init",
    "invoke",
    "is_initialized",
    "put",
    "resources",
    "save_state",
    "wait",
])


async def dask_setup(server: object) -> None:
    """Dask preload hook: install yr on a scheduler or a worker (see ``yrdask.deploy``)."""
    from yrdask.deploy.preload import dask_setup as setup

    await setup(server)
