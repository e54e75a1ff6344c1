"""``yr.apis``: the API functions, including ``get_node_id`` and ``get_namespace`` (which yr
does not export at top level).  Re-exported from yrdask: the same objects."""

from yrdask.api.functions import invoke  # noqa: F401
from yrdask.api.instances import (exit, get_instance, get_namespace, instance,  # noqa: F401
                                  kill_instance, list_named_instances, method)
from yrdask.api.kv import (kv_del, kv_get, kv_get_with_param, kv_m_write_tx,  # noqa: F401
                           kv_read, kv_set, kv_write, kv_write_with_param)
from yrdask.api.nodes import get_node_id, get_node_ip_address, resources  # noqa: F401
from yrdask.api.objects_api import cancel, get, put, wait  # noqa: F401
from yrdask.api.resource_groups import (create_resource_group,  # noqa: F401
                                        remove_resource_group)
from yrdask.api.session import finalize, init, is_initialized  # noqa: F401
from yrdask.api.state import load_state, save_state  # noqa: F401

__all__ = ["cancel", "create_resource_group", "exit", "finalize", "get", "get_instance",
           "get_namespace", "get_node_id", "get_node_ip_address", "init", "instance", "invoke",
           "is_initialized", "kill_instance", "kv_del", "kv_get", "kv_get_with_param",
           "kv_m_write_tx", "kv_read", "kv_set", "kv_write", "kv_write_with_param",
           "list_named_instances", "load_state", "method", "put", "remove_resource_group",
           "resources", "save_state", "wait"]
