"""``ray.util.multiprocessing.Pool``: ``multiprocessing.Pool`` with actors as its processes.

Each pool process is an actor that is a process of its own (``yrdask_light=False``), so what
the initializer sets (module globals, open files) holds per pool process, as with
``multiprocessing``.  Work goes to the actors round robin in chunks (one actor call runs a
chunk); an AsyncResult settles through its refs' completion callbacks (no thread of its own),
an imap iterator waits for its chunks in the caller's thread.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from multiprocessing import TimeoutError
from typing import Any, Callable, Iterable, Iterator

__all__ = ["AsyncResult", "IMapIterator", "Pool"]


class _Failed:
    """A call of a chunk that raised: its exception, re-raised by ``get`` with its type."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self):
        return _Failed, (self.error,)


class _PoolProcess:
    """One pool process: runs the initializer once, then chunks of calls."""

    def __init__(self, initializer: Callable | None, initargs: tuple) -> None:
        if initializer is not None:
            initializer(*initargs)

    def ping(self) -> int:
        return os.getpid()

    def run_chunk(self, func: Callable, chunk: list, form: str) -> list:
        """``func`` over ``chunk``'s items, each as ``form`` says: ``"one"`` argument,
        ``"star"`` (a tuple of arguments) or ``"call"`` (an ``(args, kwargs)`` pair)."""
        out = []
        for item in chunk:
            try:
                if form == "call":
                    out.append(func(*item[0], **item[1]))
                else:
                    out.append(func(*item) if form == "star" else func(item))
            except Exception as e:  # noqa: BLE001 - handed back to the caller's get
                out.append(_Failed(e))
        return out

    def stop(self) -> None:
        """End this actor once the calls queued before this one are done (``close``)."""
        from yrdask.ray.actor import exit_actor

        exit_actor()


def _chunk_error(ref: Any) -> tuple[list | None, BaseException | None]:
    """A finished chunk's values, or the error that lost the whole chunk (its actor died)."""
    from yrdask.ray.worker import get

    try:
        return get(ref), None
    except Exception as e:  # noqa: BLE001 - the chunk's error, raised at the result's get
        return None, e


def _first_error(values: list) -> BaseException | None:
    for v in values:
        if isinstance(v, _Failed):
            return v.error
    return None


class AsyncResult:
    """The result of ``apply_async``/``map_async``/``starmap_async``: ``get``, ``wait``,
    ``ready``, ``successful``, as ``multiprocessing.pool.AsyncResult``."""

    def __init__(self, refs: list, callback: Callable | None = None,
                 error_callback: Callable | None = None, single: bool = False) -> None:
        self._single = single
        self._callback, self._error_callback = callback, error_callback
        self._chunks: list = [None] * len(refs)
        self._left = len(refs)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._event = threading.Event()
        if not refs:
            self._finish()
        for i, ref in enumerate(refs):
            ref.on_complete(lambda r, i=i: self._chunk_done(i, r))

    def _chunk_done(self, index: int, ref: Any) -> None:
        values, error = _chunk_error(ref)
        with self._lock:
            if error is None:
                self._chunks[index] = values
                error = _first_error(values)
            if error is not None and self._error is None:
                self._error = error  # the first to finish, as on Ray
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        """Callbacks run before ``ready()`` turns true, as in ``multiprocessing``."""
        try:
            if self._error is not None:
                if self._error_callback is not None:
                    self._error_callback(self._error)
            elif self._callback is not None:
                self._callback(self._value())
        finally:
            self._event.set()

    def _value(self) -> Any:
        values = [v for chunk in self._chunks for v in chunk]
        return values[0] if self._single else values

    def ready(self) -> bool:
        """Whether every call is done."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until ready, or ``timeout`` seconds (no error either way)."""
        self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        """The result (``map``: the list of results in order); raises the first call's error
        with its own type, or ``multiprocessing.TimeoutError`` after ``timeout`` seconds."""
        if not self._event.wait(timeout):
            raise TimeoutError
        if self._error is not None:
            raise self._error
        return self._value()

    def successful(self) -> bool:
        """Whether no call raised; ``ValueError`` if not ready yet."""
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._error is None


