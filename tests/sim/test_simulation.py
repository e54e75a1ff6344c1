"""Thousands of seeded scenarios through the real state machines.

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
TOTAL = int(os.environ.get("YRDASK_SIM_SEEDS", "20000"))
CHUNKS = 20
FIRST = int(os.environ.get("YRDASK_SIM_FIRST", "0"))

needs_machines = pytest.mark.skipif(not all(M.available().values()),
                                     reason=f"machines not all importable: {M.available()}")


def _chunk(i: int) -> range:
    size = -(-TOTAL // CHUNKS)
    return range(FIRST + i * size, FIRST + min(TOTAL, (i + 1) * size))


def _run_chunks(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run ``python -m tests.sim ARGV`` for each argv, as many at once as there are cores
    (each chunk is one process, ``PYTHONHASHSEED=0`` so a failing seed replays exactly)."""
    from concurrent.futures import ThreadPoolExecutor

    env = dict(os.environ, PYTHONHASHSEED="0")

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tests.sim", *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=580)

    with ThreadPoolExecutor(max(1, min(len(argvs), os.cpu_count() or 1))) as pool:
        return list(pool.map(run, argvs))


@needs_machines
@pytest.mark.timeout(600)  # about 50 s of CPU; the bound leaves room for a loaded machine
def test_seeded_scenarios() -> None:
    """Every scenario (``TOTAL`` seeds, 20 000 by default, in ``CHUNKS`` processes run side
    by side) ends with every task settled once, as expected, nothing held or pending; each
    machine's validate(), capacity and conservation held after every step."""
    chunks = [c for c in (_chunk(i) for i in range(CHUNKS)) if c]
    procs = _run_chunks([["--seeds", f"{c.start}:{c.stop}", "--tail", "60"] for c in chunks])
    races: dict[str, int] = {}
    for seeds, proc in zip(chunks, procs):
        assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
        assert f"{len(seeds)} seeds in" in proc.stdout, proc.stdout
        _add_race_line(races, proc.stdout)
    # the race branches ran (a peer gone for the scheduler's adapter, not yet its machines)
    if TOTAL >= 2000:
        assert races and all(races.values()), races


def _add_race_line(races: dict[str, int], stdout: str) -> None:
    """Sum the ``race branches taken: what n, ...`` line of a chunk into ``races``."""
    line = next(x for x in stdout.splitlines() if x.startswith("race branches taken: "))
    for part in line.removeprefix("race branches taken: ").split(", "):
        what, _, n = part.rpartition(" ")
        races[what] = races.get(what, 0) + int(n)


@needs_machines
def test_seed_replays_identically() -> None:
    """The same seed gives the same story (replay by number works)."""
    from tests.sim.replay import run_seed, story

    for seed in (3, 17, 101):
        assert story(run_seed(seed)) == story(run_seed(seed))


@needs_machines
def test_race_branches_run() -> None:
    """With the seeded delay between "the adapter knows a peer is gone" and "the machines
    hear it" (``machines.GONE_DELAYS``), the race branches run: a grant for a requester
    already gone, a grant on a worker Dask already removed (task world), a stop for a
    worker already removed (instance world); with no delay, none does."""
    from tests.sim.calls import run_call_seed
    from tests.sim.replay import run_seed

    races: dict[str, int] = {}
    for seed in range(150, 230):
        for what, n in run_seed(seed).races.items():
            races[what] = races.get(what, 0) + n
    for seed in range(80, 160):
        for what, n in run_call_seed(seed).races.items():
            races[what] = races.get(what, 0) + n
    assert len(races) == 3 and all(races.values()), races


@needs_machines
def test_no_race_branch_without_the_delay(monkeypatch) -> None:
    from tests.sim.replay import run_seed

    monkeypatch.setattr(M, "GONE_DELAYS", (0.0,))
    for seed in (154, 167, 190, 221):
        assert not any(run_seed(seed).races.values())


