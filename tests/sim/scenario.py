"""A scenario from a seed: the cluster, the drivers' programs, and the faults to inject."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tests.sim.programs import Program, make_tree

MEMORY = 100_000.0


@dataclass
class DriverPlan:
    name: str
    batches: list[tuple[float, list[Program]]] = field(default_factory=list)
    exit_at: float | None = None  # exits before its work is done
    cancels: list[tuple[float, int]] = field(default_factory=list)  # (when, top-level index)


@dataclass
class Scenario:
    seed: int
    workers: list[tuple[str, dict]]
    drivers: list[DriverPlan]
    faults: list[tuple[float, str]]
    replace: bool
    sq_kwargs: dict

    def describe(self) -> str:
        lines = [f"seed {self.seed}: workers "
                 + ", ".join(f"{n} CPU {c['CPU']:g}" for n, c in self.workers)
                 + f"; submit queues {self.sq_kwargs}"]
        for d in self.drivers:
            for t, progs in d.batches:
                lines.append(f"  {d.name} at {t:.3f} s submits "
                             + ", ".join(f"{p.path} ({p.size()} tasks)" for p in progs))
            if d.exit_at is not None:
                lines.append(f"  {d.name} exits at {d.exit_at:.3f} s")
            for t, i in d.cancels:
                lines.append(f"  {d.name} cancels its task #{i} at {t:.3f} s")
        for t, what in self.faults:
            lines.append(f"  fault at {t:.3f} s: {what}")
        return "\n".join(lines)


def make_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    nworkers = rng.choice([1, 1, 2, 2, 2, 3])
    workers = [(f"w{i}", {"CPU": float(rng.choice([1000, 1000, 2000])), "Memory": MEMORY})
               for i in range(nworkers)]
    slow = rng.choice([0.0, 0.05, 0.2])
    odd = rng.choice([0.0, 0.05, 0.15])
    budget = rng.randint(4, 24)
    drivers = []
    tree = 0
    for d in range(rng.choice([1, 1, 2])):
        plan = DriverPlan(f"d{d}")
        for b in range(rng.randint(1, 3)):
            t = 0.0 if b == 0 else rng.uniform(0.0, 2.0)
            progs = []
            for _ in range(rng.randint(1, 4)):
                size = rng.randint(1, max(1, budget // 3))
                progs.append(make_tree(rng, str(tree), size, 0, slow, odd))
                tree += 1
            plan.batches.append((t, progs))
        ntops = sum(len(p) for _, p in plan.batches)
        if rng.random() < 0.06:
            # half of them exit right after a submission, with its lease requests in flight
            # (they can reach the scheduler after the job stream's end)
            plan.exit_at = rng.uniform(0.0, 3.0) if rng.random() < 0.5 \
                else plan.batches[-1][0]
        if rng.random() < 0.08:
            plan.cancels.append((rng.uniform(0.0, 2.0), rng.randrange(ntops)))
        drivers.append(plan)
    faults = []
    r = rng.random()
    if r < 0.25:
        faults.append((rng.uniform(0.0, 3.0), "kill"))
    if r < 0.06:
        faults.append((rng.uniform(0.0, 5.0), "kill"))
    sq_kwargs = {"max_crash_retries": rng.choice([1, 3]),
                 "max_pending_requests": rng.choice([1, 4]),
                 "lease_idle_s": 1.0}
    return Scenario(seed, workers, drivers, faults, rng.random() < 0.5 or nworkers == 1,
                    sq_kwargs)
