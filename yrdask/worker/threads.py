"""Threads follow CPUs: work that holds N whole CPUs runs with N threads in BLAS, OpenMP, MKL
and torch, as Ray gives a task of ``num_cpus=N`` (docs/nodes.md, "Threads follow CPUs").

A worker process runs many pieces of work at once on its threads, and these libraries keep
one limit per process (OpenMP's is per thread), so the rule is:

* **Whole CPUs.** Work holding ``cpus`` cores holds ``int(cpus)`` whole CPUs; below 2 it
  does nothing at all (the hot path: its lease id has no ``#CPU=`` mark, see
  :func:`yrdask.protocol.lease_cpus`), and gets the worker's own limits (1: Dask starts
  worker processes with ``OMP_NUM_THREADS=1`` and friends).
* **The largest holder sets the process limit.** While work holding N ≥ 2 runs in the
  process, the process-wide limits (BLAS and MKL pools, torch's intra-op pool, and the
  ``OMP_NUM_THREADS`` family in ``os.environ`` that processes it starts inherit) are the
  largest N among that work (never more than one request could hold, so never more than the
  node's CPUs); when the last of it ends they go back to what they were.  OpenMP's own limit
  is set in the thread that runs the work, and put back when a task ends.
* **The user wins.** A library limit or environment variable that changed since yrdask last
  set it was set by the user's code: yrdask leaves it alone (neither raises nor restores it)
  until no such work is left.  In work's ``env_vars`` the user's variables stay as they
  are, and their ``OMP_NUM_THREADS`` sizes the others (:func:`isolation_env`).
* **Processes of their own** (isolated work, GPU work) get the variables in their
  environment (their whole CPUs, at least 1), and the libraries loaded before the fork
  follow them (:func:`follow_env`).

threadpoolctl finds the loaded libraries by scanning the process's shared objects (about a
millisecond): its controller is kept and scanned again only when modules were imported since.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Any

#: Threading libraries that size their pools from these variables when they load (Ray sets
#: the same ones for its workers).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
              "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")

#: Which variable sizes each threadpoolctl library when it loads, first one set wins.
_ENV_OF = {"openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
           "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
           "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
           "flexiblas": ("OMP_NUM_THREADS",), "openmp": ("OMP_NUM_THREADS",)}
_TORCH = "torch"


def whole_cpus(cpus: float) -> int:
    """The threads of work holding ``cpus`` cores: its whole CPUs, at least 1."""
    return max(1, int(cpus))


def isolation_env(env: dict | None, cpus: float) -> dict:
    """The environment of a process of its own for work holding ``cpus`` cores: ``env`` (its
    ``env_vars``) with :data:`THREAD_ENV` set to its whole CPUs; the user's wins: a variable
    ``env`` sets stays, and its ``OMP_NUM_THREADS`` (the one the others fall back to in a
    fresh process) sizes the ones it leaves unset."""
    env = dict(env or {})
    n = env.get("OMP_NUM_THREADS") or str(whole_cpus(cpus))
    return {**dict.fromkeys(THREAD_ENV, n), **env}


def instance_cpus(spec: dict) -> int:
    """The whole CPUs an instance holds for its life (its ``START_INSTANCE`` ``spec``'s
    shape, in millicores) if 2 or more, else 0: it does nothing about threads."""
    shape = spec.get("shape") or {}
    cpus = int(shape.get("CPU", 0.0) / 1000)
    return cpus if cpus >= 2 else 0


def with_cpus(isolation: dict | None, cpus: float) -> dict:
    """The isolation spec (``{"env", "cwd"}``) of work holding ``cpus`` cores in a process of
    its own: its environment as :func:`isolation_env` says."""
    isolation = dict(isolation or {"env": {}, "cwd": ""})
    isolation["env"] = isolation_env(isolation.get("env"), cpus)
    return isolation


def _controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _env_limit(keys: tuple, env: Any) -> int | None:
    """The limit the first of ``keys`` set in ``env`` says; ``None`` if none is (or it is
    no number)."""
    for key in keys:
        value = env.get(key)
        if value is not None:
            try:
                return max(1, int(value))
            except ValueError:
                return None
    return None


def follow_env(before: dict) -> None:
    """In a process of its own whose environment just changed from ``before`` (a child
    forked from the zygote, which loaded numpy with the worker's variables): the libraries
    already loaded take the limits a fresh process would read from the new variables, and
    the work in it leaves them to its environment (:attr:`ThreadLimits.off`)."""
    LIMITS.off = True
    env = os.environ
    if all(before.get(key) == env.get(key) for key in THREAD_ENV):
        return  # the same as the zygote's: nothing to do (the common case)
    for lib in LIMITS._controller().lib_controllers:  # scanned in the zygote already
        n = _env_limit(_ENV_OF.get(lib.internal_api, ()), env)
        if n is not None and n != lib.num_threads:
            lib.set_num_threads(n)
    torch = sys.modules.get(_TORCH)
    n = _env_limit(("OMP_NUM_THREADS",), env)
    if torch is not None and n is not None:
        torch.set_num_threads(n)


class ThreadLimits:
    """The thread limits of one process, following the work that holds whole CPUs in it
    (see module docstring).  One per process: :data:`LIMITS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[int, int] = {}  # whole CPUs -> how many running pieces hold that
        self.limit = 0  # the process-wide limit set now; 0: none (the process's own)
        self._libs: Any = None  # threadpoolctl's controller, kept
        self._modules = -1  # len(sys.modules) at its scan
        self._saved: dict[str, Any] = {}  # what each process-wide setting was before
        self._left: dict[str, Any] = {}  # what yrdask set each to last (_USER: the user's)
        self._local = threading.local()  # .left: OpenMP limits this thread got from yrdask
        #: a process of its own (isolated, GPU work): its environment decides, not this
        self.off = False

    # -- what work calls -------------------------------------------------------------------

    def enter(self, n: int) -> tuple | None:
        """Work holding ``n`` ≥ 2 whole CPUs starts in this thread (:meth:`hold`, then
        :meth:`enter_thread`); hand what it returns to :meth:`leave` when it ends."""
        self.hold(n)
        return self.enter_thread(n)

    def leave(self, n: int, token: tuple | None) -> None:
        """The work :meth:`enter` started ended (in the same thread)."""
        try:
            self.leave_thread(token)
        finally:
            self.release(n)

    def hold(self, n: int) -> None:
        """Work holding ``n`` ≥ 2 whole CPUs starts in this process (its thread): the
        process-wide limits rise to ``n`` if that is the most held now."""
        if self.off:
            return
        with self._lock:
            holds = self._holds
            holds[n] = holds.get(n, 0) + 1
            if n > self.limit:
                self._apply(n)

    def release(self, n: int) -> None:
        """Work holding ``n`` whole CPUs ended: the limits follow the largest holder left,
        or go back to what they were before."""
        if self.off:
            return
        with self._lock:
            holds = self._holds
            left = holds[n] - 1
            if left:
                holds[n] = left
                return
            del holds[n]
            top = max(holds, default=0)
            if top < self.limit:
                self._apply(top)

    def enter_thread(self, n: int) -> tuple | None:
        """This thread runs work holding ``n`` whole CPUs: its OpenMP limit becomes ``n``.
        Returns what :meth:`leave_thread` puts back (``None``: nothing changed)."""
        if self.off:
            return None
        changed = []
        for lib in self._openmp():
            now = lib.num_threads
            if now != n and self._ours(lib, now):
                lib.set_num_threads(n)
                changed.append((lib, now, n))
        if not changed:
            return None
        left = self._thread_left()
        for lib, _now, n in changed:
            left[lib.filepath] = n
        return tuple(changed)

    def in_thread(self, n: int) -> None:
        """This thread is one of an instance's own, holding ``n`` whole CPUs for its life:
        its OpenMP limit is ``n`` (looked at again only after imports)."""
        local = self._local
        if getattr(local, "n", 0) == n and local.modules == len(sys.modules):
            return
        self.enter_thread(n)
        local.n, local.modules = n, len(sys.modules)

    def leave_thread(self, token: tuple | None) -> None:
        """The thread's work ended: its OpenMP limits go back, unless the user's code set
        them meanwhile."""
        if token is None:
            return
        left = self._thread_left()
        for lib, before, n in token:
            if lib.num_threads == n:
                lib.set_num_threads(before)
                left[lib.filepath] = before

    # -- the process-wide settings (under the lock) ----------------------------------------

    def _thread_left(self) -> dict:
        left = getattr(self._local, "left", None)
        if left is None:
            left = self._local.left = {}
        return left

    def _ours(self, lib: Any, now: int) -> bool:
        """Whether this thread's OpenMP limit is still the one yrdask left (or never set)."""
        left = self._thread_left().get(lib.filepath)
        return left is None or left == now

    def _controller(self) -> Any:
        if self._modules != len(sys.modules):  # modules imported since: libraries may have
            self._libs = _controller()         # loaded too
            self._modules = len(sys.modules)
        return self._libs

    def _openmp(self) -> list:
        return [lib for lib in self._controller().lib_controllers if lib.user_api == "openmp"]

    def _settings(self) -> dict[str, tuple]:
        """Each process-wide setting: its key -> (read, write)."""
        out: dict[str, tuple] = {}
        for lib in self._controller().lib_controllers:
            if lib.user_api != "openmp":
                out[lib.filepath] = (lambda lib=lib: lib.num_threads, lib.set_num_threads)
        torch = sys.modules.get(_TORCH)
        if torch is not None and hasattr(torch, "set_num_threads"):
            out[_TORCH] = (torch.get_num_threads, torch.set_num_threads)
        env = os.environ
        for key in THREAD_ENV:
            out[key] = (lambda key=key: env.get(key),
                        lambda v, key=key: env.__setitem__(key, v) if v is not None
                        else env.pop(key, None))
        return out

    def _apply(self, n: int) -> None:
        """:meth:`_set`, always in this process's one setter thread: OpenBLAS (0.3.31,
        numpy's) ignores the limits other threads set once one thread has set one."""
        _in_setter(self._set, n)

    def _set(self, n: int) -> None:
        """Set the process-wide limits to ``n`` (0: back to what they were)."""
        saved, left = self._saved, self._left
        raising = self.limit == 0
        for key, (read, write) in self._settings().items():
            now = read()
            if raising:
                saved[key] = now
            elif key not in saved:  # loaded while raised (reading the raised variables)
                saved[key] = _env_limit(("OMP_NUM_THREADS",), saved) or 1
            elif left.get(key, _USER) != now:  # the user's code set it since: theirs
                left[key] = _USER
                continue
            want = saved[key] if n == 0 else (str(n) if key in THREAD_ENV else n)
            if want != now:
                write(want)
            left[key] = want
        self.limit = n
        if n == 0:
            saved.clear()
            left.clear()


_USER = object()  # in ThreadLimits._left: a setting the user's code changed

_setter: list = [None, 0]  # the setter thread's job queue and its process id
_setter_lock = threading.Lock()


def _in_setter(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` in this process's setter thread (started at its first use, again
    in a forked child) and wait for it; its exception is raised here."""
    with _setter_lock:
        jobs, pid = _setter
        if jobs is None or pid != os.getpid():
            jobs = _setter[0] = queue.SimpleQueue()
            _setter[1] = os.getpid()
            threading.Thread(target=_serve, args=(jobs,), daemon=True,
                             name="yr-thread-limits").start()
    failed: list = []
    ready = threading.Event()
    jobs.put((fn, args, failed, ready))
    ready.wait()
    if failed:
        raise failed[0]


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        fn, args, failed, ready = jobs.get()
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            failed.append(e)
        ready.set()


#: This process's thread limits.
LIMITS = ThreadLimits()
