"""``python -m benchmarks`` / ``python benchmarks/run.py``: yrdask vs Dask vs Ray.

Each (system, figure) measurement runs in a fresh subprocess (``python -m benchmarks._one``)
that starts its own 2-worker-process cluster and prints one JSON line; this parent repeats each
``--runs`` times (interleaving systems, so slow drift of the machine hits all alike), takes the
median, prints a table and writes the raw runs, medians and machine info as JSON.

Conventions: every cluster has 2 worker processes (1 thread each; ``--cpus N``: N, which
also sizes the ``scale`` group, run with ``--only scale``); latencies are medians per
call (``task_rtt_ms``: 2000 calls, cut at 5 s once 200 are done); the 100 MB figures count
both directions (200 MB / seconds of put + get, Ray's benchmark convention); ratios are
yrdask / other, so for ``*_per_s`` figures above 1 is better for yrdask and for ``*_ms``,
``*_s`` and ``*_mb`` figures below 1 is better.  The table also shows the target set for
yrdask and whether yrdask's median meets it.  A system that cannot do a figure at all shows
"n/a" (the reason is in the JSON, ``not_applicable``); slow peers are asked for fewer
instances or calls (``extra.*_capped_because``), and a total extrapolated from fewer
instances is marked "~".  ``init_s`` is read from the ``idle_pss_mb`` process when both run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/run.py`
    sys.path.insert(0, str(ROOT))

from benchmarks.figures import FIGURES, select  # noqa: E402
from benchmarks.registry import SYSTEMS, load  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "latest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="yrdask vs plain Dask vs Ray, each figure in fresh processes "
                    "(2 worker processes per cluster).")
    ap.add_argument("--runs", type=int, default=3,
                    help="fresh-process runs per figure and system; the median is reported "
                         "(default 3)")
    ap.add_argument("--only", metavar="NAME[,NAME]",
                    help="figures or groups to run; figures: " + ", ".join(FIGURES)
                         + "; groups: " + ", ".join(sorted({f.group for f in FIGURES.values()})))
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"systems to measure (default {','.join(SYSTEMS)})")
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                    help="JSON results file (default benchmarks/results/latest.json)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer iterations (a smoke run, not for quoting)")
    ap.add_argument("--baseline", type=pathlib.Path, default=None, metavar="CHECKOUT",
                    help="also measure the yrdask package of another checkout (e.g. a git "
                         "worktree of the previous commit) as system 'baseline', in the same "
                         "run: a hot-path change shows its before/after")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds one measurement may take (default: per figure)")
    ap.add_argument("--cpus", type=int, default=None, metavar="N",
                    help="worker processes per cluster, one per core (default 2; the scale "
                         "group, --only scale, is sized by it)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.cpus is not None:
        if args.cpus < 1:
            ap.error("--cpus must be at least 1")
        os.environ["YRDASK_BENCH_CPUS"] = str(args.cpus)  # the measuring processes read it
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.baseline is not None:
        if not (args.baseline / "yrdask" / "__init__.py").is_file():
            ap.error(f"--baseline {args.baseline}: no yrdask package there")
        systems.append(BASELINE)
    bad = [s for s in systems if s not in SYSTEMS and s != BASELINE]
    if bad:
        ap.error(f"unknown system(s) {bad}; known: {SYSTEMS}")
    args.system_list = systems
    return args


def machine_info() -> dict:
    info: dict = {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        info["memory_total_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        pass
    from importlib import metadata

    for pkg in ("yrdask", "dask", "distributed", "ray", "numpy", "cloudpickle", "tornado"):
        try:
            info[f"{pkg}_version"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[f"{pkg}_version"] = None
    return info


#: the system name of ``--baseline``: yrdask's figures, another checkout's yrdask package
BASELINE = "baseline"
_baseline_path: list[str] = []  # a directory whose only entry is that checkout's yrdask


def use_baseline(checkout: pathlib.Path) -> None:
    """Make ``baseline`` measurements import ``checkout``'s yrdask (and this harness)."""
    import tempfile

    shadow = pathlib.Path(tempfile.mkdtemp(prefix="yrdask-baseline-"))
    (shadow / "yrdask").symlink_to((checkout / "yrdask").resolve())
    _baseline_path[:] = [str(shadow)]


