"""joblib's ``"ray"`` backend: joblib's batches run on a ``ray.util.multiprocessing.Pool``.

Built from joblib's own pool mix-ins (the pool's ``apply_async`` with a callback, the same
auto-batching as joblib's multiprocessing backend); ``n_jobs=-1`` is the cluster's CPUs.
"""

from __future__ import annotations

from typing import Any

from joblib._parallel_backends import (AutoBatchingMixin, FallbackToBackend,
                                       ParallelBackendBase, PoolManagerMixin, SequentialBackend)

__all__ = ["RayBackend"]


class RayBackend(PoolManagerMixin, AutoBatchingMixin, ParallelBackendBase):
    """A joblib backend whose workers are the actor processes of a Pool; ``ray_remote_args``
    (here or in ``Parallel(...)``) are the actors' options."""

    supports_retrieve_callback = True
    supports_return_generator = False  # as joblib's multiprocessing backend

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None,
                 ray_remote_args: dict | None = None, **kwargs: Any) -> None:
        self.ray_remote_args = ray_remote_args
        super().__init__(nesting_level=nesting_level,
                         inner_max_num_threads=inner_max_num_threads, **kwargs)

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """``n_jobs`` < 0 counts back from the cluster's CPUs (−1: all of them)."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if n_jobs < 0:
            from yrdask.ray._session import ensure_init
            from yrdask.ray.worker import cluster_resources

            ensure_init()
            return max(int(cluster_resources().get("CPU", 1)) + 1 + n_jobs, 1)
        return n_jobs

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: Any = None,
                  require: Any = None, ray_remote_args: dict | None = None,
                  **pool_args: Any) -> int:
        """Start the Pool of ``n_jobs`` processes (one job: joblib's sequential backend).

        ``pool_args`` are what ``Parallel`` hands every backend for memory-mapping large
        arrays to local worker processes (``max_nbytes``, ``mmap_mode``, ``temp_folder``...);
        the actors get their arguments through the object store instead.
        """
        from yrdask.ray.util.multiprocessing.pool import Pool

        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self.parallel = parallel
        self._pool = Pool(n_jobs, ray_remote_args=ray_remote_args or self.ray_remote_args)
        self.reset_batch_stats()
        return n_jobs

    def terminate(self) -> None:
        super().terminate()
        self.reset_batch_stats()
