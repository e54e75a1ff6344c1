"""Systems under test and the ``@measures`` decorator that maps figures to their methods.

A :class:`System` knows how to start a 2-worker-process cluster, run one trivial call and stop;
each figure is a method decorated with ``@measures("figure_name")`` that takes the figure's
parameters and returns ``(value, extra)`` -- ``extra`` is a dict of details kept in the JSON.
``init_s`` and ``idle_pss_mb`` are measured by the harness (:mod:`benchmarks._one`) for every
system from ``start`` and ``trivial_call``.  The figure bodies are written once, here, against
the primitives each system module supplies.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import statistics
import time
from typing import Any, Callable

import psutil

from benchmarks import elastic
from benchmarks.common import (latency_result, payload, put_get_result, same_size, timed_calls,
                               tree_pss_mb)

#: system name -> module that defines ``SYSTEM`` (a System subclass instance)
SYSTEM_MODULES = {
    "yrdask": "benchmarks.sys_yrdask",
    "dask": "benchmarks.sys_dask",
    "ray": "benchmarks.sys_ray",
}
SYSTEMS = list(SYSTEM_MODULES)

#: worker processes of every cluster (one per core): ``python -m benchmarks --cpus N`` sets
#: ``YRDASK_BENCH_CPUS`` for the measuring processes; 2 (this machine's cores) by default
N_WORKERS = max(1, int(os.environ.get("YRDASK_BENCH_CPUS", "2")))

#: the hyperparameters of the two supervisors of examples/training_tree.py
SEED_CONFIGS = [{"lr": 0.01}, {"lr": 0.001}]


def measures(figure: str) -> Callable[[Callable], Callable]:
    """Mark a System method as the implementation of ``figure``."""

    def mark(fn: Callable) -> Callable:
        fn._bench_figure = figure  # type: ignore[attr-defined]
        return fn

    return mark


class System:
    """A system under test: start/stop plus a few primitives; the figures are written once here.

    Tasks: ``submit(i)`` (a trivial remote ``i + 1``, returning the system's handle),
    ``gather(handles, timeout=None)`` (tasks' and method calls' results), ``put(obj)``,
    ``fetch(handle)`` (get in the driver), ``read_in_task(handle)`` (a task that gets the put
    object on a worker and returns its ``nbytes``), ``nested(warmup, calls)`` and
    ``nested_burst(warmup, n)`` (run inside one task; each returns a dict, see the figures).

    Instances: ``create(kind, *args, size=..., restartable=False)`` returns a handle at once
    (kinds: ``"counter"`` with methods ``inc(i)`` and ``pid()``; ``"supervisor"`` with
    ``start_training(num_workers, calls)``, the seed's orchestrator); ``call(handle, method,
    *args)`` returns a handle for ``gather``.  ``size`` is ``"small"`` (yrdask cpu=10
    millicores, Ray num_cpus=0.01) or ``"tiny"`` (no resources reserved: yrdask cpu=0, Ray
    num_cpus=0).
    """

    name = "?"
    #: the import that must work for the system to be measured, and the hint when it fails
    requires = ""
    install_hint = ""
    #: figure -> why this system cannot do it; the table prints "n/a" and no process runs
    unsupported: dict[str, str] = {}
    #: parameter name -> (most asked of this system in a full run, in a --quick run, why):
    #: slow peers create fewer instances or make fewer calls; the JSON says so
    caps: dict[str, tuple[int, int, str]] = {}
    #: what put/get/read_in_task actually do on this system (kept in the JSON)
    object_semantics = ""

    def available(self) -> str | None:
        """None when the system can run here, else why not."""
        if not self.requires:
            return None
        try:
            importlib.import_module(self.requires)
        except ImportError:
            return f"{self.name} not installed ({self.install_hint})"
        return None

    def start(self) -> None:  # import the library, start the cluster, wait until ready
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def submit(self, i: int) -> Any:
        raise NotImplementedError

    def gather(self, handles: list, timeout: float | None = None) -> list:
        raise NotImplementedError

    def put(self, obj: Any) -> Any:
        raise NotImplementedError

    def fetch(self, handle: Any) -> Any:
        raise NotImplementedError

    def read_in_task(self, handle: Any) -> Any:
        raise NotImplementedError

    def nested(self, warmup: int, calls: int) -> dict:
        raise NotImplementedError

    def nested_burst(self, warmup: int, n: int) -> dict:
        raise NotImplementedError

    def create(self, kind: str, *args: Any, size: str = "small", restartable: bool = False) -> Any:
        raise NotImplementedError

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        raise NotImplementedError

    # Isolation (docs/isolation.md): an instance in a process of its own, with env_vars.

    def create_isolated(self, kind: str, *args: Any) -> Any:
        """A tiny instance hosted in its own process with an env var set."""
        raise NotImplementedError

    def destroy(self, handle: Any) -> None:
        """End an instance now (yrdask ``terminate``, Ray ``ray.kill``)."""
        raise NotImplementedError

    def create_process(self, kind: str, *args: Any) -> Any:
        """A tiny process instance: a process of its own, nothing else asked (yrdask
        ``light=False``; a Ray actor always is one)."""
        raise NotImplementedError

    def submit_isolated(self, i: int) -> Any:
        """The trivial task, with an env var set (so it runs in a process with that env)."""
        raise NotImplementedError

    # Scale (--cpus N): CPU work and nested fan-out.

    def submit_spin(self, ms: float) -> Any:
        """A task that keeps one CPU busy for ``ms`` ms (one core each)."""
        raise NotImplementedError

    def submit_fan_out(self, children: int, ms: float) -> Any:
        """A task (one core) that submits ``children`` spin tasks of ``ms`` and gathers them."""
        raise NotImplementedError

    def submit_blas(self, n: int, times: int) -> Any:
        """A task holding 2 CPUs that multiplies ``n``×``n`` matrices ``times`` times
        (:func:`benchmarks.workloads.blas_matmul`)."""
        raise NotImplementedError

    def trivial_call(self) -> Any:
        """One trivial task, waited for."""
        return self.gather([self.submit(0)])[0]

    def capped(self, key: str, p: dict) -> tuple[int, dict]:
        """``p[key]`` limited by this system's cap on ``key``, and a note for the JSON."""
        wanted = p[key]
        cap = self.caps.get(key)
        limit = None if cap is None else cap[1] if p.get("quick") else cap[0]
        if limit is None or wanted <= limit:
            return wanted, {key: wanted}
        return limit, {key: limit, f"{key}_wanted": wanted, f"{key}_capped_because": cap[2]}

    # -- stateless figures ---------------------------------------------------------------

    def _latency(self, submit: Callable[[int], Any], p: dict) -> tuple[float, dict]:
        """Sequential round trips ``gather([submit(i)])``: median ms per call."""
        return latency_result(timed_calls(lambda i: self.gather([submit(i)]),
                                          p["warmup"], p["calls"], p.get("max_seconds")))

    def _throughput(self, submit: Callable[[int], Any], warmup: int, n: int,
                    extra: dict) -> tuple[float, dict]:
        """``warmup`` calls of ``submit(i)`` gathered untimed, then ``n`` submitted at once and
        gathered: n / seconds."""
        self.gather([submit(i) for i in range(warmup)])
        t = time.perf_counter()
        handles = [submit(i) for i in range(n)]
        submitted = time.perf_counter() - t
        out = self.gather(handles)
        dt = time.perf_counter() - t
        assert out[-1] == n
        return n / dt, {**extra, "seconds": dt, "submit_seconds": submitted}

    @measures("task_rtt_ms")
    def task_rtt(self, p: dict) -> tuple[float, dict]:
        return self._latency(self.submit, p)

    @measures("tasks_10k_per_s")
    def tasks(self, p: dict) -> tuple[float, dict]:
        n, extra = self.capped("tasks", p)
        return self._throughput(self.submit, p["warmup"], n, extra)

    @measures("put_get_100mb_mb_per_s")
    def put_get(self, p: dict) -> tuple[float, dict]:
        arr, kind = payload(p["size_mb"])
        secs = []
        same = False
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            handle = self.put(arr)
            out = self.fetch(handle)
            dt = time.perf_counter() - t
            assert same_size(arr, out)
            same = out is arr
            del handle, out
            if k >= p["warmup"]:
                secs.append(dt)
        value, extra = put_get_result(secs, p["size_mb"], kind)
        extra["get_returned_same_object"] = same  # True: no copy was made at all
        extra["semantics"] = self.object_semantics
        return value, extra

    @measures("put_task_get_100mb_mb_per_s")
    def put_task_get(self, p: dict) -> tuple[float, dict]:
        arr, kind = payload(p["size_mb"])
        secs = []
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            handle = self.put(arr)
            nbytes = self.gather([self.read_in_task(handle)])[0]
            dt = time.perf_counter() - t
            assert nbytes == p["size_mb"] * 10**6, nbytes
            del handle
            if k >= p["warmup"]:
                secs.append(dt)
        value, extra = put_get_result(secs, p["size_mb"], kind)
        extra["semantics"] = self.object_semantics
        return value, extra

    @measures("broadcast_100mb_8_tasks_s")
    def broadcast(self, p: dict) -> tuple[float, dict]:
        """One put, then ``tasks`` tasks (spread over the 2 workers) each read it: seconds
        from the put to the last result; median over repeats."""
        arr, kind = payload(p["size_mb"])
        secs = []
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            handle = self.put(arr)
            sizes = self.gather([self.read_in_task(handle) for _ in range(p["tasks"])])
            dt = time.perf_counter() - t
            assert sizes == [p["size_mb"] * 10**6] * p["tasks"], sizes
            del handle
            if k >= p["warmup"]:
                secs.append(dt)
        med = statistics.median(secs)
        return med, {"repeats": len(secs), "runs_s": secs, "tasks": p["tasks"],
                     "payload": kind, "semantics": self.object_semantics}

    @measures("nested_task_ms")
    def nested_calls(self, p: dict) -> tuple[float, dict]:
        info = self.nested(p["warmup"], p["calls"])
        return info.pop("median_ms"), {"calls": p["calls"], **info}

    @measures("nested_tasks_1k_per_s")
    def nested_tasks(self, p: dict) -> tuple[float, dict]:
        info = self.nested_burst(p["warmup"], p["tasks"])
        return p["tasks"] / info["seconds"], {"tasks": p["tasks"], **info}

    # -- instance figures ----------------------------------------------------------------

    @measures("instance_rtt_ms")
    def instance_rtt(self, p: dict) -> tuple[float, dict]:
        return self._latency(functools.partial(self.call, self.create("counter"), "inc"), p)

    @measures("instance_calls_10k_per_s")
    def instance_calls(self, p: dict) -> tuple[float, dict]:
        n, extra = self.capped("calls", p)
        return self._throughput(functools.partial(self.call, self.create("counter"), "inc"),
                                p["warmup"], n, extra)

    def _counters(self, n: int, size: str = "small") -> tuple[list, float]:
        """``n`` counters created and each called once, all gathered: handles and seconds."""
        t = time.perf_counter()
        handles = [self.create("counter", size=size) for _ in range(n)]
        out = self.gather([self.call(h, "inc", k) for k, h in enumerate(handles)])
        dt = time.perf_counter() - t
        assert out[-1] == n
        return handles, dt

    @measures("instances_100_per_s")
    def instances_create(self, p: dict) -> tuple[float, dict]:
        n, extra = self.capped("instances", p)
        _, dt = self._counters(n)
        return n / dt, {**extra, "seconds": dt}

    def _live_instances(self, n: int, settle_s: float) -> tuple[float, float, dict]:
        """PSS before and after ``n`` tiny instances (each called once, all still alive)."""
        time.sleep(settle_s)
        before, _ = tree_pss_mb()
        handles, created = self._counters(n, size="tiny")  # alive until the PSS is read
        time.sleep(settle_s)
        after, info = tree_pss_mb()
        return before, after, {"create_and_call_seconds": created,
                               "pss_before_mb": before, "pss_after_mb": after, **info}

    @measures("instance_mem_mb")
    def instance_memory(self, p: dict) -> tuple[float, dict]:
        n, extra = self.capped("instances", p)
        before, after, info = self._live_instances(n, p["settle_s"])
        return (after - before) / n, {**extra, **info}

    @measures("instances_10k_pss_mb")
    def live_instances(self, p: dict) -> tuple[float, dict]:
        wanted = p["total_for"]  # the figure is the total with this many live instances
        n, extra = self.capped("instances", p)
        before, after, info = self._live_instances(n, p["settle_s"])
        extra.update(info)
        if n == wanted:
            return after, extra
        extra["extrapolated_from"] = n
        extra["extrapolation"] = (f"pss_before + (pss_after - pss_before) / {n} * {wanted}: "
                                  f"measured with {n} instances, not {wanted}")
        return before + (after - before) / n * wanted, extra

    @measures("seed_tree_s")
    def seed_tree(self, p: dict) -> tuple[float, dict]:
        sups = p["supervisors"]
        t = time.perf_counter()
        handles = [self.create("supervisor", SEED_CONFIGS[k % len(SEED_CONFIGS)])
                   for k in range(sups)]
        reports = self.gather([self.call(h, "start_training", p["workers"], p["calls"])
                               for h in handles])
        dt = time.perf_counter() - t
        assert all(r == p["workers"] * p["calls"] for r in reports), reports
        return dt, {"instances": sups * (1 + p["workers"]),
                    "calls": sups * p["workers"] * p["calls"]}

    @measures("restart_s")
    def restart(self, p: dict) -> tuple[float, dict]:
        h = self.create("counter", restartable=True)
        pid = self.gather([self.call(h, "pid")])[0]
        alive_before = {q.pid for q in psutil.Process().children(recursive=True)}
        deadline_s = p["deadline_s"]
        failures: dict[str, int] = {}
        t = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while True:
            left = deadline_s - (time.perf_counter() - t)
            try:
                new_pid = self.gather([self.call(h, "pid")], timeout=max(1.0, left))[0]
                break
            except Exception as e:  # noqa: BLE001 - recorded; the call is retried
                text = f"{type(e).__name__}: {e}"[:400]
                failures[text] = failures.get(text, 0) + 1
                if time.perf_counter() - t > deadline_s:
                    raise RuntimeError(
                        f"no call on the instance succeeded within {deadline_s:g} s after "
                        f"SIGKILL of its process {pid}; failed calls (message: count): "
                        f"{failures}") from None
                time.sleep(0.01)
        dt = time.perf_counter() - t
        if new_pid == pid:
            raise RuntimeError(f"the call after SIGKILL came back from the killed pid {pid}")
        return dt, {"killed_pid": pid, "new_pid": new_pid,
                    # True: restarted in a process that was already running (no process start)
                    "new_pid_was_running_before_kill": new_pid in alive_before,
                    "failed_calls_meanwhile": sum(failures.values()),
                    "failure_messages": failures}

    # -- isolation figures ---------------------------------------------------------------

    def _create_ms(self, create: Callable[[], Any], p: dict) -> tuple[float, dict]:
        """``create()`` and its first call back, sequentially, each destroyed after: the
        median ms."""
        n, extra = self.capped("instances", p)
        out = []
        for k in range(p["warmup"] + n):
            t = time.perf_counter()
            h = create()
            assert self.gather([self.call(h, "inc", k)])[0] == k + 1
            dt = (time.perf_counter() - t) * 1000.0
            self.destroy(h)
            if k >= p["warmup"]:
                out.append(dt)
        out.sort()
        return out[len(out) // 2], {**extra, "all_ms": out}

    def _rtt_on(self, h: Any, p: dict) -> tuple[float, dict]:
        value, extra = self._latency(functools.partial(self.call, h, "inc"), p)
        self.destroy(h)
        return value, extra

    def _memory_of(self, create: Callable[[], Any], n: int, settle_s: float) -> tuple[float, dict]:
        """``n`` instances from ``create()`` alive at once, each called once: PSS per
        instance (after - before) / n, and how long creating and calling them took."""
        time.sleep(settle_s)
        before, _ = tree_pss_mb()
        t = time.perf_counter()
        handles = [create() for _ in range(n)]
        assert self.gather([self.call(h, "inc", k) for k, h in enumerate(handles)])[-1] == n
        created = time.perf_counter() - t
        time.sleep(settle_s)
        after, info = tree_pss_mb()
        for h in handles:
            self.destroy(h)
        return (after - before) / n, {"create_and_call_seconds": created,
                                      "pss_before_mb": before, "pss_after_mb": after, **info}

    @measures("isolated_create_ms")
    def isolated_create(self, p: dict) -> tuple[float, dict]:
        return self._create_ms(lambda: self.create_isolated("counter"), p)

    @measures("isolated_rtt_ms")
    def isolated_rtt(self, p: dict) -> tuple[float, dict]:
        return self._rtt_on(self.create_isolated("counter"), p)

    @measures("isolated_task_rtt_ms")
    def isolated_task_rtt(self, p: dict) -> tuple[float, dict]:
        return self._latency(self.submit_isolated, p)

    def _memory_figure(self, create: Callable[[], Any], p: dict,
                       key: str = "instances") -> tuple[float, dict]:
        """:meth:`_memory_of` for ``p[key]`` instances (this system's cap on ``key``)."""
        n, extra = self.capped(key, p)
        value, info = self._memory_of(create, n, p.get("settle_s", 1.0))
        info["processes_counted"] = info.pop("processes")  # by tree_pss_mb, not p[key]
        return value, {**extra, **info}

    @measures("isolated_mem_mb")
    def isolated_memory(self, p: dict) -> tuple[float, dict]:
        return self._memory_figure(lambda: self.create_isolated("counter"), p)

    # -- process instances (light=False; a Ray actor) ---------------------------------------

    @measures("process_create_ms")
    def process_create(self, p: dict) -> tuple[float, dict]:
        return self._create_ms(lambda: self.create_process("counter"), p)

    @measures("process_rtt_ms")
    def process_rtt(self, p: dict) -> tuple[float, dict]:
        return self._rtt_on(self.create_process("counter"), p)

    @measures("process_mem_mb")
    def process_memory(self, p: dict) -> tuple[float, dict]:
        return self._memory_figure(lambda: self.create_process("counter"), p)

    def _many_processes(self, p: dict) -> tuple[float, dict]:
        value, extra = self._memory_figure(lambda: self.create_process("counter"), p,
                                           "processes")
        extra["processes_200_per_s"] = extra["processes"] / extra["create_and_call_seconds"]
        return value, extra

    @measures("processes_200_pss_mb")
    def many_processes_memory(self, p: dict) -> tuple[float, dict]:
        return self._many_processes(p)

    @measures("processes_200_per_s")
    def many_processes_rate(self, p: dict) -> tuple[float, dict]:
        _, extra = self._many_processes(p)
        return extra.pop("processes_200_per_s"), extra

    @measures("blas_matmul_s")
    def blas_matmul(self, p: dict) -> tuple[float, dict]:
        self.gather([self.submit_blas(p["n"], 1)])  # warm: the worker imports numpy
        runs = [self.gather([self.submit_blas(p["n"], p["times"])])[0]
                for _ in range(p["repeats"])]
        last = runs[-1]
        return statistics.median(r["seconds"] for r in runs), {
            "runs_s": [r["seconds"] for r in runs], "blas_threads": last["blas_threads"],
            "kernel": last["kernel"], "omp_num_threads": last["omp_num_threads"]}

    # -- scale figures (python -m benchmarks --cpus N --only scale) ----------------------

    @measures("scale_tasks_per_s")
    def scale_tasks(self, p: dict) -> tuple[float, dict]:
        n, extra = self.capped("tasks", p)
        return self._throughput(self.submit, p["warmup"], n, {**extra, "cpus": N_WORKERS})

    def _efficiency(self, submit: Callable[[], Any], n: int, cpu_s: float,
                    extra: dict) -> tuple[float, dict]:
        """``n`` submissions gathered; efficiency = the ideal time (``cpu_s`` of CPU work
        spread over every core) / the time taken (1.0 is perfect)."""
        self.gather([submit() for _ in range(min(n, N_WORKERS))])  # warm: every worker
        t = time.perf_counter()
        self.gather([submit() for _ in range(n)])
        dt = time.perf_counter() - t
        ideal = cpu_s / N_WORKERS
        return ideal / dt, {**extra, "cpus": N_WORKERS, "seconds": dt, "ideal_seconds": ideal}

    @measures("scale_cpu_tasks_efficiency")
    def scale_cpu_tasks(self, p: dict) -> tuple[float, dict]:
        n, ms = p["tasks_per_cpu"] * N_WORKERS, p["ms"]
        return self._efficiency(lambda: self.submit_spin(ms), n, n * ms / 1000.0,
                                {"tasks": n, "ms": ms})

    @measures("scale_nested_efficiency")
    def scale_nested(self, p: dict) -> tuple[float, dict]:
        parents, children, ms = N_WORKERS, p["children"], p["ms"]
        return self._efficiency(lambda: self.submit_fan_out(children, ms), parents,
                                parents * children * ms / 1000.0,
                                {"parents": parents, "children_each": children, "ms": ms})

    @measures("scale_actor_calls_per_s")
    def scale_actor_calls(self, p: dict) -> tuple[float, dict]:
        calls, extra = self.capped("calls", p)
        actors = [self.create("counter") for _ in range(N_WORKERS)]
        self.gather([self.call(a, "inc", 0) for a in actors])
        t = time.perf_counter()
        out = self.gather([self.call(a, "inc", i) for i in range(calls) for a in actors])
        dt = time.perf_counter() - t
        assert out[-1] == calls
        return calls * N_WORKERS / dt, {**extra, "actors": N_WORKERS, "seconds": dt}

    @measures("scale_actors_per_s")
    def scale_actors(self, p: dict) -> tuple[float, dict]:
        n, extra = self.capped("instances", {**p, "instances": p["per_cpu"] * N_WORKERS})
        _, dt = self._counters(n)
        return n / dt, {**extra, "cpus": N_WORKERS, "seconds": dt}

    # -- elastic figures (python -m benchmarks --only elastic; benchmarks/elastic.py) -------

    def elastic_cluster_kwargs(self) -> dict:
        """What the elastic group's LocalCluster needs for this system (preloads)."""
        raise NotImplementedError

    def join(self, address: str) -> None:  # connect to the cluster at ``address``
        raise NotImplementedError

    def leave(self) -> None:  # disconnect from it (the cluster stays)
        raise NotImplementedError

    @measures("adaptive_first_result_s")
    def adaptive_first_result(self, p: dict) -> tuple[float, dict]:
        return elastic.first_result(self, p)

    def figures(self) -> dict[str, Callable[[dict], tuple[float, dict]]]:
        out = {}
        for attr in dir(type(self)):
            fn = getattr(type(self), attr)
            fig = getattr(fn, "_bench_figure", None)
            if fig is not None and fig not in self.unsupported:
                out[fig] = getattr(self, attr)
        return out


def load(name: str) -> System:
    mod = importlib.import_module(SYSTEM_MODULES[name])
    return mod.SYSTEM
