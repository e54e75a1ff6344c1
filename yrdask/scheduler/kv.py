"""The cluster's KV store (``yr.kv_write`` / ``kv_read`` / ``kv_del`` ...), kept by the scheduler.

:class:`KVStore` is the pure part: keys to bytes with yr's rules, no I/O and no clock of its
own (every call takes ``now``, in seconds):

* ``nx`` writes refuse keys that exist (``ExistenceOpt.NX``); a multi-key write is all or
  nothing.
* ``ttl`` > 0 makes a key expire ``ttl`` s after its write: an expired key reads as missing
  (checked on every access) and :meth:`KVStore.sweep` drops it for good.
* The values (and keys) together stay under ``max_bytes`` (Dask config
  ``yrdask.kv.max-bytes``).  A write that needs room first drops *evictable* keys
  (``WriteMode.NONE_L2_CACHE_EVICT``), oldest first; if that is not enough it is refused with
  a reason naming the bound and the config key.
* Readers of missing keys wait: :meth:`KVStore.wait` registers a waiter, a later write that
  completes its keys answers it (:class:`Ready`), and the adapter withdraws it on time-out.

:class:`KVServer` is its Dask adapter on the scheduler: the ``KV_RPC`` handlers of
:mod:`yrdask.protocol`, asyncio futures for the waiters, and a periodic sweep.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

DEFAULT_MAX_BYTES = 256 * 2**20
CONFIG_KEY = "yrdask.kv.max-bytes"
SWEEP_MS = 1000  # how often expired keys are dropped


class KVExists(Exception):
    """An ``nx`` write found keys that exist (``keys``)."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(f"key(s) already exist: {keys}")
        self.keys = keys


class KVFull(Exception):
    """A write would take the store over its bound; the message names it and the config key."""


@dataclass
class _Item:
    value: bytes
    expires_at: float | None  # None: never
    evictable: bool
    seq: int  # write order, for eviction (oldest first)

    @property
    def size(self) -> int:
        return len(self.value)


@dataclass
class Ready:
    """Waiter ``waiter_id`` has all its keys: answer it with ``values`` (in its key order)."""

    waiter_id: str
    values: list[bytes]


@dataclass
class _Waiter:
    keys: tuple[str, ...]
    missing: set[str] = field(default_factory=set)


class KVStore:
    """Keys -> bytes with existence, ttl, a size bound and waiters (see module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self.items: dict[str, _Item] = {}
        self.nbytes = 0  # sum of key and value sizes of live items
        self.waiters: dict[str, _Waiter] = {}
        self.waiting_on: dict[str, set[str]] = {}  # key -> waiter ids
        self.evicted: list[str] = []  # the keys the last put evicted
        self._seq = itertools.count()

    # -- queries ---------------------------------------------------------------------------

    def _live(self, key: str, now: float) -> _Item | None:
        item = self.items.get(key)
        if item is not None and item.expires_at is not None and item.expires_at <= now:
            self._drop(key)
            return None
        return item

    def get(self, keys: Sequence[str], now: float) -> tuple[list[bytes], list[str]]:
        """``(values, missing)``: the values of the present keys in order, and the others."""
        values, missing = [], []
        for key in keys:
            item = self._live(key, now)
            if item is None:
                missing.append(key)
            else:
                values.append(item.value)
        return values, missing

    def __len__(self) -> int:
        return len(self.items)

    # -- writes ----------------------------------------------------------------------------

    def put(self, keys: Sequence[str], values: Sequence[bytes], now: float, nx: bool = False,
            ttl: float = 0.0, evictable: bool = False) -> list[Ready]:
        """Write all pairs or none; returns the waiters this write completes.

        Raises :class:`KVExists` (``nx`` and a key exists) or :class:`KVFull`.
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        pairs = dict(zip(keys, values))  # a key given twice: its last value
        if nx:
            taken = [k for k in pairs if self._live(k, now) is not None]
            if taken:
                raise KVExists(taken)
        for k in pairs:
            self._live(k, now)  # drop expired ones first, so they do not count
        freed = sum(len(k) + self.items[k].size for k in pairs if k in self.items)
        needed = sum(len(k) + len(v) for k, v in pairs.items())
        over = self.nbytes - freed + needed - self.max_bytes
        if over > 0:
            victims = self._evictable(over, exclude=pairs)
            if victims is None:
                raise KVFull(
                    f"the KV store would hold {self.nbytes - freed + needed} bytes, over its "
                    f"bound of {self.max_bytes} bytes (Dask config {CONFIG_KEY}): delete keys "
                    f"with yr.kv_del, write with ttl_second, or raise {CONFIG_KEY}")
            for key in victims:
                self._drop(key)
            self.evicted = victims
        else:
            self.evicted = []
        expires_at = now + ttl if ttl and ttl > 0 else None
        for key, value in pairs.items():
            if key in self.items:
                self._drop(key)
            self.items[key] = _Item(bytes(value), expires_at, evictable, next(self._seq))
            self.nbytes += len(key) + len(value)
        return self._wake(pairs, now)

    def _evictable(self, need: int, exclude: Any) -> list[str] | None:
        """Evictable keys, oldest first, that free at least ``need`` bytes; None if they can't."""
        got, out = 0, []
        for key, item in sorted(self.items.items(), key=lambda kv: kv[1].seq):
            if item.evictable and key not in exclude:
                out.append(key)
                got += len(key) + item.size
                if got >= need:
                    return out
        return None

    def delete(self, keys: Sequence[str], now: float) -> int:
        """Delete ``keys`` (absent ones are ignored); returns how many were present."""
        n = 0
        for key in dict.fromkeys(keys):
            if self._live(key, now) is not None:
                self._drop(key)
                n += 1
        return n

    def _drop(self, key: str) -> None:
        item = self.items.pop(key)
        self.nbytes -= len(key) + item.size

    def sweep(self, now: float) -> list[str]:
        """Drop every expired key; returns them."""
        gone = [k for k, it in self.items.items()
                if it.expires_at is not None and it.expires_at <= now]
        for key in gone:
            self._drop(key)
        return gone

    # -- waiters ---------------------------------------------------------------------------

    def wait(self, waiter_id: str, keys: Sequence[str], now: float) -> list[bytes] | None:
        """The values if every key is present now; else registers the waiter and returns None."""
        values, missing = self.get(keys, now)
        if not missing:
            return values
        self.waiters[waiter_id] = _Waiter(tuple(keys), set(missing))
        for key in missing:
            self.waiting_on.setdefault(key, set()).add(waiter_id)
        return None

    def cancel_wait(self, waiter_id: str) -> list[str]:
        """Withdraw a waiter (timed out, caller gone); returns the keys it still missed."""
        waiter = self.waiters.pop(waiter_id, None)
        if waiter is None:
            return []
        for key in waiter.missing:
            ids = self.waiting_on.get(key)
            if ids is not None:
                ids.discard(waiter_id)
                if not ids:
                    del self.waiting_on[key]
        return sorted(waiter.missing)

    def _wake(self, written: Any, now: float) -> list[Ready]:
        out = []
        for key in written:
            for wid in self.waiting_on.pop(key, ()):
                waiter = self.waiters.get(wid)
                if waiter is None:
                    continue
                waiter.missing.discard(key)
                if waiter.missing:
                    continue
                values, missing = self.get(waiter.keys, now)
                if missing:  # one of its keys expired meanwhile: keep waiting for it
                    waiter.missing = set(missing)
                    for k in missing:
                        self.waiting_on.setdefault(k, set()).add(wid)
                    continue
                del self.waiters[wid]
                out.append(Ready(wid, values))
        return out


