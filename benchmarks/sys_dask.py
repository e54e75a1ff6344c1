"""Plain dask.distributed: ``LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``."""

from __future__ import annotations

from benchmarks.registry import N_WORKERS, System


def inc(i):
    return i + 1


def nested(warmup, calls):
    import statistics
    import time

    from distributed import worker_client

    with worker_client() as c:
        for i in range(warmup):
            c.submit(inc, i, pure=False).result()
        out = []
        for i in range(calls):
            t = time.perf_counter()
            c.submit(inc, i, pure=False).result()
            out.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(out)


class Dask(System):
    name = "dask"

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

    def submit(self, i: int):
        return self.client.submit(inc, i, pure=False)

    def gather(self, handles: list) -> list:
        return self.client.gather(handles)

    def put(self, obj):
        # Dask's put: scatter to a worker (hash=False: no tokenising); fetch brings it back.
        return self.client.scatter(obj, hash=False)

    def fetch(self, handle):
        return handle.result()

    def nested(self, warmup: int, calls: int) -> float:
        return self.client.submit(nested, warmup, calls, pure=False).result()


SYSTEM = Dask()
