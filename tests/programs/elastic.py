"""The elastic program (SPEC §9) that tests/test_deployers.py runs on each Dask deployer.

From an adaptive cluster at zero workers it runs yr tasks, reserves resource groups, creates a
named instance that checkpoints with ``yr.save_state()`` and puts a 200 MB array; then it lets
the cluster scale back down and checks that nothing was lost. Each claim is a *part* with its
own verdict, so one run on a deployer says exactly which of them hold:

``scale_from_zero``      yr tasks submitted at zero workers run: the cluster grew for them
``scale_up_for_group``   a STRICT_SPREAD group of ``maximum`` bundles is placed: it grew to that
``work``                 on the grown cluster: the instance answers, the object reads back in a
                         task, each spread bundle runs a task in a process of its own
``scale_down``           idle again, the cluster shrinks to at most one worker
``instance_kept``        after it: the instance answers by name, with its checkpointed state
``object_kept``          the 200 MB object reads back equal, in the driver and in a task
``results_kept``         the tasks' results read back right
``group_kept``           the group that stayed reserved is READY again and runs a task

A part that fails does not stop the run: when the cluster did not grow by itself, the program
holds it at ``maximum`` workers (``adapt(maximum, maximum)``) so that the parts after it are
still tried, and lets it go (``adapt(0, maximum)``) before ``scale_down``.  Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any, Callable

import numpy as np

import yrdask as yr

PARTS = ("scale_from_zero", "scale_up_for_group", "work", "scale_down", "instance_kept",
         "object_kept", "results_kept", "group_kept")
INSTANCE_NAME = "elastic-counter"
BIG_MB = 200
#: small requests, so that a 1-thread worker holds the instance, the bundles and a task at once
SMALL = yr.InvokeOptions(cpu=100, memory=64)
BUNDLE = {"CPU": 100, "Memory": 64}


@dataclasses.dataclass
class Part:
    """One claim of the program: ``ok`` None while it was not tried, with why in ``detail``."""

    name: str
    ok: bool | None = None
    detail: str = "not reached"

    def __str__(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "NOT RUN"}[self.ok]
        return f"{self.name}: {verdict}: {self.detail}"


@dataclasses.dataclass
class Timeouts:
    """Bounds, in seconds, of the waits for the deployer: a worker is a process (local), a
    batch job (Slurm) or a gateway-started process, and the machine is shared."""

    up: float = 30
    down: float = 30
    call: float = 20


@yr.invoke
def square(x: int) -> int:
    return x * x


@yr.invoke
def digest(arr: np.ndarray) -> str:
    """The array's SHA-1, computed where the task runs (so the object travelled there)."""
    return hashlib.sha1(memoryview(arr).cast("B")).hexdigest()


@yr.invoke
def process_id() -> int:
    return os.getpid()