class IMapIterator:
    """The iterator ``imap``/``imap_unordered`` return: one chunk in flight per pool process,
    the next submitted as each finishes (as on Ray); ``next(timeout)`` as
    ``multiprocessing``'s.  Finished chunks are found by ``wait`` in the caller's thread."""

    def __init__(self, pool: "Pool", func: Callable, iterable: Iterable, chunksize: int,
                 ordered: bool) -> None:
        self._pool, self._func, self._ordered = pool, func, ordered
        self._items = iter(iterable)
        self._chunksize = chunksize
        self._submitted = 0
        self._exhausted = False
        self._running: dict = {}  # ref -> chunk index
        self._finished: dict = {}  # chunk index -> ref, in finishing order, not yet taken
        self._next_chunk = 0  # ordered: the chunk whose values come next
        self._buffer: collections.deque = collections.deque()
        for _ in range(len(pool._actors)):
            self._submit_next()

    def _submit_next(self) -> None:
        if self._exhausted:
            return
        chunk = list(itertools.islice(self._items, self._chunksize))
        if len(chunk) < self._chunksize:
            self._exhausted = True
        if not chunk:
            return
        self._running[self._pool._submit(self._func, chunk, "one")] = self._submitted
        self._submitted += 1

    def __iter__(self) -> Iterator:
        return self

    def _take(self) -> Any:
        """The ref of the chunk whose values come next, if it has finished."""
        if self._ordered:
            return self._finished.pop(self._next_chunk, None)
        if self._finished:
            return self._finished.pop(next(iter(self._finished)))
        return None

    def next(self, timeout: float | None = None) -> Any:
        """The next result; raises its call's error, ``StopIteration`` at the end, or
        ``multiprocessing.TimeoutError`` after ``timeout`` seconds."""
        import time

        from yrdask.ray.worker import wait

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._buffer:
            ref = self._take()
            if ref is None:
                if not self._running:
                    raise StopIteration
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = wait(list(self._running), num_returns=1, timeout=left)
                if not ready:
                    raise TimeoutError
                for r in ready:
                    self._finished[self._running.pop(r)] = r
                    self._submit_next()
                continue
            self._next_chunk += 1
            values, error = _chunk_error(ref)
            if error is not None:
                raise error
            self._buffer.extend(values)
        value = self._buffer.popleft()
        if isinstance(value, _Failed):
            raise value.error
        return value

    __next__ = next


def _check_positive(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, "
                         f"got {value!r}")


