"""Running seeds, and the report of a failing one (its replay command and its story)."""

from __future__ import annotations

import os
import sys
import time

from tests.sim import machines as M
from tests.sim.scenario import make_scenario
from tests.sim.world import SimFailure, World

TAIL = 60


def run_seed(seed: int) -> World:
    """Build the scenario of ``seed`` and run it to the end; raises SimFailure."""
    world = World(seed, make_scenario(seed))
    world.run()
    return world


def replay_command(seed: int) -> str:
    return f"PYTHONHASHSEED=0 python -m tests.sim --seed {seed}"


def _fmt(entry: tuple) -> str:
    now, node, text, _keys = entry
    if isinstance(text, tuple):
        text = " ".join(map(str, text))
    return f"{now:10.4f} {node:>8}  {text}"


def related_keys(world: World, keys: tuple) -> set[str]:
    """The keys and the leases and tasks that share a log entry with them."""
    wanted = set(keys)
    for _now, _node, _text, ks in world.log:
        if wanted.intersection(ks):
            wanted.update(k for k in ks if k)
    return wanted


def story(world: World, keys: tuple = (), tail: int | None = None) -> str:
    """The world's log (about ``keys`` and their leases, if given) and the machines' stories."""
    wanted = related_keys(world, keys) if keys else set()
    rows = [_fmt(e) for e in world.log if not wanted or wanted.intersection(e[3])]
    if tail is not None:
        rows = rows[-tail:]
        if len(rows) < tail // 2:  # little about the keys: show the end of everything too
            rows += ["--- the world's last events ---",
                     *(_fmt(e) for e in world.log[-(tail - len(rows)):])]
    out = ["--- world (virtual time, node, what) ---", *rows]
    if wanted:
        machine = M.stories(world, tuple(sorted(wanted)))
        if tail is not None:
            machine = machine[-tail:]
        out += ["--- machine stories ---", *machine]
    return "\n".join(out)


def failure_report(seed: int, failure: SimFailure, tail: int | None = TAIL) -> str:
    world = failure.world
    return "\n".join([
        f"simulation seed {seed} failed at step {world.step}, virtual time {world.now:.4f} s:",
        f"  {failure.message}",
        f"replay: {replay_command(seed)}",
        world.sc.describe(),
        story(world, failure.keys, tail),
    ])


def run_seeds(seeds: range, stop_on_failure: bool = True,
              races: dict[str, int] | None = None) -> tuple[int, list[tuple[int, str]]]:
    """Run ``seeds``; returns (how many ran, [(seed, report)] of the failures); adds the
    race branches each world took to ``races``."""
    failures = []
    n = 0
    for seed in seeds:
        n += 1
        try:
            world = run_seed(seed)
            if races is not None:
                add_races(races, world.races)
        except SimFailure as e:
            failures.append((seed, failure_report(seed, e)))
            if stop_on_failure:
                break
    return n, failures


def add_races(total: dict[str, int], races: dict[str, int]) -> None:
    """Count the race branches a world took (``World.races``) into ``total``."""
    for what, n in races.items():
        total[what] = total.get(what, 0) + n


def races_line(total: dict[str, int]) -> str:
    return "race branches taken: " + ", ".join(f"{what} {n}" for what, n in total.items())


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__)
    p.add_argument("--seed", type=int, help="replay one seed and print its whole story")
    p.add_argument("--seeds", help="run a range A:B of seeds (N: 0:N), report the failures")
    p.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
    p.add_argument("--tail", type=int, default=None, help="story lines to print (default all)")
    p.add_argument("--calls", action="store_true",
                   help="the instance world (CallOrder, Lifecycle, LeaseQueue) instead of the "
                        "task world")
    p.add_argument("--strict", action="store_true",
                   help="with --calls: known findings fail the run too")
    p.add_argument("--objects", action="store_true",
                   help="the object world (borrowers counted: runtime/refcount.py)")
    args = p.parse_args(argv)
    if args.calls:
        return _main_calls(args)
    if args.objects:
        from tests.sim.objects import main_objects

        return main_objects(args)
    if os.environ.get("PYTHONHASHSEED") != "0":
        # set iteration order must match the run that found the seed
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim", *(argv or sys.argv[1:])])
    if args.seed is not None:
        try:
            world = run_seed(args.seed)
        except SimFailure as e:
            print(failure_report(args.seed, e, args.tail))
            return 1
        print(world.sc.describe())
        print(story(world, (), args.tail))
        print(f"seed {args.seed}: ok ({world.step} steps, {len(world.tasks)} tasks, "
              f"virtual {world.now:.2f} s)")
        return 0
    a, _, b = (args.seeds or "0:1000").rpartition(":")  # "A:B", or "N" for 0:N
    a, b = int(a or 0), int(b)
    t0 = time.perf_counter()
    races: dict[str, int] = {}
    n, failures = run_seeds(range(a, b), stop_on_failure=not args.keep_going, races=races)
    for seed, rep in failures:
        print(rep)
        print()
    print(races_line(races))
    print(f"{n} seeds in {time.perf_counter() - t0:.1f} s, {len(failures)} failed"
          + (f": {[s for s, _ in failures]}" if failures else ""))
    return 1 if failures else 0


def _main_calls(args) -> int:
    """The instance world (``calls.py``): one seed with its story, or a range.

    Failures that are known findings (``calls.KNOWN_FINDINGS``: exact seeds and messages,
    FINDINGS.md) are listed by finding and fail the run only with ``--strict``; any other
    failure fails it.
    """
    if os.environ.get("PYTHONHASHSEED") != "0":  # the lifecycle iterates sets of ids
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim", *sys.argv[1:]])
    from tests.sim.calls import known_finding, run_call_seed

    seeds = [args.seed] if args.seed is not None else range(
        *(int(x) for x in (args.seeds or "0:1000").split(":")))
    t0 = time.perf_counter()
    failed, known, races = [], {}, {}
    for seed in seeds:
        try:
            world = run_call_seed(seed)
            add_races(races, world.races)
        except SimFailure as e:
            section = known_finding(seed, e.message)
            if section is not None and not args.strict and args.seed is None:
                known.setdefault(section, []).append(seed)
                continue
            failed.append(seed)
            print(f"instance simulation seed {seed} failed: {e.message}")
            if section is not None:
                print(f"known finding: FINDINGS.md, {section}")
            print(f"replay: python -m tests.sim --calls --seed {seed}")
            print(e.world.story(args.tail or (60 if args.seed is None else 400)))
            if not args.keep_going:
                break
            continue
        if args.seed is not None:
            print(world.story(args.tail or 10_000))
    for section, ss in known.items():
        print(f"known finding ({len(ss)} seeds): {section}: {ss[:20]}")
    print(races_line(races))
    print(f"{len(seeds)} call seeds in {time.perf_counter() - t0:.1f} s, {len(failed)} failed"
          + (f": {failed}" if failed else ""))
    return 1 if failed else 0
