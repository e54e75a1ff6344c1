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
class GroupPlan:
    """A resource group the first driver creates at ``at`` (``yr.create_resource_group``),
    then runs ``progs`` (leaves) in its bundles; removed at ``remove_at`` (or with the
    driver's job, if that ends first)."""

    name: str
    bundles: list[dict]
    strategy: str
    at: float
    remove_at: float
    progs: list[Program]


@dataclass
class Scenario:
    seed: int
    workers: list[tuple[str, dict]]
    drivers: list[DriverPlan]
    faults: list[tuple[float, str]]
    replace: bool
    sq_kwargs: dict
    groups: list[GroupPlan] = field(default_factory=list)
    refs: bool = False  # top-level tasks hold refs of others (REF_SEEDS)

    def programs(self) -> list[Program]:
        """Every program of the drivers' trees (not the groups'), depth first."""
        out: list[Program] = []
        todo = [p for d in self.drivers for _, progs in d.batches for p in progs][::-1]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(p.children[::-1])
        return out

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
        gens = [p for p in self.programs() if p.generator]
        if gens:
            lines.append("  generators: " + ", ".join(
                f"{p.path} ({p.items} items" + (f", dropped after {p.drop_after}"
                                                if p.drop_after is not None else "") + ")"
                for p in gens))
        refs = [p for p in self.programs() if p.ref_arg is not None]
        if refs:
            lines.append("  ref arguments: " + ", ".join(
                f"{p.path} (an earlier task's ref at {p.ref_arg:.2f}"
                + (f", kept {p.keep_ref:.2f} s" if p.keep_ref else "")
                + (", returned" if p.return_ref else "")
                + (", dropped by the driver once passed" if p.drop_passed else "") + ")"
                for p in refs))
        for g in self.groups:
            lines.append(f"  d0 at {g.at:.3f} s creates group {g.name} ({g.strategy}) of "
                         f"{g.bundles}, runs {len(g.progs)} tasks in it, removes it at "
                         f"{g.remove_at:.3f} s")
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
                 "lease_idle_s": 1.0,
                 # its own stream: drawing it from rng would change every later draw
                 **_pipelining(random.Random(seed * 97 + 11))}
    sc = Scenario(seed, workers, drivers, faults, rng.random() < 0.5 or nworkers == 1,
                  sq_kwargs)
    sc.groups = _groups(seed, sc)
    _generators(seed, sc)
    _ref_args(seed, sc)
    return sc


def _pipelining(rng: random.Random) -> dict:
    """The submit queues' pipelining: the runtime's (depth 8, refill 4) and others."""
    return {"pipeline_depth": rng.choice([4, 8]), "pipeline_refill": rng.choice([1, 2, 3, 4])}


GROUP_SEEDS = 8  # one task seed in GROUP_SEEDS runs resource groups
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _groups(seed: int, sc: Scenario) -> list[GroupPlan]:
    """Resource groups of a seed, from a generator of their own (the other draws stay put);
    in some of them a worker dies while the groups live (bundles lost and placed again), in
    some the driver exits with a group's create on its way."""
    if seed % GROUP_SEEDS != 2:
        return []
    rng = random.Random(seed * 31 + 7)
    if rng.random() < 0.3:
        sc.faults.append((rng.uniform(0.0, 2.5), "kill"))
    plans = []
    for k in range(rng.choice([1, 1, 2])):
        nb = rng.randint(1, 3)
        bundles = [{"CPU": float(rng.choice([500, 1000])), "Memory": 500.0} for _ in range(nb)]
        at = rng.uniform(0.0, 1.0)
        # always removed, often while its tasks run: a group that kept its reservations
        # until the driver ends would starve the other tasks past their timeouts
        remove_at = at + rng.uniform(0.0, 2.0) if rng.random() < 0.6 else at + 3.0
        progs = []
        for i in range(rng.randint(1, 6)):
            prog = Program(f"g{k}.{i}", rng.randrange(1000), _group_duration(rng),
                           group=f"g{k}", bundle=rng.randrange(-1, nb))
            if rng.random() < 0.1:
                prog.retries, prog.fail_first = 1, 1
            progs.append(prog)
        plans.append(GroupPlan(f"g{k}", bundles, rng.choice(STRATEGIES), at, remove_at, progs))
    if sc.drivers[0].exit_at is None and rng.random() < 0.15:
        # the first driver exits right after asking for a group, its create rpc in flight
        # (it can reach the scheduler after the job stream's end)
        sc.drivers[0].exit_at = plans[-1].at + 1e-6
    return plans


def _group_duration(rng: random.Random) -> float:
    r = rng.random()
    return rng.uniform(0.2, 2.0) if r < 0.3 else rng.uniform(0.0005, 0.05)


GEN_SEEDS = 8  # one task seed in GEN_SEEDS runs generators (GEN_SEEDS - 3 of them mod 8)


def _generators(seed: int, sc: Scenario) -> None:
    """Generator tasks of a seed, from a generator of their own (the other draws stay put):
    some leaves become generators that yield 0-6 items, consumed by whoever submitted them
    (the driver, or the task that submitted them); some fail their first attempts halfway,
    some drivers drop a generator before its end, and in half of them a worker dies (often
    mid-stream: the rerun yields the first items again)."""
    if seed % GEN_SEEDS != 5:
        return
    rng = random.Random(seed * 53 + 3)
    tops = {id(p) for d in sc.drivers for _, progs in d.batches for p in progs}
    for prog in sc.programs():
        if not prog.leaf or rng.random() < 0.4:
            continue
        prog.items = rng.randint(0, 6)
        if rng.random() < 0.2:
            prog.retries, prog.fail_first = rng.randint(0, 2), rng.randint(1, 2)
        if id(prog) in tops and rng.random() < 0.2:
            prog.drop_after = rng.randint(0, prog.items)
        prog.compute = max(prog.compute, rng.uniform(0.001, 0.5))  # long enough to die in
    if rng.random() < 0.5:
        sc.faults.append((rng.uniform(0.0, 1.5), "kill"))


REF_SEEDS = 8  # one task seed in REF_SEEDS passes refs as task arguments (6 of them mod 8)


def _ref_args(seed: int, sc: Scenario) -> None:
    """Ref arguments of a seed, from a generator of their own (the other draws stay put):
    half the top-level tasks of each driver get the ref of an earlier one of the same driver
    (often still pending) nested in their argument, and so do half the children of a task
    (a sibling's ref, owned by the worker that runs the parent), and the driver often drops its own ref
    once passed; some keep it on their worker after they end, some return it in their
    result; in some a worker dies or a driver exits early."""
    if seed % REF_SEEDS != 6:
        return
    sc.refs = True
    rng = random.Random(seed * 71 + 5)

    def draw(prog: Program) -> None:
        if rng.random() < 0.5:
            return
        prog.ref_arg = 1.0 - rng.random() ** 3  # mostly a recent one: still pending
        if rng.random() < 0.4:
            prog.keep_ref = rng.uniform(0.0, 1.5)
        prog.return_ref = rng.random() < 0.5
        prog.drop_passed = rng.random() < 0.5
        prog.compute = max(prog.compute, rng.uniform(0.05, 0.6))  # long enough to outlive

    for d in sc.drivers:
        for _, progs in d.batches:
            for prog in progs:
                draw(prog)
    for prog in sc.programs():  # a task's children: a sibling's ref (owned by that worker)
        for child in prog.children[1:]:
            draw(child)
    if rng.random() < 0.6:  # often while a worker owns refs that others borrow
        sc.faults.append((rng.uniform(0.0, 1.0), "kill"))