class _Lossy:
    """A submit queue that swallows every TaskFailed (a machine bug to catch)."""

    def __init__(self, queue) -> None:
        self.queue = queue

    def handle(self, event):
        return [i for i in self.queue.handle(event) if type(i).__name__ != "TaskFailed"]

    def __getattr__(self, name):
        return getattr(self.queue, name)


def test_harness_reports_a_lost_settlement(monkeypatch) -> None:
    """A lost settlement is caught as a hang; the report names the stuck task, the seed and
    the replay command."""
    from tests.sim import world as W
    from tests.sim.replay import failure_report
    from tests.sim.scenario import make_scenario

    seed = next(s for s in range(2000) if any(
        p.expected()[0] == "error" for p in _tops(make_scenario(s))))
    real = M.new_submit_queue
    monkeypatch.setattr(M, "new_submit_queue",
                        lambda local_worker, **kw: _Lossy(real(local_worker, **kw)))
    with pytest.raises(W.SimFailure) as info:
        W.World(seed, make_scenario(seed)).run()
    report = failure_report(seed, info.value)
    assert "hang" in info.value.message, report
    assert f"--seed {seed}" in report and info.value.keys[0] in report, report


def test_harness_reports_a_double_settlement(monkeypatch) -> None:
    """A task settled twice is caught at once."""
    from tests.sim import world as W
    from tests.sim.scenario import make_scenario

    real = M.new_submit_queue

    class Twice(_Lossy):
        def handle(self, event):
            out = self.queue.handle(event)
            return out + [i for i in out if type(i).__name__ == "TaskSucceeded"]

    monkeypatch.setattr(M, "new_submit_queue",
                        lambda local_worker, **kw: Twice(real(local_worker, **kw)))
    with pytest.raises(W.SimFailure) as info:
        W.World(0, make_scenario(0)).run()
    assert "settled twice" in info.value.message or "without a successful" in info.value.message


def _tops(sc):
    return [p for d in sc.drivers for _, progs in d.batches for p in progs]


CALL_SEEDS = int(os.environ.get("YRDASK_SIM_CALL_SEEDS", "4000"))
CALL_CHUNKS = 4
needs_instance_machines = pytest.mark.skipif(
    not all(M.importable(m) for m in ("yrdask.runtime.call_order", "yrdask.scheduler.lifecycle",
                                      "yrdask.scheduler.leases")),
    reason="instance machines not all importable")