class Pool:
    """A pool of ``processes`` actor processes (default: the cluster's CPUs), each running
    ``initializer(*initargs)`` once; ``maxtasksperchild`` chunks per process before it is
    replaced.  Joins ``ray_address`` (or starts yrdask) if ``ray.init`` was not called."""

    def __init__(self, processes: int | None = None, initializer: Callable | None = None,
                 initargs: Iterable = (), maxtasksperchild: int | None = None,
                 context: Any = None, ray_address: str | None = None,
                 ray_remote_args: dict | None = None) -> None:
        from yrdask.ray.actor import ActorClass
        from yrdask.ray.worker import cluster_resources, get, init, is_initialized

        _check_positive("processes", processes)
        _check_positive("maxtasksperchild", maxtasksperchild)
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, got {initializer!r}")
        if context is not None:
            raise ValueError("Pool(context=...) has no meaning on yrdask: the pool's processes "
                             "are actors; leave context out")
        if ray_remote_args is not None and not isinstance(ray_remote_args, dict):
            raise TypeError(f"ray_remote_args must be a dict of actor options, got "
                            f"{ray_remote_args!r}")
        if not is_initialized():
            if ray_address is not None:
                init(address=ray_address)
            elif "RAY_ADDRESS" in os.environ:
                init()
            else:
                init(num_cpus=processes)
        cpus = int(cluster_resources().get("CPU", 0))
        if processes is None:
            processes = max(cpus, 1)
        if cpus < processes:
            raise ValueError(f"Tried to start a pool with {processes} processes on an existing "
                             f"ray cluster, but there are only {cpus} CPUs in the ray cluster.")
        self._initializer, self._initargs = initializer, tuple(initargs or ())
        self._maxtasks = maxtasksperchild
        options = {"num_cpus": 0, "yrdask_light": False, **(ray_remote_args or {})}
        self._actor_class = ActorClass(_PoolProcess, options)
        self._closed = False
        self._lock = threading.Lock()  # submits from callbacks (joblib) and the caller
        self._stopping: list = []  # refs of the stop calls of closed or replaced actors
        self._retired: list = []  # replaced actors, killed too by terminate
        self._next = 0
        self._actors = [[self._new_actor(), 0] for _ in range(processes)]
        get([a.ping.remote() for a, _ in self._actors])

    def _new_actor(self) -> Any:
        return self._actor_class.remote(self._initializer, self._initargs)

    def _check_running(self) -> None:
        if self._closed:
            raise ValueError("Pool not running")

    def _submit(self, func: Callable, chunk: list, form: str) -> Any:
        """Run ``chunk`` on the next process in turn; replace it after ``maxtasksperchild``."""
        with self._lock:
            self._check_running()
            slot = self._actors[self._next]
            self._next = (self._next + 1) % len(self._actors)
            ref = slot[0].run_chunk.remote(func, chunk, form)
            slot[1] += 1
            if self._maxtasks is not None and slot[1] >= self._maxtasks:
                self._retire(slot[0])
                slot[:] = [self._new_actor(), 0]
            return ref

    def _retire(self, actor: Any) -> None:
        """Let ``actor`` finish the calls it has, then end."""
        self._stopping.append(actor.stop.remote())
        self._retired.append(actor)

    # -- multiprocessing.Pool's methods --------------------------------------------------------

    def apply(self, func: Callable, args: tuple = (), kwds: dict | None = None) -> Any:
        """``func(*args, **kwds)`` in a pool process; its result."""
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable, args: tuple = (), kwds: dict | None = None,
                    callback: Callable | None = None,
                    error_callback: Callable | None = None) -> AsyncResult:
        """``func(*args, **kwds)`` in a pool process; an AsyncResult of it."""
        ref = self._submit(func, [(tuple(args or ()), dict(kwds or {}))], "call")
        return AsyncResult([ref], callback, error_callback, single=True)

    def _chunks(self, iterable: Iterable, chunksize: int | None) -> list:
        _check_positive("chunksize", chunksize)
        items = list(iterable)
        if chunksize is None:  # as multiprocessing: about four chunks per process
            chunksize = -(-len(items) // (len(self._actors) * 4)) or 1
        return [items[i:i + chunksize] for i in range(0, len(items), chunksize)]

    def _map_async(self, func: Callable, iterable: Iterable, chunksize: int | None, form: str,
                   callback: Callable | None, error_callback: Callable | None) -> AsyncResult:
        self._check_running()
        refs = [self._submit(func, chunk, form) for chunk in self._chunks(iterable, chunksize)]
        return AsyncResult(refs, callback, error_callback)

    def map(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        """``[func(x) for x in iterable]`` over the pool, in order."""
        return self._map_async(func, iterable, chunksize, "one", None, None).get()

    def map_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                  callback: Callable | None = None,
                  error_callback: Callable | None = None) -> AsyncResult:
        """``map`` as an AsyncResult; ``callback(results)`` once all succeeded, else
        ``error_callback(first error)``."""
        return self._map_async(func, iterable, chunksize, "one", callback, error_callback)

    def starmap(self, func: Callable, iterable: Iterable, chunksize: int | None = None) -> list:
        """``[func(*args) for args in iterable]`` over the pool, in order."""
        return self._map_async(func, iterable, chunksize, "star", None, None).get()

    def starmap_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                      callback: Callable | None = None,
                      error_callback: Callable | None = None) -> AsyncResult:
        """``starmap`` as an AsyncResult (callbacks as ``map_async``)."""
        return self._map_async(func, iterable, chunksize, "star", callback, error_callback)

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1) -> IMapIterator:
        """Results of ``func`` over ``iterable`` as they come, in order (lazily submitted)."""
        self._check_running()
        _check_positive("chunksize", chunksize, allow_none=False)
        return IMapIterator(self, func, iterable, chunksize, ordered=True)

    def imap_unordered(self, func: Callable, iterable: Iterable,
                       chunksize: int = 1) -> IMapIterator:
        """Results of ``func`` over ``iterable`` in the order they finish."""
        self._check_running()
        _check_positive("chunksize", chunksize, allow_none=False)
        return IMapIterator(self, func, iterable, chunksize, ordered=False)

    def close(self) -> None:
        """No more work; the processes end once the work they have is done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for actor, _ in self._actors:
                self._retire(actor)

    def terminate(self) -> None:
        """End the processes now; results not in yet raise ``ActorDiedError``."""
        from yrdask.ray.worker import kill

        self.close()
        for actor in self._retired:
            kill(actor)

    def join(self) -> None:
        """Wait for the processes of a closed pool to end."""
        from yrdask.ray.worker import wait

        if not self._closed:
            raise ValueError("Pool is still running")
        if self._stopping:
            wait(self._stopping, num_returns=len(self._stopping))

    def __enter__(self) -> "Pool":
        self._check_running()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()