@yr.instance
class Counter:
    """A stateful instance that checkpoints after every change."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, x: int) -> int:
        self.total += x
        yr.save_state()
        return self.total

    def value(self) -> int:
        return self.total


def run(adapt: Callable[[int, int], Any], workers: Callable[[], int], config: yr.Config,
        maximum: int = 2, timeouts: Timeouts = Timeouts(),
        diagnose: Callable[[], str] = lambda: "") -> dict[str, Part]:
    """Run the program on a deployer and return each part's verdict.

    ``adapt(minimum, maximum)`` makes the cluster adaptive within those bounds, ``workers()``
    counts its workers as its scheduler sees them, ``config`` joins yr's driver to it, and
    ``diagnose()`` describes the scheduler's view for failure messages (adaptive target...).
    """
    parts = {name: Part(name) for name in PARTS}
    state = _Run(adapt, workers, maximum, timeouts, diagnose, parts)
    adapt(0, maximum)
    if not state.wait_workers(lambda n: n == 0, timeouts.up):
        raise AssertionError(f"the cluster did not start at zero workers: {state.describe()}")
    yr.init(config)
    try:
        state.program()
    finally:
        yr.finalize()
    return parts


class _Run:
    def __init__(self, adapt, workers, maximum, timeouts, diagnose, parts) -> None:
        self.adapt, self.workers, self.maximum = adapt, workers, maximum
        self.t, self.diagnose, self.parts = timeouts, diagnose, parts
        self.held = False  # the cluster is held at ``maximum`` because it did not grow itself
        self.history: list[int] = []

    def describe(self) -> str:
        extra = self.diagnose()
        return f"worker counts seen {self.history[-12:]}" + (f"; {extra}" if extra else "")

    def wait_workers(self, done: Callable[[int], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            n = self.workers()
            if not self.history or self.history[-1] != n:
                self.history.append(n)
            if done(n):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def hold(self) -> None:
        """Hold the cluster at ``maximum`` so the next parts can be tried without growth."""
        if not self.held:
            self.held = True
            self.adapt(self.maximum, self.maximum)
            if not self.wait_workers(lambda n: n >= self.maximum, self.t.up):
                raise AssertionError(f"the cluster did not reach {self.maximum} workers even when "
                                     f"held there: {self.describe()}")

    def grow(self, name: str, wait: Callable[[], Any], shown: str, missing: str) -> bool:
        """``wait()`` (bounded) for work that needs the cluster to grow.  On a yr error the part
        fails, saying ``missing``, and the cluster is held at ``maximum``: returns False."""
        part = self.parts[name]
        try:
            wait()
        except yr.YRError as exc:
            part.ok, part.detail = False, f"{missing} ({exc!s:.300}); {self.describe()}"
            self.hold()
            return False
        part.ok = None if self.held else True
        part.detail = ("not shown: the cluster was held at maximum" if self.held
                       else f"{shown}; {self.describe()}")
        return True

    def program(self) -> None:
        p, t = self.parts, self.t
        # -- scale from zero: yr tasks are demand
        expected = [i * i for i in range(6)]
        refs = [square.options(SMALL).invoke(i) for i in range(6)]
        if not self.grow("scale_from_zero", lambda: yr.get(refs, timeout=int(t.up)),
                         "6 yr tasks submitted at zero workers ran",
                         f"yr tasks submitted at zero workers did not finish in {t.up:.0f} s: "
                         f"the cluster did not grow for yr work"):
            # they may have failed meanwhile ("can never run"): submit them again, so that
            # results_kept checks the results of tasks that ran
            refs = [square.options(SMALL).invoke(i) for i in range(6)]
        # -- scale up for a group: each STRICT_SPREAD bundle needs a worker of its own
        spread = yr.create_resource_group([BUNDLE] * self.maximum, strategy="STRICT_SPREAD")
        if not self.grow("scale_up_for_group", lambda: spread.wait(int(t.up)),
                         f"{self.maximum} STRICT_SPREAD bundles placed",
                         f"a STRICT_SPREAD group of {self.maximum} bundles was not placed in "
                         f"{t.up:.0f} s"):
            spread.wait(int(t.up))
        # -- the work, on the grown cluster
        kept = yr.create_resource_group([BUNDLE], name="elastic-kept")
        big = np.arange(BIG_MB * 2**20 // 8, dtype=np.float64)
        big_sha = hashlib.sha1(memoryview(big).cast("B")).hexdigest()
        big_ref = yr.put(big)
        counter = Counter.options(yr.InvokeOptions(name=INSTANCE_NAME, cpu=200, memory=128)).invoke()
        checks = {
            "the first tasks' results are right":
                lambda: yr.get(refs, timeout=int(t.call)) == expected,
            "instance counts 1,2,3 (checkpointing each)":
                lambda: yr.get([counter.add.invoke(1) for _ in range(3)], timeout=int(t.call)) == [1, 2, 3],
            f"the {BIG_MB} MB object reads back in a task":
                lambda: yr.get(digest.options(SMALL).invoke(big_ref), timeout=int(t.call)) == big_sha,
            "each spread bundle runs a task in a process of its own":
                lambda: len(set(yr.get([_in_group(process_id, spread.name, i).invoke()
                                        for i in range(self.maximum)], timeout=int(t.call))))
                == self.maximum,
            "the kept group is placed": lambda: kept.wait(int(t.call)) is None,
        }
        p["work"] = _checks("work", checks)
        yr.remove_resource_group(spread)
        # -- scale down: idle now, the cluster shrinks (the instance may keep a worker)
        if self.held:
            self.held = False
            self.adapt(0, self.maximum)
        peak = self.workers()
        shrunk = self.wait_workers(lambda n: n <= 1, t.down)
        p["scale_down"] = Part(
            "scale_down", shrunk,
            f"from {peak} to {self.history[-1]} workers "
            f"({'within' if shrunk else 'not within'} {t.down:.0f} s); {self.describe()}")
        # -- nothing lost: the checks share one bound (a missing worker fails them all at once)
        deadline = time.monotonic() + t.call

        def left() -> int:
            return max(1, int(deadline - time.monotonic()))

        p["instance_kept"] = _checks("instance_kept", {
            "it answers by name with its checkpointed state (3)":
                lambda: yr.get(yr.get_instance(INSTANCE_NAME, timeout=left()).value.invoke(),
                               timeout=left()) == 3,
            "it goes on counting from there":
                lambda: yr.get(counter.add.invoke(1), timeout=left()) == 4,
        })
        p["object_kept"] = _checks("object_kept", {
            "the driver reads it back equal":
                lambda: bool(np.array_equal(yr.get(big_ref, timeout=left()), big)),
            "a task reads it back equal":
                lambda: yr.get(digest.options(SMALL).invoke(big_ref), timeout=left()) == big_sha,
        })
        p["results_kept"] = _checks("results_kept", {
            "the first tasks' results read back right":
                lambda: yr.get(refs, timeout=left()) == expected,
        })
        p["group_kept"] = _checks("group_kept", {
            "the kept group is READY again": lambda: kept.wait(left()) is None,
            "a task runs in it": lambda: isinstance(
                yr.get(_in_group(process_id, kept.name, 0).invoke(), timeout=left()), int),
        })
        for part in p.values():
            if part.ok is False:
                part.detail += f" [after it: {self.describe()}]"
        for cleanup in (counter.terminate, lambda: yr.remove_resource_group(kept)):
            try:
                cleanup()
            except yr.YRError:
                pass  # lost with its worker: finalize ends what is left


def _in_group(fn, group: str, bundle: int):
    return fn.options(yr.InvokeOptions(
        cpu=100, memory=64, resource_group_options=yr.ResourceGroupOptions(group, bundle)))


def _checks(name: str, checks: dict[str, Callable[[], Any]]) -> Part:
    """A part made of several checks, each tried even if one before it failed."""
    failed = []
    for what, check in checks.items():
        try:
            if not check():
                failed.append(f"{what}: wrong value")
        except Exception as exc:  # noqa: BLE001 -- a check's error is its verdict
            failed.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
    if failed:
        return Part(name, False, "; ".join(failed))
    return Part(name, True, "; ".join(checks))