@needs_instance_machines
@pytest.mark.timeout(600)  # about 20 s of CPU
def test_instance_scenarios() -> None:
    """Instances through the real CallOrder, Lifecycle and LeaseQueue (owner tree, names,
    handles in transit, releases, kills, worker deaths and restarts, driver exits, task
    leases in the same ledger): every call settles once with a value or an allowed error,
    per-caller order holds in each incarnation, nothing that should have ended lives on,
    nothing is held or pending at the end, validate() and capacity hold after every step.
    Only the exact seeds of a known finding (calls.KNOWN_FINDINGS) may fail."""
    size = -(-CALL_SEEDS // CALL_CHUNKS)
    bounds = [(i * size, min(CALL_SEEDS, (i + 1) * size)) for i in range(CALL_CHUNKS)]
    bounds = [(a, b) for a, b in bounds if a < b]
    procs = _run_chunks([["--calls", "--seeds", f"{a}:{b}", "--keep-going"] for a, b in bounds])
    races: dict[str, int] = {}
    for (a, b), proc in zip(bounds, procs):
        assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
        assert f"{b - a} call seeds in" in proc.stdout, proc.stdout + proc.stderr
        _add_race_line(races, proc.stdout)
    if CALL_SEEDS >= 1000:  # a stop for a worker already removed ran
        assert races and all(races.values()), races


# The exact seeds of the instance world's findings still open (calls.KNOWN_FINDINGS,
# FINDINGS.md): message prefix -> seed.
def _known_seeds() -> dict[str, int]:
    try:
        from tests.sim.calls import KNOWN_FINDINGS
    except ImportError:
        return {}
    return {prefix: seed for seed, (prefix, _section) in KNOWN_FINDINGS.items()}


KNOWN_FINDING_SEEDS = _known_seeds()

# The recorded seeds of findings that are fixed: they must run clean (regressions).
FIXED_FINDING_SEEDS = {
    "creation overtaken (handle reports):": 22,  # A, its handle half
    "creation overtaken (holder re-added):": 243,
    "creation overtaken (locate):": 45,  # A, its locate half
    "creation overtaken (locate, 2):": 338,
    "orphan:": 90,  # B
    "placed on a lost worker:": 1552,  # C
    "acquire after its cancel:": 5283,  # D
    "created after its job ended:": 4409,  # E
    "restart died before it came up:": 6,  # H
    "cancelled before it left, in a process instance:": 603,  # J
    "cancelled before it left, on a worker:": 910,  # J
}


def _replay(seed: int, tail: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONHASHSEED="0")
    return subprocess.run(
        [sys.executable, "-m", "tests.sim", "--calls", "--seed", str(seed), "--tail", str(tail)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@needs_instance_machines
@pytest.mark.parametrize("finding", sorted(FIXED_FINDING_SEEDS))
def test_instance_fixed_findings_stay_fixed(finding: str) -> None:
    """The recorded seed of a fixed finding runs clean."""
    proc = _replay(FIXED_FINDING_SEEDS[finding], 80)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]


@needs_instance_machines
@pytest.mark.xfail(reason="known findings still open (FINDINGS.md); passes once fixed",
                   strict=False)
@pytest.mark.parametrize("finding", sorted(KNOWN_FINDING_SEEDS))
def test_instance_known_findings_fixed(finding: str) -> None:
    """The recorded seed of a known finding runs clean (xfail until it is fixed)."""
    proc = _replay(KNOWN_FINDING_SEEDS[finding], 80)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]


@needs_instance_machines
def test_known_finding_seeds_still_reproduce() -> None:
    """Each recorded seed fails with its own finding today, and its replay names it (the
    record in FINDINGS.md stays true until the fix lands; then update both)."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    for prefix, seed in KNOWN_FINDING_SEEDS.items():
        proc = subprocess.run(
            [sys.executable, "-m", "tests.sim", "--calls", "--seed", str(seed), "--tail", "20"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            continue  # fixed: the xfail test above now passes
        assert f"seed {seed} failed: {prefix}" in proc.stdout, proc.stdout[-3000:]
        assert "known finding: FINDINGS.md" in proc.stdout, proc.stdout[-3000:]


@needs_instance_machines
def test_instance_seed_replays_identically() -> None:
    """Replay by number: the same instance seed tells the same story (in one process)."""
    from tests.sim.calls import run_call_seed

    for seed in (3, 17, 101):
        assert run_call_seed(seed).story(10_000) == run_call_seed(seed).story(10_000)


@needs_instance_machines
def test_call_harness_catches_reordered_redelivery(monkeypatch) -> None:
    """A CallOrder that puts lost calls behind the queued ones (instead of in front) breaks
    per-caller order after a restart: the instance world must say so."""
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
            if "order:" in e.message.split("\n")[0]:
                break
    assert messages and "order:" in messages[-1], messages[-5:]


@needs_instance_machines
def test_instance_harness_catches_a_release_that_ignores_holders(monkeypatch) -> None:
    """A lifecycle that ends instances whose holders are still there is caught."""
    from yrdask.scheduler import lifecycle as L
    from tests.sim.calls import run_call_seed
    from tests.sim.world import SimFailure

    monkeypatch.setattr(L.Lifecycle, "releasable", lambda self, iid: (
        iid in self.instances and self.instances[iid].state != "DEAD"
        and self.instances[iid].refcounted))
    monkeypatch.setattr(L.Lifecycle, "validate", lambda self: None)
    for seed in range(500):
        try:
            run_call_seed(seed)
        except SimFailure as e:
            if "released too early" in e.message:
                return
    pytest.fail("no seed caught an instance released while held")