def child_env(extra: dict | None = None, system: str = "") -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    # Worker processes import the figure modules when they unpickle module-level functions;
    # a baseline run finds the other checkout's yrdask first.
    first = _baseline_path if system == BASELINE else []
    env["PYTHONPATH"] = os.pathsep.join(first + [str(ROOT)] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("YR_SERVER_ADDRESS", None)  # yrdask figures use the embedded cluster
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    return env


#: figures the harness (benchmarks._one) measures for every system itself
HARNESS_FIGURES = {"init_s", "idle_pss_mb", "scale_init_s"}


def _load(system: str):
    return load("yrdask" if system == BASELINE else system)


def implements(system: str, figure: str) -> bool:
    return figure in HARNESS_FIGURES or figure in _load(system).figures()


def not_applicable(system: str, figure: str) -> str | None:
    """Why ``system`` cannot do ``figure`` at all (printed as n/a), or None."""
    return _load(system).unsupported.get(figure)


#: figure -> the figure whose fresh process also measures it (when both are selected):
#: every process times its own init, so ``init_s`` needs no process of its own
SHARED_PROCESS = {"init_s": "idle_pss_mb", "processes_200_per_s": "processes_200_pss_mb"}


def _derived(figure: str, host: dict) -> dict:
    """The record of ``figure`` taken from the process that measured ``host["figure"]``."""
    extra = host.get("extra", {})
    value = extra.get(figure)
    return {"system": host.get("system"), "figure": figure, "value": value,
            "extra": {"measured_in_process_of": host.get("figure"),
                      "init_returned_s": extra.get("init_returned_s")},
            "error": host.get("error") if value is None else None,
            "wall_s": 0.0, "returncode": host.get("returncode")}


def run_one(system: str, figure: str, params: dict, timeout: float,
            env: dict | None = None) -> dict:
    """One fresh-process measurement; returns the child's JSON (or an error record)."""
    cmd = [sys.executable, "-m", "benchmarks._one", "yrdask" if system == BASELINE else system,
           figure, json.dumps(params)]
    t = time.monotonic()
    # `python -m` and the workers' `python -c` put their working directory first on sys.path:
    # a baseline run starts in the shadow directory, so it imports the other checkout's yrdask
    # (the harness itself comes from PYTHONPATH), not the one in ROOT.
    cwd = _baseline_path[0] if system == BASELINE else ROOT
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(env, system), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, err = proc.communicate()
    record = None
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                cand = json.loads(line)
            except ValueError:
                continue
            if isinstance(cand, dict) and cand.get("figure") == figure:
                record = cand
                break
    if record is None:
        why = f"timed out after {timeout:.0f} s" if timed_out else \
            f"exited with code {proc.returncode} without a result"
        record = {"system": system, "figure": figure, "value": None, "extra": {},
                  "error": f"{why}\n--- stderr (tail) ---\n{_tail(err)}"}
    else:
        _reap_group(proc)
    record["wall_s"] = round(time.monotonic() - t, 3)
    record["returncode"] = proc.returncode
    return record


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap_group(proc: subprocess.Popen) -> None:
    """Leftovers of the measurement (the child already exited) must not load the next one."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # give them a second to exit on their own
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    _kill_group(proc)


def _tail(text: str, n: int = 40) -> str:
    return "\n".join((text or "").splitlines()[-n:])


def fmt(v: float | None) -> str:
    if v is None:
        return "null"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def cell(fig: dict, system: str) -> str:
    """A table cell: the median, "n/a" when the system cannot do it, "~" when extrapolated."""
    if fig["not_applicable"].get(system):
        return "n/a"
    value = fig["median"].get(system)
    runs = [r for r in fig["runs"].get(system, []) if r.get("value") is not None]
    approx = any("extrapolated_from" in r.get("extra", {}) for r in runs)
    return ("~" if approx and value is not None else "") + fmt(value)


def table(results: dict, systems: list[str]) -> str:
    head = (["figure"] + systems + ["target", "met"]
            + [f"ratio yrdask/{s}" for s in systems if s != "yrdask"])
    rows = [head]
    for name, fig in results["figures"].items():
        met = fig.get("target_met")
        row = ([f"{name} ({fig['unit']})"] + [cell(fig, s) for s in systems]
               + [fig.get("target") or "", {True: "yes", False: "NO", None: ""}[met]])
        for s in systems:
            if s != "yrdask":
                r = fig["ratio"].get(f"yrdask/{s}")
                row.append("null" if r is None else f"{r:.2f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures = select(args.only)
    systems = args.system_list
    entry = ["-m", "benchmarks"] if sys.argv[0].endswith("__main__.py") or argv is not None \
        else [sys.argv[0]]
    command = " ".join([os.path.basename(sys.executable)] + entry
                       + (sys.argv[1:] if argv is None else list(argv)))
    info = machine_info()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    if args.baseline is not None:
        use_baseline(args.baseline)
        info["baseline"] = str(args.baseline.resolve())
    unavailable = {}
    for s in systems:
        why = _load(s).available()
        if why:
            unavailable[s] = why
            print(why, flush=True)
    active = [s for s in systems if s not in unavailable]

    results: dict = {
        "command": command,
        "started_utc": started,
        "runs": args.runs,
        "quick": args.quick,
        "machine": info,
        "cpus": int(os.environ.get("YRDASK_BENCH_CPUS", "2")),
        "systems": systems,
        "unavailable": unavailable,
        "figures": {},
    }
    for fig in figures:
        results["figures"][fig.name] = {
            "group": fig.group, "unit": fig.unit, "higher_is_better": fig.higher_is_better,
            "description": fig.description,
            "params": {**fig.parameters(args.quick), "quick": args.quick},
            "target": fig.target_text() or None, "target_met": None,
            "runs": {s: [] for s in systems}, "errors": {s: [] for s in systems},
            "not_applicable": {s: None for s in systems},
            "median": {s: None for s in systems}, "ratio": {},
        }

    names = {f.name for f in figures}
    total = args.runs * len(figures) * len(active)
    k = 0
    t_all = time.monotonic()
    failures = 0
    for run in range(args.runs):
        for fig in figures:
            entry = results["figures"][fig.name]
            for s in active:
                k += 1
                why = not_applicable(s, fig.name)
                if why:
                    entry["not_applicable"][s] = why
                    if run == 0:
                        print(f"[{k}/{total}] {fig.name:<30} {s:<7} n/a: {why}", flush=True)
                    continue
                if not implements(s, fig.name):
                    if run == 0:
                        print(f"[{k}/{total}] {fig.name:<30} {s:<7} not implemented: null",
                              flush=True)
                    continue
                if fig.name in SHARED_PROCESS and SHARED_PROCESS[fig.name] in names:
                    continue  # recorded from the other figure's process, below
                rec = run_one(s, fig.name, entry["params"], args.timeout or fig.timeout_s)
                recs = [(fig, rec)]
                for other, host in SHARED_PROCESS.items():
                    if host == fig.name and other in names:
                        recs.append((FIGURES[other], _derived(other, rec)))
                for f, r in recs:
                    results["figures"][f.name]["runs"][s].append(r)
                    status = fmt(r["value"]) if r["value"] is not None else "FAILED"
                    print(f"[{k}/{total}] run {run + 1} {f.name:<24} {s:<7} {status:>10} "
                          f"{f.unit:<8} ({r['wall_s']:.1f} s)", flush=True)
                    if r.get("error"):
                        failures += 1
                        results["figures"][f.name]["errors"][s].append(r["error"])
                        print(f"    {s} {f.name} failed:\n" + _indent(r["error"]), flush=True)

    import statistics

    for name, entry in results["figures"].items():
        for s in systems:
            vals = [r["value"] for r in entry["runs"][s] if r.get("value") is not None]
            entry["median"][s] = statistics.median(vals) if vals else None
        for s in systems:
            if s != "yrdask":
                entry["ratio"][f"yrdask/{s}"] = ratio(entry["median"].get("yrdask"),
                                                      entry["median"].get(s))
        entry["target_met"] = FIGURES[name].meets(entry["median"].get("yrdask"))
    results["elapsed_s"] = round(time.monotonic() - t_all, 1)
    results["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    print()
    print(f"{command}  (median of {args.runs} fresh-process run(s); "
          f"{info['cpu_count']} CPUs, Python {info['python']}, dask {info['dask_version']}, "
          f"load {', '.join(f'{x:.2f}' for x in info['load_average_at_start'] or [])})")
    print(table(results, systems))
    for s, why in unavailable.items():
        print(f"{s}: {why}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out} in {results['elapsed_s']:.0f} s")
    return 1 if failures else 0


def _indent(text: str) -> str:
    return "\n".join("      " + ln for ln in text.rstrip().splitlines())


if __name__ == "__main__":
    raise SystemExit(main())
