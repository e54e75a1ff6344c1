"""yrdask: the embedded cluster of ``yr.init(yr.Config(num_cpus=2))``."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import workloads
from benchmarks.registry import N_WORKERS, System, measures


def _homes(dask_scheduler, ids: list) -> dict:
    """instance id -> its worker (run on the scheduler)."""
    lc = dask_scheduler.extensions["yr"].instances.lifecycle
    return {i: lc.instances[i].worker for i in ids}


def _busy(dask_scheduler, worker: str) -> bool:
    """Does ``worker`` hold a yr task lease (run on the scheduler)?"""
    return any(h.kind == "lease" for h in
               dask_scheduler.extensions["yr"].leases.holdings_on(worker))


def _define() -> SimpleNamespace:
    """The remote functions and classes (defined once yrdask is imported, inside the timed init)."""
    import yrdask as yr

    inc = yr.invoke(workloads.inc)
    whoami = yr.invoke(workloads.whoami)

    def probe() -> dict:
        """What the nested figures report besides their timing: the local-first setting.

        ``local_first_config`` is the key as this worker sees it (an environment variable sets
        it even where yrdask ignores it); ``local_first_in_yrdask`` says whether the running
        yrdask's own files mention the key at all.
        """
        import pathlib

        import dask

        root = pathlib.Path(yr.__file__).parent
        used = any("local-first" in text or "local_first" in text
                   for f in root.rglob("*") if f.suffix in (".py", ".yaml")
                   for text in [f.read_text(errors="replace")])
        return {"local_first_config": dask.config.get("yrdask.scheduling.local-first", None),
                "local_first_in_yrdask": used}

    @yr.invoke
    def nested(warmup, calls):
        return {**workloads.nested_rtt(warmup, calls, submit_inc=inc.invoke,
                                       submit_whoami=whoami.invoke, get=yr.get), **probe()}

    @yr.invoke
    def nested_burst(warmup, n):
        return {**workloads.nested_burst(warmup, n, submit_inc=inc.invoke,
                                         submit_whoami=whoami.invoke, get=yr.get), **probe()}

    spin = yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000, memory=0))(workloads.spin)

    @yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000, memory=0))
    def fan_out(children, ms):
        return workloads.fan_out(children, ms, submit_spin=spin.invoke, get=yr.get)

    #: BLAS-bound work holding 2 CPUs (its threads follow them)
    blas = yr.invoke(invoke_options=yr.InvokeOptions(cpu=2000, memory=0))(workloads.blas_matmul)

    @yr.invoke
    def block(mb):
        return b"\0" * (mb * 2**20)  # a large result: its worker keeps it for the driver

    @yr.invoke
    def nbytes_of(box):
        return yr.get(box[0]).nbytes  # box: a list, so the ref is not resolved before the call

    # the instance figures (instances_100_per_s, instance_mem_mb, instance calls, ...) are
    # of light instances, named as such: the default is a process of its own
    # (a checkout from before the choice existed, measured as --baseline, has only light ones)
    light = ({"light": True} if "light" in getattr(yr.InvokeOptions, "__dataclass_fields__", {})
             else {})
    small = yr.InvokeOptions(cpu=10, memory=0, **light)
    Counter = yr.instance(invoke_options=small)(workloads.Counter)
    TrainingWorker = yr.instance(invoke_options=small)(workloads.TrainingWorker)

    @yr.instance(invoke_options=small)
    class TrainingSupervisor:
        def __init__(self, hyperparams):
            self.hyperparams = hyperparams
            self.workers = []

        def start_training(self, num_workers, calls):
            self.workers = [TrainingWorker.invoke() for _ in range(num_workers)]
            results = yr.get([w.train.invoke(i, self.hyperparams)
                              for w in self.workers for i in range(calls)])
            return len(results)

    return SimpleNamespace(
        yr=yr, inc=inc, nested=nested, nested_burst=nested_burst, nbytes_of=nbytes_of,
        spin=spin, fan_out=fan_out, block=block, blas=blas,
        kinds={"counter": Counter, "supervisor": TrainingSupervisor},
        sizes={"small": small, "tiny": yr.InvokeOptions(cpu=0, memory=0, **light)})


class Yrdask(System):
    name = "yrdask"
    object_semantics = (
        "yr.put pickles the value at once (cloudpickle protocol 5, buffers out of band) and "
        "writes its one copy into the node's shared-memory store (a file under /dev/shm); a "
        "driver get maps it zero-copy (read-only numpy view). A task that gets the ref "
        "(passed inside a list) maps the same file on the same node: no copy, no socket "
        "transfer (a task on another node would pull it once for its node)")

    def start(self) -> None:
        self.d = _define()
        self.yr = self.d.yr
        self.creators: dict = {}
        self.info = self.yr.init(self.yr.Config(num_cpus=N_WORKERS))

    def stop(self) -> None:
        self.yr.finalize()

    def elastic_cluster_kwargs(self) -> dict:
        return {"scheduler_kwargs": {"preload": ["yrdask"]}, "preload": ["yrdask"]}

    def join(self, address: str) -> None:
        self.d = _define()
        self.yr = self.d.yr
        self.yr.init(self.yr.Config(server_address=address))

    def leave(self) -> None:
        self.yr.finalize()

    def submit(self, i: int):
        return self.d.inc.invoke(i)

    def gather(self, handles: list, timeout: float | None = None) -> list:
        return self.yr.get(handles, -1 if timeout is None else max(1, round(timeout)))

    def put(self, obj):
        return self.yr.put(obj)

    def fetch(self, handle):
        return self.yr.get(handle)

    def read_in_task(self, handle):
        return self.d.nbytes_of.invoke([handle])

    def nested(self, warmup: int, calls: int) -> dict:
        return self.yr.get(self.d.nested.invoke(warmup, calls))

    def nested_burst(self, warmup: int, n: int) -> dict:
        return self.yr.get(self.d.nested_burst.invoke(warmup, n))

    def create(self, kind: str, *args, size: str = "small", restartable: bool = False):
        key = (kind, size, restartable)
        creator = self.creators.get(key)
        if creator is None:  # one creator per shape: .options() builds a new one each time
            opts = self.d.sizes[size].copy()
            opts.recover_retry_times = 1 if restartable else 0
            creator = self.creators[key] = self.d.kinds[kind].options(opts)
        return creator.invoke(*args)

    def call(self, handle, method: str, *args):
        return getattr(handle, method).invoke(*args)

    def create_isolated(self, kind: str, *args):
        key = (kind, "isolated")
        creator = self.creators.get(key)
        if creator is None:
            opts = self.d.sizes["tiny"].copy()
            opts.light = None
            opts.env_vars = {"YR_BENCH_ISOLATED": "1"}  # implies a process of its own
            creator = self.creators[key] = self.d.kinds[kind].options(opts)
        return creator.invoke(*args)

    def destroy(self, handle) -> None:
        handle.terminate()

    def create_process(self, kind: str, *args):
        key = (kind, "process")
        creator = self.creators.get(key)
        if creator is None:
            opts = self.d.sizes["tiny"].copy()
            opts.light = False  # a process of its own, nothing else asked
            creator = self.creators[key] = self.d.kinds[kind].options(opts)
        return creator.invoke(*args)

    @measures("drain_s")
    def drain(self, p: dict) -> tuple[float, dict]:
        """Scale-down of a worker holding ``instances`` checkpointed instances and
        ``objects`` x ``object_mb`` MB of task results it keeps (docs/deploy.md, "Scaling
        down"): ``client.retire_workers`` of it -> every instance answers from its new home
        with its state and every value reads back."""
        import time

        from distributed import Client

        yr = self.yr
        filler = yr.InvokeOptions(cpu=1000 * (N_WORKERS - 1), memory=0)
        blocker = self.d.kinds["counter"].options(filler).invoke()  # the other worker(s) full
        yr.get(blocker.pid.invoke())
        counters = [self.d.kinds["counter"].invoke() for _ in range(p["instances"])]
        yr.get([c.checkpoint.invoke() for c in counters])  # movable: they have a checkpoint
        yr.get([c.inc.invoke(1) for c in counters])  # state newer than the checkpoint
        refs = [self.d.block.invoke(p["object_mb"]) for _ in range(p["objects"])]
        yr.wait(refs)
        with Client(self.info.scheduler_address, timeout=30) as client:
            where = client.run_on_scheduler(_homes, ids=[c.instance_id for c in counters])
            hosts = set(where.values())
            assert len(hosts) == 1, f"the instances are spread over {hosts}"
            host = hosts.pop()
            blocker.terminate()  # room for them elsewhere
            while client.run_on_scheduler(_busy, worker=host):  # leases go back when idle
                time.sleep(0.05)
            t = time.perf_counter()
            retired = client.retire_workers(workers=[host], close_workers=True)
            t_retired = time.perf_counter() - t
            yr.get([c.inc.invoke(1) for c in counters])
            assert yr.get([c.checkpoint.invoke() for c in counters]) == [2] * len(counters)
            sizes = [len(v) for v in yr.get(refs)]
            dt = time.perf_counter() - t
            moved = client.run_on_scheduler(_homes, ids=[c.instance_id for c in counters])
        assert host in retired and host not in moved.values()
        assert sizes == [p["object_mb"] * 2**20] * p["objects"]
        for c in counters:
            c.terminate()
        return dt, {"retire_workers_s": t_retired, "instances": len(counters),
                    "objects_mb": p["objects"] * p["object_mb"],
                    "same_node": True}

    def submit_isolated(self, i: int):
        if "inc_isolated" not in self.creators:
            opts = self.d.sizes["tiny"].copy()
            opts.light = None
            opts.env_vars = {"YR_BENCH_ISOLATED": "1"}
            self.creators["inc_isolated"] = self.d.inc.options(opts)
        return self.creators["inc_isolated"].invoke(i)


    def submit_spin(self, ms: float):
        return self.d.spin.invoke(ms)

    def submit_fan_out(self, children: int, ms: float):
        return self.d.fan_out.invoke(children, ms)

    def submit_blas(self, n: int, times: int):
        return self.d.blas.invoke(n, times)


SYSTEM = Yrdask()
