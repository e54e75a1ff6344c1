"""Thousands of seeded scenarios through the real state machines (issue 11).

``YRDASK_SIM_SEEDS`` sets how many seeds run (default 10 000, in ``CHUNKS`` chunks).  Each
chunk runs in a subprocess with ``PYTHONHASHSEED=0`` so that a failing seed replays exactly:
``PYTHONHASHSEED=0 python -m tests.sim --seed N`` prints its whole story.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim import machines as M

ROOT = Path(__file__).resolve().parents[2]
TOTAL = int(os.environ.get("YRDASK_SIM_SEEDS", "10000"))
CHUNKS = 10
FIRST = int(os.environ.get("YRDASK_SIM_FIRST", "0"))

needs_machines = pytest.mark.skipif(not all(M.available().values()),
                                     reason=f"machines not all importable: {M.available()}")


def _chunk(i: int) -> range:
    size = -(-TOTAL // CHUNKS)
    return range(FIRST + i * size, FIRST + min(TOTAL, (i + 1) * size))


@needs_machines
@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_seeded_scenarios(chunk: int) -> None:
    """Every scenario of the chunk ends with every task settled once, as expected, nothing
    held or pending, and each machine's validate() held after every step."""
    seeds = _chunk(chunk)
    if not seeds:
        pytest.skip("no seeds in this chunk")
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sim", "--seeds", f"{seeds.start}:{seeds.stop}",
         "--tail", "60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    assert f"{len(seeds)} seeds in" in proc.stdout, proc.stdout


@needs_machines
def test_seed_replays_identically() -> None:
    """The same seed gives the same story (replay by number works)."""
    from tests.sim.replay import run_seed, story

    for seed in (3, 17, 101):
        assert story(run_seed(seed)) == story(run_seed(seed))


@pytest.fixture
def standins():
    """The world on the minimal stand-in queues of standins.py (tests the harness itself)."""
    saved = (M.sq, M.lq, M.new_submit_queue, M.new_lease_queue)
    M.use_standins()
    yield
    M.sq, M.lq, M.new_submit_queue, M.new_lease_queue = saved


def test_world_runs_on_standins(standins) -> None:
    """The harness (network, timers, faults, programs, checks) passes with correct queues."""
    from tests.sim.replay import run_seeds

    n, failures = run_seeds(range(300))
    assert n == 300 and not failures, failures[0][1] if failures else ""


class _Lossy:
    """A submit queue that swallows every TaskFailed (a machine bug to catch)."""

    def __init__(self, queue) -> None:
        self.queue = queue

    def handle(self, event):
        return [i for i in self.queue.handle(event) if type(i).__name__ != "TaskFailed"]

    def __getattr__(self, name):
        return getattr(self.queue, name)


def test_harness_reports_a_lost_settlement(standins) -> None:
    """A lost settlement is caught as a hang; the report names the stuck task, the seed and
    the replay command."""
    from tests.sim import world as W
    from tests.sim.replay import failure_report
    from tests.sim.scenario import make_scenario

    seed = next(s for s in range(2000) if any(
        p.expected()[0] == "error" for p in _tops(make_scenario(s))))
    real = M.new_submit_queue
    M.new_submit_queue = lambda local_worker, **kw: _Lossy(real(local_worker, **kw))
    with pytest.raises(W.SimFailure) as info:
        W.World(seed, make_scenario(seed)).run()
    report = failure_report(seed, info.value)
    assert "hang" in info.value.message, report
    assert f"--seed {seed}" in report and info.value.keys[0] in report, report


def test_harness_reports_a_double_settlement(standins) -> None:
    """A task settled twice is caught at once."""
    from tests.sim import world as W
    from tests.sim.scenario import make_scenario

    real = M.new_submit_queue

    class Twice(_Lossy):
        def handle(self, event):
            out = self.queue.handle(event)
            return out + [i for i in out if type(i).__name__ == "TaskSucceeded"]

    M.new_submit_queue = lambda local_worker, **kw: Twice(real(local_worker, **kw))
    with pytest.raises(W.SimFailure) as info:
        W.World(0, make_scenario(0)).run()
    assert "settled twice" in info.value.message or "without a successful" in info.value.message


def _tops(sc):
    return [p for d in sc.drivers for _, progs in d.batches for p in progs]


def test_standin_seed_replays_identically(standins) -> None:
    """Replay by number: the same seed tells the same story."""
    from tests.sim.replay import run_seed, story

    for seed in (5, 40):
        assert story(run_seed(seed)) == story(run_seed(seed))


CALL_SEEDS = int(os.environ.get("YRDASK_SIM_CALL_SEEDS", "4000"))


@pytest.mark.skipif(not M.importable("yrdask.runtime.call_order"), reason="no CallOrder yet")
@pytest.mark.parametrize("chunk", range(2))
def test_instance_call_scenarios(chunk: int) -> None:
    """Instance calls through the real CallOrder with worker deaths and restarts: each call
    settles once, per-caller order holds in every incarnation, an answered call is never
    sent again, failures only from a failed argument or a dead instance."""
    from tests.sim.calls import run_call_seed
    from tests.sim.world import SimFailure

    half = CALL_SEEDS // 2
    for seed in range(chunk * half, (chunk + 1) * half):
        try:
            run_call_seed(seed)
        except SimFailure as e:
            pytest.fail(f"call seed {seed}: {e.message}\nreplay: python -m tests.sim --calls "
                        f"--seed {seed}\n{e.world.story(60)}")


@pytest.mark.skipif(not M.importable("yrdask.runtime.call_order"), reason="no CallOrder yet")
def test_call_harness_catches_reordered_redelivery(monkeypatch) -> None:
    """A CallOrder that puts lost calls behind the queued ones (instead of in front) breaks
    per-caller order after a restart: the call world must say so."""
    from yrdask.runtime import call_order as C
    from tests.sim.calls import run_call_seed
    from tests.sim.world import SimFailure

    def requeue_behind(self, ev, out):
        for route in list(self.routes.values()):
            if route.worker == ev.worker:
                resend = list(route.inflight.values())
                route.inflight.clear()
                route.queue.extend(resend)
                route.worker, route.lost = None, ev.worker
                self._pump(route, ev.stimulus_id, out)

    monkeypatch.setattr(C.CallOrder, "_channel_lost", requeue_behind)
    monkeypatch.setattr(C.CallOrder, "validate", lambda self: None)
    messages = []
    for seed in range(3000):
        try:
            run_call_seed(seed)
        except SimFailure as e:
            messages.append(e.message)
            break
    assert messages and messages[0].startswith("order:"), messages
