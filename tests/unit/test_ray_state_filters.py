"""Ray's filter rules of ``ray.util.state`` on rows, without a cluster (the values and errors
Ray 2.60's API server gives for the same filters)."""

from __future__ import annotations

import pytest

from yrdask.ray.util.state.common import (ActorState, TaskState, check_list_args,
                                          conflicting, select, summarize_task_rows)
from yrdask.ray.util.state.exception import RayStateApiException

ROWS = [
    {"actor_id": "i-2", "class_name": "Counter", "state": "DEAD", "name": "", "pid": 12,
     "num_restarts": 1},
    {"actor_id": "i-1", "class_name": "Counter", "state": "ALIVE", "name": "ctr", "pid": 11,
     "num_restarts": 0},
    {"actor_id": "i-3", "class_name": "Other", "state": "PENDING_CREATION", "name": "x",
     "pid": 0, "num_restarts": 0},
]


def ids(filters, limit=100, detail=False):
    return [r.actor_id for r in select(ROWS, ActorState, filters, limit, detail, "actor_id")]


def test_string_filters_ignore_case_and_sort_by_id():
    assert ids([]) == ["i-1", "i-2", "i-3"]
    assert ids([("state", "=", "alive")]) == ["i-1"]
    assert ids([("STATE", "=", "ALIVE")]) == ["i-1"]  # keys are lower-cased
    assert ids([("class_name", "!=", "counter")]) == ["i-3"]
    assert ids([("class_name", "=", "Counter"), ("state", "!=", "dead")]) == ["i-1"]
    assert ids([], limit=2) == ["i-1", "i-2"]


def test_int_columns_compare_as_ints_on_equality_only():
    assert ids([("pid", "=", "12")]) == ["i-2"]
    assert ids([("pid", "=", 11)]) == ["i-1"]
    assert ids([("pid", "!=", "12")]) == ["i-1", "i-2", "i-3"]  # as Ray: no conversion
    with pytest.raises(RayStateApiException, match="Failed to convert a value abc"):
        ids([("pid", "=", "abc")])


def test_detail_columns_only_with_detail():
    plain, = select(ROWS[1:2], ActorState, [], 10, False, "actor_id")
    full, = select(ROWS[1:2], ActorState, [], 10, True, "actor_id")
    assert plain.num_restarts is None and full.num_restarts == 0
    assert plain["name"] == plain.get("name") == "ctr" and plain.asdict()["state"] == "ALIVE"


def test_unfilterable_and_unknown_columns_are_refused():
    with pytest.raises(RayStateApiException, match="filter column num_restarts is not "):
        ids([("num_restarts", "=", 0)])  # a detail column Ray does not filter on
    with pytest.raises(RayStateApiException, match="Supported filter columns"):
        select([], TaskState, [("nope", "=", 1)], 10, False, "task_id")


@pytest.mark.parametrize("kwargs, error, text", [
    ({"filters": [("state", ">", 1)]}, ValueError, "Unsupported filter predicate >"),
    ({"filters": [("state", "=")]}, ValueError, "incorrect input type"),
    ({"filters": "state=ALIVE"}, ValueError, "list of \\(key, predicate, value\\)"),
    ({"limit": 10_001}, RayStateApiException, "exceeds the supported limit 10000"),
    ({"limit": -1}, RayStateApiException, "0 or more"),
    ({"limit": "a"}, ValueError, "limit must be an int"),
    ({"detail": "x"}, ValueError, "detail must be a bool"),
    ({"timeout": 0}, ValueError, "timeout must be a positive"),
])
def test_bad_arguments_get_rays_errors(kwargs, error, text):
    args = {"filters": None, "limit": 100, "detail": False, "timeout": 30} | kwargs
    with pytest.raises(error, match=text):
        check_list_args(**args)


def test_conflicting_equalities_warn_and_match_nothing():
    with pytest.warns(UserWarning, match="different values'ALIVE' & 'DEAD'"):
        assert conflicting([("state", "=", "ALIVE"), ("state", "=", "DEAD")])
    assert not conflicting([("state", "=", "ALIVE"), ("state", "!=", "DEAD")])


def test_task_summary_counts_by_name_and_type():
    rows = [{"name": "f", "type": "NORMAL_TASK", "state": "FINISHED"},
            {"name": "f", "type": "NORMAL_TASK", "state": "FAILED"},
            {"name": "f", "type": "NORMAL_TASK", "state": "RUNNING", "count": 2},
            {"name": "C.m", "type": "ACTOR_TASK", "state": "FINISHED"},
            {"name": "C.__init__", "type": "ACTOR_CREATION_TASK", "state": "FINISHED"}]
    out = summarize_task_rows(rows)
    assert out["summary"]["f"] == {"func_or_class_name": "f", "type": "NORMAL_TASK",
                                   "state_counts": {"FINISHED": 1, "FAILED": 1, "RUNNING": 2}}
    assert (out["total_tasks"], out["total_actor_tasks"], out["total_actor_scheduled"]) \
        == (4, 1, 1)
