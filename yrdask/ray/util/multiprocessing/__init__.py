"""``ray.util.multiprocessing``: ``multiprocessing.Pool``'s API over a pool of actors."""

from __future__ import annotations

from multiprocessing import TimeoutError

from yrdask.ray.util.multiprocessing.pool import AsyncResult, IMapIterator, Pool

__all__ = ["AsyncResult", "IMapIterator", "Pool", "TimeoutError"]
