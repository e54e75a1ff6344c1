"""Ray: ``ray.init(num_cpus=2)`` (measured only when ``import ray`` works).

Instances are Ray actors: ``num_cpus=0.01`` ("small") or ``num_cpus=0`` ("tiny"); each actor
is a worker process of its own.
"""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import workloads
from benchmarks.registry import N_WORKERS, System


def _define() -> SimpleNamespace:
    import ray

    inc = ray.remote(workloads.inc)
    whoami = ray.remote(workloads.whoami)

    @ray.remote
    def nested(warmup, calls):
        return workloads.nested_rtt(warmup, calls, submit_inc=inc.remote,
                                    submit_whoami=whoami.remote, get=ray.get)

    @ray.remote
    def nested_burst(warmup, n):
        return workloads.nested_burst(warmup, n, submit_inc=inc.remote,
                                      submit_whoami=whoami.remote, get=ray.get)

    spin = ray.remote(num_cpus=1)(workloads.spin)

    @ray.remote(num_cpus=1)
    def fan_out(children, ms):
        return workloads.fan_out(children, ms, submit_spin=spin.remote, get=ray.get)

    blas = ray.remote(num_cpus=2)(workloads.blas_matmul)

    @ray.remote
    def nbytes_of(box):
        return ray.get(box[0]).nbytes  # box: a list, so Ray does not resolve the ref itself

    Counter = ray.remote(workloads.Counter)
    TrainingWorker = ray.remote(num_cpus=0.01)(workloads.TrainingWorker)

    @ray.remote
    class TrainingSupervisor:
        def __init__(self, hyperparams):
            self.hyperparams = hyperparams
            self.workers = []

        def start_training(self, num_workers, calls):
            self.workers = [TrainingWorker.remote() for _ in range(num_workers)]
            results = ray.get([w.train.remote(i, self.hyperparams)
                               for w in self.workers for i in range(calls)])
            return len(results)

    return SimpleNamespace(
        ray=ray, inc=inc, nested=nested, nested_burst=nested_burst, nbytes_of=nbytes_of,
        spin=spin, fan_out=fan_out, blas=blas,
        kinds={"counter": Counter, "supervisor": TrainingSupervisor},
        sizes={"small": 0.01, "tiny": 0})


class Ray(System):
    name = "ray"
    requires = "ray"
    install_hint = "pip install -e .[bench]"
    unsupported = {
        "adaptive_first_result_s": "it needs Ray's autoscaler with a node provider (the "
                                   "fake multi-node one of ray.cluster_utils."
                                   "AutoscalingCluster), not Dask's deployer: not set up here",
    }
    caps = {
        "instances": (6, 3, "every Ray actor is a worker process of its own (~45 MB): they "
                            "start at ~1-3 per second on this 2-core machine"),
        "processes": (10, 6, "every Ray actor is a worker process of its own (~45-60 MB) "
                             "that starts in ~1-3 s here: 200 would take ~10 GB and minutes, "
                             "and with 20 at load average 25 Ray's node was declared dead"),
        "tasks": (5000, 1000, "Ray runs ~1000 trivial tasks/s here: 5000 give the same rate "
                              "in half the time"),
        "calls": (5000, 1000, "Ray runs ~1500 actor calls/s here: 5000 give the same rate in "
                              "a third of the time"),
    }
    object_semantics = (
        "ray.put serializes the array into the plasma shared-memory store; a driver get maps "
        "it zero-copy (read-only numpy view). A task that gets the ref (passed inside a list) "
        "maps the same shared memory on the same node: no copy, no socket transfer")

    def start(self) -> None:
        self.d = _define()
        self.ray = self.d.ray
        self.ray.init(num_cpus=N_WORKERS)

    def stop(self) -> None:
        self.ray.shutdown()

    def submit(self, i: int):
        return self.d.inc.remote(i)

    def gather(self, handles: list, timeout: float | None = None) -> list:
        return self.ray.get(handles, timeout=timeout)

    def put(self, obj):
        return self.ray.put(obj)

    def fetch(self, handle):
        return self.ray.get(handle)

    def read_in_task(self, handle):
        return self.d.nbytes_of.remote([handle])

    def nested(self, warmup: int, calls: int) -> dict:
        return self.ray.get(self.d.nested.remote(warmup, calls))

    def nested_burst(self, warmup: int, n: int) -> dict:
        return self.ray.get(self.d.nested_burst.remote(warmup, n))

    def create(self, kind: str, *args, size: str = "small", restartable: bool = False):
        opts: dict = {"num_cpus": self.d.sizes[size]}
        if restartable:
            opts.update(max_restarts=1, max_task_retries=-1)
        return self.d.kinds[kind].options(**opts).remote(*args)

    def call(self, handle, method: str, *args):
        return getattr(handle, method).remote(*args)

    _ENV = {"env_vars": {"YR_BENCH_ISOLATED": "1"}}

    def create_isolated(self, kind: str, *args):
        return self.d.kinds[kind].options(num_cpus=0, runtime_env=self._ENV).remote(*args)

    def destroy(self, handle) -> None:
        self.ray.kill(handle)

    def create_process(self, kind: str, *args):
        return self.d.kinds[kind].options(num_cpus=0).remote(*args)  # every actor is one

    def submit_isolated(self, i: int):
        return self.d.inc.options(runtime_env=self._ENV).remote(i)


    def submit_spin(self, ms: float):
        return self.d.spin.remote(ms)

    def submit_fan_out(self, children: int, ms: float):
        return self.d.fan_out.remote(children, ms)

    def submit_blas(self, n: int, times: int):
        return self.d.blas.remote(n, times)


SYSTEM = Ray()
