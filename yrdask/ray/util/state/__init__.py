"""``ray.util.state``: Ray's state API (list, get and summary calls) over the scheduler's
records (docs/migrating-from-ray.md, "ray.util.state")."""

from __future__ import annotations

from yrdask.ray.util.state.api import (get_actor, list_actors, list_nodes, list_objects,
                                       list_placement_groups, list_tasks, list_workers,
                                       summarize_actors, summarize_objects, summarize_tasks)
from yrdask.ray.util.state.common import (ActorState, NodeState, ObjectState,
                                          PlacementGroupState, TaskState, WorkerState)
from yrdask.ray.util.state.exception import RayStateApiException

__all__ = sorted(["get_actor", "list_actors", "list_nodes", "list_objects",
                  "list_placement_groups", "list_tasks", "list_workers", "summarize_actors",
                  "summarize_objects", "summarize_tasks", "ActorState", "NodeState",
                  "ObjectState", "PlacementGroupState", "TaskState", "WorkerState",
                  "RayStateApiException"])
