"""``ray.util.placement_group``: reserve bundles of resources, then place work in them.

Built on yrdask resource groups (``yrdask.create_resource_group``): a bundle's ``"CPU"`` in
cores becomes millicores, ``"memory"`` in bytes becomes ``"Memory"`` in MB, ``"GPU"`` and
other keys stay custom resources.  While this yrdask build has no resource groups,
``placement_group()`` raises :class:`~yrdask.ray.exceptions.UnsupportedOptionError`.
"""

from __future__ import annotations

import math
from typing import Any

import yrdask
from yrdask.api.resource_groups import create_group, find_group
from yrdask.ray.exceptions import UnsupportedOptionError

__all__ = ["PlacementGroup", "placement_group", "remove_placement_group",
           "get_current_placement_group", "get_placement_group", "placement_group_table"]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _require() -> None:
    if not hasattr(yrdask, "create_resource_group"):
        raise UnsupportedOptionError(
            "placement groups are not yet supported by this yrdask build (it has no "
            "yrdask.create_resource_group); schedule with resources= or "
            "NodeAffinitySchedulingStrategy instead")


def _yr_bundle(bundle: Any, i: int) -> dict:
    if not isinstance(bundle, dict) or not bundle:
        raise ValueError(f"Bundles must be non-empty dicts of resource -> amount; bundle {i} "
                         f"is {bundle!r}")
    out: dict[str, float] = {}
    for key, amount in bundle.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise ValueError(f"Bundle {i}: amount of {key!r} must be a number >= 0, "
                             f"got {amount!r}")
        if key == "CPU":
            out["CPU"] = float(amount) * 1000.0
        elif key == "memory":
            out["Memory"] = float(math.ceil(amount / 2 ** 20))
        else:
            out[key] = float(amount)
    if not any(out.values()):
        raise ValueError(f"Bundle {i} asks for nothing: {bundle!r}")
    out.setdefault("CPU", 0.0)  # Ray reserves only what a bundle names (yr would add defaults)
    out.setdefault("Memory", 0.0)
    return out


def _ray_bundle(yr_bundle: dict) -> dict:
    """A reserved bundle back in Ray's units (the inverse of :func:`_yr_bundle`; ``memory``
    comes back in whole MB, as it was reserved)."""
    out: dict[str, float] = {}
    for key, amount in yr_bundle.items():
        if not amount:
            continue
        if key == "CPU":
            out["CPU"] = amount / 1000.0
        elif key == "Memory":
            out["memory"] = amount * 2 ** 20
        else:
            out[key] = amount
    return out


class PlacementGroup:
    """A reserved group of bundles: ``ready()``, ``wait(timeout_seconds)``, ``bundle_specs``."""

    def __init__(self, group: Any, bundles: list[dict], strategy: str, name: str) -> None:
        self._group = group
        self.bundle_specs = [dict(b) for b in bundles]
        self.strategy = strategy
        self.name = name

    @property
    def bundle_count(self) -> int:
        return len(self.bundle_specs)

    @property
    def id(self) -> str:  # noqa: A003 - Ray's name
        return self._group.name

    def __repr__(self) -> str:
        return f"PlacementGroup({self.id!r}, bundles={self.bundle_specs})"

    def wait(self, timeout_seconds: float = 30) -> bool:
        """True once every bundle is reserved, False if that takes over ``timeout_seconds``."""
        try:
            self._group.wait(timeout_seconds)
        except TimeoutError:  # yrdask.YRTimeoutError: not reserved in time
            return False
        return True

    def ready(self) -> Any:
        """An ObjectRef that resolves (to this group) once it is reserved."""
        from yrdask.ray.remote_function import RemoteFunction

        return RemoteFunction(_wait_ready, {"num_cpus": 0}).remote(self)

    def _apply(self, inv: Any, bundle_index: int) -> None:
        inv.resource_group_options = yrdask.ResourceGroupOptions(
            resource_group_name=self.id, bundle_index=bundle_index)


def _wait_ready(pg: PlacementGroup) -> PlacementGroup:
    pg._group.wait(-1)  # raises if the group can never be reserved (removed)
    return pg


def placement_group(bundles: list[dict], strategy: str = "PACK", name: str = "",
                    lifetime: str | None = None, _max_cpu_fraction_per_node: Any = None,
                    _soft_target_node_id: Any = None, bundle_label_selector: Any = None
                    ) -> PlacementGroup:
    """Reserve ``bundles`` (Ray units) with ``strategy``; returns at once (see ``ready``)."""
    _require()
    if not isinstance(bundles, list) or not bundles:
        raise ValueError("The placement group `bundles` argument must be a non-empty list of "
                         "dicts")
    if strategy not in _STRATEGIES:
        raise ValueError(f"Invalid placement group strategy {strategy!r}; use one of "
                         f"{list(_STRATEGIES)}")
    if lifetime not in (None, "detached"):
        raise ValueError("Placement group `lifetime` argument must be either `None` or "
                         f"'detached', got {lifetime!r}")
    for key, value in (("_soft_target_node_id", _soft_target_node_id),
                       ("bundle_label_selector", bundle_label_selector),
                       ("_max_cpu_fraction_per_node", _max_cpu_fraction_per_node)):
        if value is not None:
            raise UnsupportedOptionError(f"placement_group({key}=...) is not supported by "
                                         "yrdask.ray")
    yr_bundles = [_yr_bundle(b, i) for i, b in enumerate(bundles)]
    group = create_group(yr_bundles, name or None, strategy, fate_sharing=False,
                         detached=lifetime == "detached")  # detached: outlives this job
    return PlacementGroup(group, bundles, strategy, name)


def remove_placement_group(placement_group: PlacementGroup) -> None:
    """Release the group's reservation (work inside it should have ended)."""
    _require()
    if not isinstance(placement_group, PlacementGroup):
        raise TypeError(f"expected a PlacementGroup, got {type(placement_group).__name__}")
    yrdask.remove_resource_group(placement_group._group)


def get_placement_group(placement_group_name: str) -> PlacementGroup:
    """The live group named ``placement_group_name`` (made by any job, or a detached one kept
    across a scheduler restart); ``ValueError`` if there is none.  Group names are global
    in yrdask, not per namespace."""
    _require()
    if not placement_group_name:
        raise ValueError("Please supply a non-empty value to get_placement_group")
    group = find_group(placement_group_name)
    if group is None:
        raise ValueError(f"Failed to look up placement group with name: "
                         f"{placement_group_name}")
    return PlacementGroup(group, [_ray_bundle(b) for b in group.bundles], group.strategy,
                          placement_group_name)


def get_current_placement_group() -> PlacementGroup | None:
    """The group the calling task or actor was placed in with
    ``placement_group_capture_child_tasks=True`` (None elsewhere, and in a driver): the group
    its children go to."""
    from yrdask.ray._util import captured_group

    return captured_group({})


def placement_group_table(placement_group: PlacementGroup | None = None) -> dict:
    """``{"placement_group_id", "name", "bundles", "strategy", "state"}`` of one group
    (yrdask.ray does not list every group: pass the one you want)."""
    _require()
    if not isinstance(placement_group, PlacementGroup):
        raise UnsupportedOptionError("placement_group_table() without a group is not "
                                     "supported by yrdask.ray: pass the PlacementGroup")
    try:
        state = "CREATED" if placement_group.wait(0) else "PENDING"
    except yrdask.YRRuntimeError:
        state = "REMOVED"
    return {"placement_group_id": placement_group.id, "name": placement_group.name,
            "bundles": dict(enumerate(placement_group.bundle_specs)),
            "strategy": placement_group.strategy, "state": state}
