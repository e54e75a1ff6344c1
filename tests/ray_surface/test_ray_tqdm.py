"""``ray.experimental.tqdm_ray``: bars of tasks and actors are drawn by the driver.

A bar in a task or actor sends its state to the driver as a printed line (the worker's print
forwarding), and the driver draws it instead of printing that line: one bar per bar, labelled
with where it runs as prints are, each state once, ``(done)`` when it closes.  This machine
has no ``tqdm`` package, so the driver writes each state as a text line; the bar manager's
rules are also checked on their own, without a cluster.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from yrdask.ray.experimental.tqdm_ray import LINE_PREFIX, RAY_TQDM_MAGIC, _BarManager

pytestmark = pytest.mark.timeout(120)

SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
ROOT = SCRIPTS.parents[2]


def _state(uuid: str, x: int, total: int | None = 4, desc: str = "bar", closed: bool = False,
           pos: int = 0) -> str:
    return json.dumps({"__magic_token__": RAY_TQDM_MAGIC, "x": x, "pos": pos, "desc": desc,
                       "total": total, "unit": "it", "pid": 1, "uuid": uuid,
                       "closed": closed})


def test_the_driver_writes_each_new_state_once_and_frees_lines_of_closed_bars():
    out = io.StringIO()
    mgr = _BarManager(out=out, use_tqdm=False)
    line = _state("a", 1)
    assert line.startswith(LINE_PREFIX)
    mgr.process_line("f pid=1, node=n", line)
    mgr.process_line("f pid=1, node=n", line)  # the same state again: nothing new
    mgr.process_line("g pid=2, node=n", _state("b", 0, total=None, desc="other"))
    assert [b.position for b in mgr.bars.values()] == [0, 1]
    mgr.process_line("f pid=1, node=n", _state("a", 4, closed=True))
    assert list(mgr.bars) == ["b"] and mgr.closed == 1
    mgr.process_line("h pid=3, node=n", _state("c", 2))
    assert mgr.bars["c"].position == 0  # the closed bar's line is free again
    assert out.getvalue().splitlines() == [
        "(f pid=1, node=n) bar: 1/4 it",
        "(g pid=2, node=n) other: 0/? it",
        "(f pid=1, node=n) bar: 4/4 it (done)",
        "(h pid=3, node=n) bar: 2/4 it",
    ]


def test_bars_of_a_task_an_actor_and_the_driver_reach_the_driver(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    env.pop("YR_SERVER_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", str(SCRIPTS / "tqdm_bars.py")],
                         capture_output=True, text=True, timeout=100, env=env,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    task_pid, actor_pid = re.search(r"pids (\d+) (\d+)", out.stdout).groups()
    assert RAY_TQDM_MAGIC not in out.stdout + out.stderr  # drawn, never printed raw
    bars = [re.sub(r"node=[^)]*\)", "node=N)", line) for line in out.stderr.splitlines()
            if " it" in line]
    task, actor = f"(count pid={task_pid}, node=N) ", f"(Walker pid={actor_pid}, node=N) "
    # each source's lines in order (the sources' batches arrive in any order)
    assert [b for b in bars if b.startswith(task)] == [
        task + "task-bar: 1/3 it", task + "task-bar: 2/3 it", task + "task-bar: 3/3 it",
        task + "task-bar: 3/3 it (done)"], out.stderr[-3000:]
    assert [b for b in bars if b.startswith(actor)] == [
        actor + "actor-bar: 1/2 it", actor + "actor-bar: 2/2 it",
        actor + "actor-closed: 1/1 it", actor + "actor-closed: 1/1 it (done)"], out.stderr[-3000:]
    assert [b for b in bars if b.startswith("driver")] == [
        "driver-bar: 1/2 it", "driver-bar: 2/2 it"], out.stderr[-3000:]
    assert len(bars) == 10, out.stderr[-3000:]