class KVServer:
    """The store's Dask adapter: ``kv_put``/``kv_get``/``kv_del`` handlers (``P.KV_RPC``)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.configured = max_bytes is None
        if max_bytes is None:
            max_bytes = configured_max_bytes()
        self.store = KVStore(max_bytes)
        self.futures: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.counters: collections.Counter = collections.Counter()
        self.durable: Any = None  # scheduler/durable.py: writes kept for a restart

    @staticmethod
    def _now() -> float:
        import time

        return time.monotonic()

    def start(self, scheduler: Any) -> None:
        """Sweep expired keys every :data:`SWEEP_MS` ms on the scheduler's loop."""
        from tornado.ioloop import PeriodicCallback

        pc = PeriodicCallback(self.sweep, SWEEP_MS)
        scheduler.periodic_callbacks["yr-kv-sweep"] = pc
        pc.start()

    def sweep(self) -> None:
        now = self._now()
        gone = self.store.sweep(now)
        self.counters["expired"] += len(gone)
        if gone and self.durable is not None:
            self.durable.kv_written(self.store, gone, now)

    def kv_put(self, keys: Sequence[str], values: Sequence[bytes], nx: bool = False,
               ttl_s: float = 0.0, evictable: bool = False) -> list:
        if self.configured:  # the bound follows the scheduler's Dask config as it changes
            self.store.max_bytes = configured_max_bytes()
        try:
            ready = self.store.put(list(keys), list(values), self._now(), nx, ttl_s, evictable)
        except KVExists as e:
            return ["exists", e.keys]
        except KVFull as e:
            return ["full", str(e)]
        if self.durable is not None:
            self.durable.kv_written(self.store, [*keys, *self.store.evicted], self._now())
        for r in ready:
            fut = self.futures.pop(r.waiter_id, None)
            if fut is not None and not fut.done():
                fut.set_result(r.values)
        return ["ok", None]

    async def kv_get(self, keys: Sequence[str], timeout: float | None = None) -> list:
        keys = list(keys)
        wid = f"w{next(self._ids)}"
        values = self.store.wait(wid, keys, self._now())
        if values is not None:
            return ["ok", values]
        if timeout is not None and timeout <= 0:
            return ["missing", self.store.cancel_wait(wid)]
        fut = asyncio.get_running_loop().create_future()
        self.futures[wid] = fut
        try:
            return ["ok", await asyncio.wait_for(fut, timeout)]
        except asyncio.TimeoutError:
            return ["missing", self.store.cancel_wait(wid)]
        finally:  # answered, timed out, or the caller went away
            self.futures.pop(wid, None)
            self.store.cancel_wait(wid)

    def kv_del(self, keys: Sequence[str]) -> list:
        n = self.store.delete(list(keys), self._now())
        if n and self.durable is not None:
            self.durable.kv_written(self.store, keys, self._now())
        return ["ok", n]


def configured_max_bytes() -> int:
    """``yrdask.kv.max-bytes`` from the Dask config (bytes, or a string like ``"256 MiB"``)."""
    import dask
    from dask.utils import parse_bytes

    value = dask.config.get(CONFIG_KEY, DEFAULT_MAX_BYTES)
    if isinstance(value, str):
        value = parse_bytes(value)
    return int(value)
