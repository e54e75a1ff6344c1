"""Plain dask.distributed: ``LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``.

Instances are Dask actors (``client.submit(Cls, actor=True)``); a handle holds the actor's
future, resolved to the ``Actor`` proxy once, at its first call.
"""

from __future__ import annotations

import functools

from benchmarks import workloads
from benchmarks.registry import N_WORKERS, System
from benchmarks.workloads import Counter, TrainingWorker, inc, whoami


def _submitter(client, fn):
    return functools.partial(client.submit, fn, pure=False)


def nested(warmup, calls):
    from distributed import Future, worker_client

    with worker_client() as c:
        return workloads.nested_rtt(warmup, calls, submit_inc=_submitter(c, inc),
                                    submit_whoami=_submitter(c, whoami), get=c.gather,
                                    get_one=Future.result)


def nested_burst(warmup, n):
    from distributed import worker_client

    with worker_client() as c:
        return workloads.nested_burst(warmup, n, submit_inc=_submitter(c, inc),
                                      submit_whoami=_submitter(c, whoami), get=c.gather)


def fan_out(children, ms):
    from distributed import worker_client

    with worker_client() as c:  # secedes: the thread's core goes to the children meanwhile
        return workloads.fan_out(children, ms, submit_spin=_submitter(c, workloads.spin),
                                 get=c.gather)


def nbytes_of(box):
    return box[0].nbytes  # Dask resolves futures nested in arguments before the call


class TrainingSupervisor:
    """The seed's supervisor as a Dask actor.

    ``start_training`` is ``async``: it runs on the worker's event loop, which keeps the
    worker's single actor thread free for the TrainingWorker calls it waits for (a sync
    method would block that thread and deadlock when its workers share the process).
    """

    def __init__(self, hyperparams):
        self.hyperparams = hyperparams
        self.workers = []

    async def start_training(self, num_workers, calls):
        from distributed import get_client

        client = get_client()
        futures = [client.submit(TrainingWorker, actor=True, pure=False)
                   for _ in range(num_workers)]
        self.workers = [await f for f in futures]
        calls = [w.train(i, self.hyperparams) for w in self.workers for i in range(calls)]
        results = [await c for c in calls]
        return len(results)


KINDS = {"counter": Counter, "supervisor": TrainingSupervisor}


class ActorHandle:
    """An actor's future, and its ``Actor`` proxy once a call needed it."""

    __slots__ = ("future", "actor")

    def __init__(self, future):
        self.future = future
        self.actor = None


class Dask(System):
    name = "dask"
    unsupported = {
        **{fig: "Dask has no per-actor or per-task process with its own environment"
           for fig in ("isolated_create_ms", "isolated_rtt_ms", "isolated_task_rtt_ms",
                       "isolated_mem_mb")},
        **{fig: "a Dask actor lives in a worker process it shares; Dask starts no process "
                "per actor"
           for fig in ("process_create_ms", "process_rtt_ms", "process_mem_mb",
                       "processes_200_pss_mb", "processes_200_per_s")},
        "blas_matmul_s": "Dask has no per-task CPU count: its workers run numpy with "
                         "OMP_NUM_THREADS=1 (the nanny's pre-spawn environment)",
        "restart_s": "Dask actors are never restarted: when the worker hosting an actor dies, "
                     "the actor is lost (its future errs) and distributed has no "
                     "max_restarts for actors",
    }
    caps = {
        "tasks": (3000, 1000, "plain Dask runs ~200-400 trivial tasks/s here; 10 000 would "
                              "take 25-50 s per run"),
        "calls": (1000, 300, "Dask actor calls submitted at once run at ~100-500/s here; "
                             "10 000 would take over a minute per run"),
        "instances": (300, 100, "Dask actors are created at ~60-130/s here (each is a "
                                "scheduler task); 1000+ would take 10+ s per run"),
    }
    object_semantics = (
        "put = client.scatter(hash=False): the array is pickled and sent to one worker. "
        "driver get = future.result(): it comes back over TCP (so even the 'local' figure is "
        "two cross-process transfers). A task reading it gets the future resolved as an "
        "argument; the scheduler runs that task on the worker already holding the data, so "
        "the task's read is local and the only transfer is the scatter")

    def start(self) -> None:
        import logging

        from distributed import Client, LocalCluster

        logging.getLogger("distributed").setLevel(logging.WARNING)
        self.cluster = LocalCluster(n_workers=N_WORKERS, threads_per_worker=1, processes=True,
                                    dashboard_address=":0")
        self.client = Client(self.cluster)
        self.client.wait_for_workers(N_WORKERS)

    def stop(self) -> None:
        self.client.close()
        self.cluster.close()

    def elastic_cluster_kwargs(self) -> dict:
        return {}

    def join(self, address: str) -> None:
        from distributed import Client

        self.client = Client(address)

    def leave(self) -> None:
        self.client.close()

    def submit(self, i: int):
        return self.client.submit(inc, i, pure=False)

    def gather(self, handles: list, timeout: float | None = None) -> list:
        from distributed import Future

        if all(isinstance(h, Future) for h in handles):
            return self.client.gather(handles)
        return [h.result(timeout) for h in handles]  # ActorFutures of method calls

    def put(self, obj):
        # Dask's put: scatter to a worker (hash=False: no tokenising); fetch brings it back.
        return self.client.scatter(obj, hash=False)

    def fetch(self, handle):
        return handle.result()

    def read_in_task(self, handle):
        return self.client.submit(nbytes_of, [handle], pure=False)

    def nested(self, warmup: int, calls: int) -> dict:
        return self.client.submit(nested, warmup, calls, pure=False).result()

    def nested_burst(self, warmup: int, n: int) -> dict:
        return self.client.submit(nested_burst, warmup, n, pure=False).result()

    def create(self, kind: str, *args, size: str = "small", restartable: bool = False):
        # Dask actors reserve no resources: ``size`` has nothing to map to.
        return ActorHandle(self.client.submit(KINDS[kind], *args, actor=True, pure=False))

    def call(self, handle: ActorHandle, method: str, *args):
        if handle.actor is None:  # future.result() is a round trip to the client's loop
            handle.actor = handle.future.result()
        return getattr(handle.actor, method)(*args)

    def submit_spin(self, ms: float):
        return self.client.submit(workloads.spin, ms, pure=False)

    def submit_fan_out(self, children: int, ms: float):
        return self.client.submit(fan_out, children, ms, pure=False)


SYSTEM = Dask()
