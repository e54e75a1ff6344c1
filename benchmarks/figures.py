"""The figure catalogue: what each benchmark figure measures, its unit and its parameters.

``params`` are the full-run parameters; ``quick`` overrides them for ``--quick`` (smoke runs).
Groups let ``--only`` select several figures at once (``--only stateless``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Figure:
    name: str
    group: str
    unit: str
    higher_is_better: bool
    description: str
    params: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0
    #: the target for yrdask: (comparison, value), e.g. ("<=", 1.5); None: no target
    target: tuple[str, float] | None = None
    #: the figure starts and stops its own cluster (benchmarks/elastic.py): the harness
    #: starts none and measures no init_s for it
    own_cluster: bool = False

    def target_text(self) -> str:
        return "" if self.target is None else f"{self.target[0]} {self.target[1]:g}"

    def meets(self, value: float | None) -> bool | None:
        """Whether ``value`` meets the target (None when there is no target or no value)."""
        if self.target is None or value is None:
            return None
        op, bound = self.target
        return {"<=": value <= bound, "<": value < bound, ">=": value >= bound,
                ">": value > bound}[op]

    def parameters(self, quick: bool) -> dict[str, Any]:
        p = dict(self.params)
        if quick:
            p.update(self.quick)
        return p


FIGURES: dict[str, Figure] = {}


def add(fig: Figure) -> Figure:
    if fig.name in FIGURES:
        raise ValueError(f"figure {fig.name!r} defined twice")
    FIGURES[fig.name] = fig
    return fig


add(Figure(
    "init_s", "stateless", "s", False,
    "import + init of a 2-worker-process cluster until the first trivial task's result is back, "
    "timed from the first line of a fresh interpreter (before the library is imported)",
    target=("<=", 1.5),
))
add(Figure(
    "idle_pss_mb", "stateless", "MB", False,
    "total PSS (RSS where PSS is unreadable) of the driver and all its descendant processes, "
    "after init and one trivial call, idle",
    params={"settle_s": 1.0}, quick={"settle_s": 0.5},
    target=("<=", 200),
))
add(Figure(
    "task_rtt_ms", "stateless", "ms", False,
    "sequential get(f.invoke(i)) round trip of a trivial task: median per call over 2000 calls "
    "(or as many as fit in 5 s, at least 200) after 100 warm-up calls",
    params={"warmup": 100, "calls": 2000, "max_seconds": 5.0},
    quick={"warmup": 10, "calls": 100},
    target=("<=", 1.0),
))
add(Figure(
    "tasks_10k_per_s", "stateless", "tasks/s", True,
    "N trivial tasks submitted, then all gathered with one get(list): N / seconds",
    params={"tasks": 10_000, "warmup": 100}, quick={"tasks": 1_000, "warmup": 20},
    target=(">=", 3000),
))
add(Figure(
    "put_get_100mb_mb_per_s", "objects", "MB/s", True,
    "a 100 MB numpy array put, then get in the driver: 200 MB / seconds (both directions "
    "counted, Ray's benchmark convention); median over repeats. What each system does is in "
    "the JSON (extra.semantics)",
    params={"size_mb": 100, "warmup": 1, "repeats": 5}, quick={"repeats": 2},
    target=(">=", 1500),
))
add(Figure(
    "put_task_get_100mb_mb_per_s", "objects", "MB/s", True,
    "cross-process: a 100 MB numpy array put in the driver, then a task on a worker gets it "
    "and returns its nbytes; the driver times put -> result: 200 MB / seconds (put + get "
    "counted, as above); median over repeats",
    params={"size_mb": 100, "warmup": 1, "repeats": 5}, quick={"repeats": 2},
    target=(">=", 1500),
))
add(Figure(
    "broadcast_100mb_8_tasks_s", "objects", "s", False,
    "one 100 MB numpy array put in the driver, then 8 tasks on the 2 workers each get it "
    "(ref passed inside a list) and return its nbytes: seconds from the put to the last "
    "result; median over repeats",
    params={"size_mb": 100, "tasks": 8, "warmup": 1, "repeats": 5}, quick={"repeats": 2},
    target=("<=", 0.1),
))
add(Figure(
    "nested_task_ms", "nested", "ms", False,
    "inside one task, sequential nested get(g.invoke(i)) round trips: median per call",
    params={"warmup": 20, "calls": 200}, quick={"warmup": 5, "calls": 50},
    target=("<=", 0.3),
))
add(Figure(
    "nested_tasks_1k_per_s", "nested", "tasks/s", True,
    "inside one task, N trivial tasks submitted then gathered with one get(list): N / seconds "
    "(timed inside the task)",
    params={"tasks": 1000, "warmup": 50}, quick={"tasks": 300, "warmup": 10},
))
add(Figure(
    "instance_rtt_ms", "stateful", "ms", False,
    "sequential get(h.inc.invoke(i)) round trip on one instance (Dask: actor method call): "
    "median per call over 2000 calls (or as many as fit in 5 s, at least 200)",
    params={"warmup": 100, "calls": 2000, "max_seconds": 5.0},
    quick={"warmup": 10, "calls": 100},
    target=("<=", 0.5),
))
add(Figure(
    "instance_calls_10k_per_s", "stateful", "calls/s", True,
    "N trivial method calls on one instance submitted, then gathered: N / seconds "
    "(slow peers make fewer calls, see extra.calls)",
    params={"calls": 10_000, "warmup": 100}, quick={"calls": 1_000, "warmup": 20},
    target=(">=", 10_000),
))
add(Figure(
    "instances_100_per_s", "stateful", "instances/s", True,
    "N small instances created (yrdask cpu=10 millicores, memory=0; Ray num_cpus=0.01) and "
    "each called once, all gathered: N / seconds from the first creation (slow peers create "
    "fewer, see extra.instances)",
    params={"instances": 100}, quick={"instances": 20},
    target=(">=", 300),
))
add(Figure(
    "instance_mem_mb", "stateful", "MB", False,
    "memory per extra instance: (PSS of all processes after N tiny instances, each called "
    "once - PSS before them) / N. yrdask N=1000 (cpu=0, memory=0), peers fewer "
    "(see extra.instances)",
    params={"instances": 1000, "settle_s": 1.0}, quick={"instances": 200, "settle_s": 0.5},
    target=("<=", 1.0),
))
add(Figure(
    "instances_10k_pss_mb", "stateful", "MB", False,
    "total PSS of all processes with 10 000 live tiny instances (each called once); a system "
    "that cannot hold that many is measured with fewer and extrapolated linearly (marked ~ "
    "in the table, extra.extrapolated_from; --quick measures 2000 and extrapolates)",
    params={"instances": 10_000, "total_for": 10_000, "settle_s": 1.0},
    quick={"instances": 2_000, "settle_s": 0.5},
    target=("<", 2000), timeout_s=600.0,
))
add(Figure(
    "seed_tree_s", "stateful", "s", False,
    "the examples/training_tree.py shape without its sleeps: 2 supervisor instances, each "
    "creating 4 worker instances and driving 100 calls to each; wall time from the first "
    "creation until both supervisors' results are back",
    params={"supervisors": 2, "workers": 4, "calls": 100},
    target=("<=", 0.8),
))
add(Figure(
    "restart_s", "stateful", "s", False,
    "SIGKILL of the worker process hosting an instance created to restart once (yrdask "
    "recover_retry_times=1; Ray max_restarts=1, max_task_retries=-1) until a call on the "
    "same handle returns from the restarted instance (calls that fail meanwhile are retried)",
    params={"deadline_s": 10.0},
    target=("<=", 1.0),
))

add(Figure(
    "isolated_create_ms", "isolation", "ms", False,
    "an instance in its own process (yrdask isolated=True with env_vars; Ray: an actor with "
    "runtime_env env_vars, always a process of its own) created and called once, until "
    "that call is back; median over N sequential creations, each terminated after",
    params={"instances": 8, "warmup": 1}, quick={"instances": 3, "warmup": 1},
))
add(Figure(
    "isolated_rtt_ms", "isolation", "ms", False,
    "sequential call round trip on an instance in its own process: median over 2000 calls "
    "(or as many as fit in 5 s) after 100 warm-up calls",
    params={"warmup": 100, "calls": 2000, "max_seconds": 5.0},
    quick={"warmup": 10, "calls": 100},
))
add(Figure(
    "isolated_task_rtt_ms", "isolation", "ms", False,
    "sequential round trip of a trivial task with env_vars (yrdask: a pooled process per "
    "worker and env; Ray: runtime_env env_vars): median per call after warm-up",
    params={"warmup": 20, "calls": 1000, "max_seconds": 5.0},
    quick={"warmup": 5, "calls": 100},
))
add(Figure(
    "isolated_mem_mb", "isolation", "MB", False,
    "memory per extra instance in its own process: (PSS of all processes after N tiny "
    "isolated instances, each called once - PSS before them) / N",
    params={"instances": 8, "settle_s": 1.0}, quick={"instances": 3, "settle_s": 0.5},
))


# -- process instances: an instance that is a process of its own (yrdask light=False; Ray: any
# actor), next to the light figures above (docs/isolation.md, "Cost")

add(Figure(
    "process_create_ms", "process", "ms", False,
    "a process instance (yrdask InvokeOptions(light=False), cpu=0; Ray: an actor, num_cpus=0) "
    "created and called once, until that call is back; median over N sequential creations, "
    "each terminated after",
    params={"instances": 15, "warmup": 2}, quick={"instances": 3, "warmup": 1},
    target=("<=", 5.0),
))
add(Figure(
    "process_rtt_ms", "process", "ms", False,
    "sequential call round trip on a process instance: median over 2000 calls (or as many as "
    "fit in 5 s) after 100 warm-up calls (the light instance's is instance_rtt_ms)",
    params={"warmup": 100, "calls": 2000, "max_seconds": 5.0},
    quick={"warmup": 10, "calls": 100},
))
add(Figure(
    "process_mem_mb", "process", "MB", False,
    "memory per extra process instance: (PSS of all processes after N of them, each called "
    "once - PSS before the first, so the zygote and its spare count too) / N",
    params={"instances": 8, "settle_s": 1.0}, quick={"instances": 3, "settle_s": 0.5},
))
add(Figure(
    "processes_200_pss_mb", "process", "MB", False,
    "200 process instances alive at once (created together, each called once): (PSS of all "
    "processes then - PSS before them) / 200; a system that cannot start that many is "
    "measured with fewer (extra.processes)",
    params={"processes": 200, "settle_s": 1.0}, quick={"processes": 50, "settle_s": 0.5},
    target=("<=", 12.0), timeout_s=600.0,
))
add(Figure(
    "processes_200_per_s", "process", "instances/s", True,
    "the processes_200_pss_mb creation (measured in its process): process instances "
    "created and called once per second, all 200 at once",
    params={"processes": 200}, quick={"processes": 50}, timeout_s=600.0,
))

# -- scale: sized to the machine (python -m benchmarks --cpus N --only scale) ---------------
# N worker processes (one per core); not part of a run without --only (they take long).

add(Figure(
    "scale_init_s", "scale", "s", False,
    "init_s with N worker processes: import + init until the first trivial task's result "
    "is back, from the first line of a fresh interpreter",
))
add(Figure(
    "scale_tasks_per_s", "scale", "tasks/s", True,
    "20 000 trivial tasks submitted, then all gathered, on N worker processes: N / seconds",
    params={"tasks": 20_000, "warmup": 200}, quick={"tasks": 2_000, "warmup": 20},
))
add(Figure(
    "blas_matmul_s", "threads", "s", False,
    "a task holding 2 CPUs (yrdask cpu=2000, Ray num_cpus=2) multiplies two n×n float64 "
    "matrices `times` times: seconds inside the task (median of `repeats` tasks); its BLAS "
    "threads and kernel are in the JSON",
    params={"n": 2000, "times": 3, "repeats": 5}, quick={"n": 1000, "repeats": 3},
))
add(Figure(
    "scale_cpu_tasks_efficiency", "scale", "ratio", True,
    "100·N tasks of 10 ms busy CPU each (one core each) submitted then gathered: the ideal "
    "time (100 × 10 ms, all cores busy) / the time taken; 1.0 is perfect",
    params={"tasks_per_cpu": 100, "ms": 10}, quick={"tasks_per_cpu": 20, "ms": 10},
))
add(Figure(
    "scale_nested_efficiency", "scale", "ratio", True,
    "nested fan-out: N tasks, each submitting 20 tasks of 10 ms busy CPU and gathering them: "
    "the ideal time (N × 20 × 10 ms over N cores) / the time taken",
    params={"children": 20, "ms": 10}, quick={"children": 10, "ms": 10},
))
add(Figure(
    "scale_actor_calls_per_s", "scale", "calls/s", True,
    "N actors (one per core), 2000 pipelined calls each, all submitted then gathered: "
    "calls / seconds",
    params={"calls": 2_000}, quick={"calls": 200},
))
add(Figure(
    "scale_actors_per_s", "scale", "actors/s", True,
    "20·N small actors created and each called once, all gathered: actors / seconds",
    params={"per_cpu": 20}, quick={"per_cpu": 5},
))


# -- elastic: clusters that Dask's deployers grow (benchmarks/elastic.py) and shrink ----

ADAPT = {"maximum": 2, "interval": "200ms", "wait_count": 2}  # cluster.adapt()'s arguments

add(Figure(
    "adaptive_first_result_s", "elastic", "s", False,
    "LocalCluster(n_workers=0, threads_per_worker=1) under cluster.adapt(minimum=0, "
    "maximum=2, interval=200ms): one trivial task submitted -> its result, while Dask's "
    "deployer adds a worker for it (yrdask: a yr task; Dask: a Dask task); median over "
    "repeats, each from no workers",
    params={**ADAPT, "repeats": 3}, quick={"repeats": 1}, timeout_s=240.0, own_cluster=True,
))

add(Figure(
    "drain_s", "elastic", "s", False,
    "scale-down of a worker that hosts 20 instances with a checkpoint and keeps 10 x 20 MB "
    "of task results (yrdask; one node): client.retire_workers of it -> all 20 instances "
    "answer from their new worker with their state and all 200 MB read back",
    params={"instances": 20, "objects": 10, "object_mb": 20},
    quick={"instances": 5, "objects": 2, "object_mb": 20}, timeout_s=240.0,
))

#: groups a run without --only leaves out
OPT_IN_GROUPS = ("scale", "elastic")


def select(only: str | None) -> list[Figure]:
    """Figures named (or whose group is named) in the comma-separated ``only``; without it,
    all except the opt-in groups (``scale``, ``elastic``)."""
    if not only:
        return [f for f in FIGURES.values() if f.group not in OPT_IN_GROUPS]
    names = [n.strip() for n in only.split(",") if n.strip()]
    chosen: list[Figure] = []
    for n in names:
        if n in FIGURES:
            hits = [FIGURES[n]]
        else:
            hits = [f for f in FIGURES.values() if f.group == n]
        if not hits:
            known = ", ".join(list(FIGURES) + sorted({f.group for f in FIGURES.values()}))
            raise SystemExit(f"unknown figure or group {n!r}; known: {known}")
        chosen += [f for f in hits if f not in chosen]
    return chosen
