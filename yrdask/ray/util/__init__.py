"""``ray.util``: ActorPool, queues, placement groups, named-actor listing, node address (and the
submodules ``multiprocessing``, ``joblib`` and ``state``, imported by name)."""

from __future__ import annotations

from yrdask.ray.util import scheduling_strategies
from yrdask.ray.util.actor_pool import ActorPool
from yrdask.ray.util.placement_group import (PlacementGroup, get_current_placement_group,
                                             get_placement_group, placement_group,
                                             placement_group_table, remove_placement_group)
from yrdask.ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                   PlacementGroupSchedulingStrategy)

__all__ = sorted(["ActorPool", "PlacementGroup", "NodeAffinitySchedulingStrategy",
                  "PlacementGroupSchedulingStrategy", "get_current_placement_group",
                  "get_placement_group",
                  "get_node_ip_address", "list_named_actors", "placement_group",
                  "placement_group_table", "remove_placement_group", "scheduling_strategies"])


def list_named_actors(all_namespaces: bool = False) -> list:
    """Names of live named actors in this job's namespace, or ``[{"name", "namespace"}]``
    over all namespaces."""
    import yrdask
    from yrdask.ray._context import current_ctx
    from yrdask.ray._session import ensure_init

    ensure_init()
    if not isinstance(all_namespaces, bool):
        raise TypeError(f"all_namespaces must be a bool, got {all_namespaces!r}")
    pairs = yrdask.list_named_instances(all_namespaces=True)
    if all_namespaces:
        return pairs
    ns = current_ctx()["namespace"]
    return [p["name"] for p in pairs if p["namespace"] == ns]


def get_node_ip_address() -> str:
    """The IP address of this node (in a driver: the driver's)."""
    import yrdask
    from yrdask.ray._session import ensure_init

    ensure_init()
    return yrdask.get_node_ip_address()
