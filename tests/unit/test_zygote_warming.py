"""Which workers the scheduler tells to start their zygotes, and when
(``scheduler/zygotes.py``, pure)."""
from __future__ import annotations

import pytest

from yrdask.scheduler.zygotes import ZygoteWarming

pytestmark = pytest.mark.timeout(10)

PROCESS = {"isolation": {"env": {}, "cwd": ""}}
LIGHT = {"isolation": None}


def test_the_first_process_instance_tells_every_worker_once_and_each_that_joins_after():
    told: list[str] = []
    w = ZygoteWarming(told.append)
    w.registered("tcp://a:1")
    w.registered("tcp://b:1")
    w.registered("tcp://gone:1")
    w.removed("tcp://gone:1")
    w.placed(LIGHT)
    w.placed({})  # a light instance's spec may leave isolation out
    assert told == []  # tasks and light instances warm nothing
    w.placed(PROCESS)
    assert told == ["tcp://a:1", "tcp://b:1"]
    w.placed(PROCESS)
    assert told == ["tcp://a:1", "tcp://b:1"]  # once per worker
    w.registered("tcp://c:1")  # joins later (or a new process at a lost one's address)
    assert told == ["tcp://a:1", "tcp://b:1", "tcp://c:1"]


def test_disabled_tells_no_worker():
    told: list[str] = []
    w = ZygoteWarming(told.append, enabled=False)
    w.registered("tcp://a:1")
    w.placed(PROCESS)
    w.registered("tcp://b:1")
    assert told == [] and not w.on and not w.waiting
