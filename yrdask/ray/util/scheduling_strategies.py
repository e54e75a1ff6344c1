"""``ray.util.scheduling_strategies``: where a task or actor runs."""

from __future__ import annotations

from typing import Any

from yrdask.ray.exceptions import UnsupportedOptionError

__all__ = ["NodeAffinitySchedulingStrategy", "PlacementGroupSchedulingStrategy"]


class NodeAffinitySchedulingStrategy:
    """Run on the node ``node_id`` (a ``ray.nodes()`` NodeID); ``soft=True`` allows others
    when it cannot take the work (a preferred affinity), ``soft=False`` never (required)."""

    def __init__(self, node_id: str, soft: bool, _spill_on_unavailable: bool = False,
                 _fail_on_unavailable: bool = False) -> None:
        if not isinstance(node_id, str) or not node_id:
            raise ValueError(f"node_id must be a non-empty str (a NodeID from ray.nodes()), "
                             f"got {node_id!r}")
        if not isinstance(soft, bool):
            raise TypeError(f"soft must be a bool, got {soft!r}")
        if _spill_on_unavailable or _fail_on_unavailable:
            raise UnsupportedOptionError(
                "NodeAffinitySchedulingStrategy(_spill_on_unavailable/_fail_on_unavailable) is "
                "not supported by yrdask.ray; use soft=True or soft=False")
        self.node_id, self.soft = node_id, soft

    def __repr__(self) -> str:
        return f"NodeAffinitySchedulingStrategy(node_id={self.node_id!r}, soft={self.soft})"


class PlacementGroupSchedulingStrategy:
    """Run inside bundle ``placement_group_bundle_index`` (-1: any) of a placement group.

    ``placement_group_capture_child_tasks=True``: the tasks and actors this work creates
    without a scheduling strategy of their own run in the same group (any bundle), and so
    do theirs, as in Ray."""

    def __init__(self, placement_group: Any, placement_group_bundle_index: int = -1,
                 placement_group_capture_child_tasks: bool | None = None) -> None:
        if not hasattr(placement_group, "_apply") or not hasattr(placement_group,
                                                                 "bundle_count"):
            raise TypeError("placement_group must be a PlacementGroup from "
                            f"ray.util.placement_group(), got {type(placement_group).__name__}")
        index = placement_group_bundle_index
        if isinstance(index, bool) or not isinstance(index, int) or not \
                -1 <= index < placement_group.bundle_count:
            raise ValueError(f"placement_group_bundle_index must be -1 or in [0, "
                             f"{placement_group.bundle_count}), got {index!r}")
        if placement_group_capture_child_tasks not in (None, True, False):
            raise TypeError("placement_group_capture_child_tasks must be a bool or None, got "
                            f"{placement_group_capture_child_tasks!r}")
        self.placement_group = placement_group
        self.placement_group_bundle_index = index
        self.placement_group_capture_child_tasks = placement_group_capture_child_tasks

    def apply(self, inv: Any) -> None:
        """Point yr options at the group's bundle."""
        self.placement_group._apply(inv, self.placement_group_bundle_index)
