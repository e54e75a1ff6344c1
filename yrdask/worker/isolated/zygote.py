"""The zygote: one warm interpreter per worker that ``fork()``s the isolated processes.

Agent side (:class:`Zygote`, :class:`ForkedProcess`, :func:`start_child`) and the zygote's
own loop (:func:`zygote_main`, run by ``python -m yrdask.worker.isolated``).  A forked child
listens (its loop and comm endpoint up) and says so; the agent connects to it at once, and
it waits as a *spare*: the zygote keeps ``yrdask.instances.spare-processes`` of them ahead.
A start takes the oldest spare and hands it its request on that connection
(:class:`~yrdask.protocol.AssignIsolated`: its environment, directory and worker) with its
first work in the same message, and it becomes that isolated process (:mod:`.child`); the
zygote forks the next spare.  No orphans: the zygote exits when its stdin closes and kills
its children (spares included) first; a child dies with the zygote (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable

from yrdask import protocol as P
from yrdask.errors import YRValueError, describe_exit
from yrdask.worker.isolated import START_TIMEOUT_S
from yrdask.worker.threads import isolation_env


def describe_exit_of(pid: int, returncode: int) -> str:
    """``"its isolated process (pid 12) exited with code 3"`` (or ``was killed by signal 11
    (SIGSEGV)``): the cause every error about a dead isolated process names."""
    return f"its isolated process (pid {pid}) {describe_exit(returncode)}"


def _child_env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    # The child imports what the worker imports (user modules pickled by reference).
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.getcwd()) for p in sys.path)
    return env


def _node_name(agent: Any) -> str:
    """What the prints of an isolated process name as their node (its worker's node)."""
    return getattr(agent, "node_id", None) or agent.worker.address


def child_info(agent: Any) -> dict:
    """What a child needs to know of its worker: its node (``get_node_id()``, the prints'
    prefix), where the scheduler is (for the runtime its first nested call starts), its host
    and TLS certificates (where and how the child listens) and address (its agent's
    supervision channel, and where large results are kept)."""
    from distributed.comm import get_address_host

    worker = agent.worker
    scheduler = getattr(getattr(worker, "scheduler", None), "address", "") or ""
    try:
        host = get_address_host(worker.address)
    except Exception:  # noqa: BLE001 - an address without a host: loopback
        host = "127.0.0.1"
    return {"node": _node_name(agent), "scheduler": scheduler, "host": host,
            "worker": worker.address, "tls": _tls_of(worker),
            "panels": getattr(agent, "recorder", None) is not None}


#: the worker's TLS settings a child listens with (files or PEM strings: JSON-able)
_TLS_KEYS = ("tls_ca_file", "tls_ciphers", "tls_worker_key", "tls_worker_cert")


def _tls_of(worker: Any) -> dict:
    """The worker's own certificates (given in the config or on its command line), for the
    endpoint of its process instances: they listen as their worker does."""
    security = getattr(worker, "security", None)
    if security is None:
        return {}
    if not getattr(security, "tls_worker_cert", None):
        # dask-gateway's GatewaySecurity: one self-signed certificate and its key, in memory
        # (Dask's Security takes PEM contents as well as paths)
        cert, key = getattr(security, "tls_cert", None), getattr(security, "tls_key", None)
        if isinstance(cert, str) and isinstance(key, str):
            return {"tls_ca_file": cert, "tls_worker_cert": cert, "tls_worker_key": key}
        return {}
    return {k: v for k in _TLS_KEYS if isinstance(v := getattr(security, k, None), str)}


def _request(isolation: dict) -> tuple[dict, str | None]:
    """The environment and directory of a child for ``isolation``; a missing working
    directory raises ``YRValueError``."""
    cwd = isolation.get("cwd") or None
    if cwd is not None and not os.path.isdir(cwd):
        raise YRValueError(f"working_dir {cwd!r} does not exist on this worker host; create it "
                           "there or give runtime_env={'working_dir': <an existing dir>}")
    return _child_env(isolation.get("env")), cwd


async def start_child(isolation: dict, info: dict, connection_args: dict,
                      then: dict | None = None) -> tuple["ForkedProcess", str, Any]:
    """A process for ``isolation``: the oldest spare of this worker's zygote (listening, and
    connected to by this agent already), handed its request and ``then`` (an instance's
    ``StartIsolated``) in one message (:class:`P.AssignIsolated`).  Returns the process,
    its address and the comm, whose next read is ``then``'s reply (once the process has
    said that it took the request).

    A spare that dies before it takes the request (killed while it waited) is passed over
    once; if the next one dies too, the start fails at once, not after the start timeout.
    A missing working directory raises ``YRValueError``; no process: ``RuntimeError``."""
    import asyncio

    from distributed.comm.core import CommClosedError

    loop = asyncio.get_running_loop()
    env, cwd = _request(isolation)
    z = Zygote._current
    if z is None or z.dead:  # its start blocks (once per worker): in a thread
        z = await loop.run_in_executor(None, Zygote.get, info, loop, connection_args)
    assign = P.AssignIsolated({**z.env_change(env), "cwd": cwd, **info}, then).to_msg()
    for retries in (1, 0):
        spare = await z.take()
        comm = None
        try:
            comm = await asyncio.wrap_future(spare.comm)
            await comm.write(assign)
            ack = await asyncio.wait_for(comm.read(), START_TIMEOUT_S)
        except (CommClosedError, OSError, asyncio.TimeoutError):
            if comm is not None:
                comm.abort()
            kill_child(spare.proc)
            if retries:
                continue
            code = await loop.run_in_executor(None, spare.proc.wait, START_TIMEOUT_S)
            raise RuntimeError(f"the isolated process did not start: "
                               f"{describe_exit_of(spare.proc.pid, code)} before it took "
                               "its request") from None
        if isinstance(ack, dict):  # the child's endpoint reports its own failure
            comm.abort()
            kill_child(spare.proc)
            raise RuntimeError(f"the isolated process did not start: "
                               f"{ack.get('exception_text') or ack!r}")
        return spare.proc, spare.address, comm
    raise AssertionError("unreachable")  # pragma: no cover


class ForkedProcess:
    """A child forked by the zygote, seen from the agent: ``pid``, ``kill()``, ``wait()``
    like ``subprocess.Popen`` (the zygote, its parent, reports its exit status), and
    :meth:`when_exited` (no thread has to wait on it)."""

    stdin = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[int], None]] = []

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def when_exited(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(exit code)`` once the process has exited: in the thread that reads the
        zygote's reports, or now if it has exited already."""
        with self._lock:
            if self.returncode is None:
                self._callbacks.append(fn)
                return
        fn(self.returncode)

    def _exited(self, code: int) -> None:
        with self._lock:
            self.returncode = code
            callbacks, self._callbacks = self._callbacks, []
        self._ended.set()
        for fn in callbacks:
            fn(code)


class _Spare:
    """A child that listens and waits for its request: its process, address and the
    agent's comm to it (a future: connected as soon as the child said it listens), or
    the ``error`` that kept it from listening (told to the start that takes it)."""

    __slots__ = ("proc", "address", "error", "comm")

    def __init__(self, proc: ForkedProcess, address: str, error: str | None) -> None:
        self.proc = proc
        self.address = address
        self.error = error
        self.comm: concurrent.futures.Future | None = None


class Zygote:
    """One warm interpreter per worker that forks the isolated processes ahead of need.

    Lines of JSON on its stdout: ``{"forked": pid}`` (it forked a child),
    ``{"spare": pid, "address": a}`` (the child listens; ``"error"`` instead: it could not)
    and ``{"exit": pid, "code": n}`` (it reaped a child; ``n < 0``: killed by signal
    ``-n``).  On its stdin: ``{"took": pid}`` (the agent took that spare: the zygote forks
    the next) and ``{"fork": n}`` (a burst found no spare: fork ``n`` more).  The agent
    connects to each spare once it listens, on the worker's loop, so a start neither waits
    for a fork nor a connect.  The zygote exits when its stdin closes (the agent closed it,
    or the worker died) and takes its children with it; a child also dies with the zygote
    (``PR_SET_PDEATHSIG``).
    """

    _current: "Zygote | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls, info: dict | None = None, loop: Any = None,
            connection_args: dict | None = None) -> "Zygote":
        """This worker's zygote, started on first use; its children listen as ``info``
        (:func:`child_info`) says: on the worker's host, with its TLS certificates; the
        agent connects to them on ``loop`` with ``connection_args``."""
        with cls._lock:
            z = cls._current
            if z is None or z.dead:
                z = cls._current = Zygote(info or {}, loop, connection_args or {})
            return z

    @classmethod
    def close_current(cls) -> None:
        with cls._lock:
            z, cls._current = cls._current, None
        if z is not None:
            z.close()

    def __init__(self, info: dict, loop: Any, connection_args: dict) -> None:
        from yrdask.config import spare_processes

        # where the children listen is the worker's, the same for every child: the spares
        # listen before they are handed a request
        listen = {"host": info.get("host") or "127.0.0.1", "tls": info.get("tls") or {}}
        self.loop = loop
        self.connection_args = connection_args
        # with the thread limits of work on one CPU or less (most of it: those requests
        # then change no limit, and skip threadpoolctl's walk, ~0.3 ms a creation), and
        # the libraries it loads start with one thread (safe to fork)
        self.env = _child_env(isolation_env(None, 1))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yrdask.worker.isolated", "--zygote",
             "--spares", str(spare_processes()), "--listen", json.dumps(listen)],
            env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self.ready: list[_Spare] = []  # spares that listen, oldest first
        self.waiters: list[concurrent.futures.Future] = []  # starts waiting for a spare
        self.forking: set[int] = set()  # children forked, not listening yet
        self.children: dict[int, ForkedProcess] = {}
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="yr-zygote-reader").start()

    def env_change(self, env: dict) -> dict:
        """``env`` as a request carries it: what differs from the environment this zygote
        started with (``env``: set, ``unset``: removed), mostly nothing; the child makes
        its environment exactly ``env`` (:func:`~.child.apply_request`)."""
        start = self.env
        return {"env": {k: v for k, v in env.items() if start.get(k) != v},
                "unset": [k for k in start if k not in env]}

    async def take(self) -> _Spare:
        """The oldest spare (the zygote then forks the next); with none, the next child
        that listens, after asking the zygote to fork one if none is on its way."""
        import asyncio

        waiter = None
        with self.lock:
            if self.dead:
                raise RuntimeError("the worker's zygote process has exited")
            if self.ready:
                spare = self.ready.pop(0)
            else:
                waiter = concurrent.futures.Future()
                self.waiters.append(waiter)
                if len(self.waiters) > len(self.forking):
                    self._send({"fork": 1})
        if waiter is not None:
            try:
                spare = await asyncio.wait_for(asyncio.wrap_future(waiter), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"the isolated process did not start in {START_TIMEOUT_S:g} s") from None
            if spare is None:
                raise RuntimeError("the worker's zygote process exited while it forked")
        if spare.error is not None:
            raise RuntimeError(f"the isolated process did not start: {spare.error}")
        with self.lock:
            self._send({"took": spare.proc.pid})
        return spare

    def _send(self, msg: dict) -> None:
        """One line to the zygote (with ``self.lock`` held)."""
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self.dead = True
            raise RuntimeError("the worker's zygote process has exited") from None

    def _connect(self, spare: _Spare) -> None:
        """Connect to a spare that listens, on the agent's loop (reader thread)."""
        from distributed.comm import connect

        coro = connect(spare.address, **self.connection_args)
        try:
            spare.comm = _on_loop(coro, self.loop)
        except (RuntimeError, TypeError) as e:  # the loop closed: the worker is gone
            coro.close()
            spare.comm = concurrent.futures.Future()
            spare.comm.set_exception(OSError(f"no loop to connect to the spare on: {e}"))

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                if "forked" in msg:
                    if msg["forked"] not in self.children:  # (not said to listen already)
                        self.forking.add(msg["forked"])
                elif "exit" in msg:
                    pid = msg["exit"]
                    self.forking.discard(pid)
                    child = self.children.pop(pid, None)
                    if child is not None:
                        child._exited(msg["code"])
                    for k, spare in enumerate(self.ready):
                        if spare.proc.pid == pid:  # it died while it waited
                            self._let_go(self.ready.pop(k))
                            break
                elif "spare" in msg:
                    pid = msg["spare"]
                    self.forking.discard(pid)
                    spare = _Spare(ForkedProcess(pid), msg.get("address") or "",
                                   msg.get("error"))
                    self.children[pid] = spare.proc
                    if spare.error is None:
                        self._connect(spare)
                    if not self._hand(spare):
                        self.ready.append(spare)
        with self.lock:  # the zygote is gone, and its children with it
            self.dead = True
            waiters, self.waiters = self.waiters, []
            children, self.children = self.children, {}
            ready, self.ready = self.ready, []
        for spare in ready:
            self._let_go(spare)
        for waiter in waiters:
            _resolve(waiter, None)
        for child in children.values():
            child._exited(-signal.SIGKILL)

    def _let_go(self, spare: _Spare) -> None:
        """Close the agent's comm to a spare nobody will take (it died, or the zygote)."""
        def abort(done: concurrent.futures.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                comm = done.result()
                if _running_loop() is self.loop:
                    comm.abort()  # (the worker closes: its loop may not run again)
                    return
                try:
                    self.loop.call_soon_threadsafe(comm.abort)
                except RuntimeError:  # the loop closed: the worker is gone
                    comm.abort()

        if spare.comm is not None:
            spare.comm.add_done_callback(abort)

    def _hand(self, spare: _Spare) -> bool:
        """Give ``spare`` to the oldest start still waiting (with ``self.lock`` held)."""
        while self.waiters:
            if _resolve(self.waiters.pop(0), spare):
                return True
        return False

    def close(self) -> None:
        """Kill every child (the zygote does so when its stdin closes) and reap the zygote."""
        with self.lock:
            children = list(self.children.values())
            ready, self.ready = self.ready, []
        for spare in ready:
            self._let_go(spare)
        for child in children:
            child.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - stuck: it goes the hard way
            self.proc.kill()
            self.proc.wait()


def _on_loop(coro: Any, loop: Any) -> concurrent.futures.Future:
    """``coro`` on ``loop`` (from another thread): its future."""
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, loop)


def _running_loop() -> Any:
    """The event loop running in this thread, or ``None``."""
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve(waiter: concurrent.futures.Future, spare: _Spare | None) -> bool:
    """Hand ``spare`` to ``waiter``; False if it gave up waiting (timed out)."""
    try:
        waiter.set_result(spare)
    except concurrent.futures.InvalidStateError:
        return False
    return True


def kill_child(proc: subprocess.Popen) -> None:
    """SIGKILL a child (a zygote-forked one or a ``Popen``); no error if it is gone."""
    try:
        proc.kill()
    except ProcessLookupError:  # pragma: no cover - already gone
        pass
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass



def _forked_child(zygote_pid: int, listen: dict) -> None:
    """In a child just forked by the zygote: listen, say so, and wait as a spare until the
    agent hands it a request (:mod:`.child`)."""
    import asyncio
    import ctypes

    code = 0
    told = False

    def announce(address: str) -> None:
        nonlocal told
        told = True
        _write_line({"spare": os.getpid(), "address": address})

    try:
        # the zygote's way to hear of its children's exits is not this process's
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for end in _CHLD_PIPE:
            os.close(end)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
        if os.getppid() != zygote_pid:  # it died before the prctl
            os._exit(1)
        global _PROTO_FD
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the zygote's requests are not this process's input
        _PROTO_FD = os.dup(1)
        os.dup2(2, 1)  # the user's prints go where the worker's stderr goes, not into the pipe

        from yrdask.worker.isolated.child import child_main

        asyncio.run(child_main(announce, listen))
    except BaseException as e:  # noqa: BLE001 - told to the agent, then this process ends
        code = 1
        if not told:  # it could not listen: the start that takes it is told why
            try:
                _write_line({"spare": os.getpid(), "error": f"{type(e).__name__}: {e}"})
            except BaseException:  # noqa: BLE001 - the zygote reports the exit
                pass
    os._exit(code)


_PROTO_FD = 1  # where the zygote protocol's lines go (a forked child moves it off stdout)
_CHLD_PIPE: tuple = ()  # the zygote's SIGCHLD wake-up pipe (read end, write end)


def _write_line(msg: dict) -> None:
    os.write(_PROTO_FD, (json.dumps(msg) + "\n").encode())  # one write: lines never interleave


def warm() -> None:
    """Import and prepare, once, what every child uses (the zygote before its first fork;
    ``benchmarks.fork_floor`` to measure a fork of the same image), then freeze it."""
    import distributed.comm.tcp  # noqa: F401 - what every child uses, imported once here
    import distributed.core  # noqa: F401
    import tornado.platform.asyncio  # noqa: F401 - a Server's first loop (~1 ms a child)
    import yrdask.runtime.context  # noqa: F401
    import yrdask.serialization  # noqa: F401 - with the next: ~6 ms a child, measured
    import yrdask.stream  # noqa: F401
    import yrdask.worker.dask_panels  # noqa: F401 - a child whose worker records (~0.5 ms)
    import yrdask.worker.hosting  # noqa: F401
    import yrdask.worker.isolated.child  # noqa: F401
    import yrdask.worker.isolated.endpoint  # noqa: F401
    import yrdask.worker.output  # noqa: F401
    from yrdask.runtime import runtime, transport  # noqa: F401 - a nested call's runtime

    runtime._load_machines()  # (its submitter and router): ~40 ms less at a first nested call
    from yrdask.worker.threads import LIMITS

    LIMITS._controller()  # threadpoolctl's scan: ~20 ms a child whose thread limits change

    import gc

    gc.collect()
    gc.freeze()  # the children's collections then leave the shared pages alone (less copying)


def zygote_main(spares: int = 1, listen: dict | None = None) -> None:
    """Import what a child needs once, keep ``spares`` children forked and listening that
    no start took yet, fork more when asked (see :class:`Zygote`), and report every exit."""
    import select

    from yrdask.worker.isolated import child

    child.START_ENV.update(os.environ)  # what the agent started it with: requests differ
    warm()
    me = os.getpid()
    children: set[int] = set()
    waiting: list[int] = []  # the spares no start took yet, oldest first

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            try:
                _forked_child(me, listen or {})
            finally:
                os._exit(1)  # never back into the zygote's loop
        children.add(pid)
        waiting.append(pid)
        _write_line({"forked": pid})

    # a child's exit wakes the loop (SIGCHLD, through a pipe), as the agent's lines do: no
    # timer, so an idle zygote sleeps (every worker keeps one once it is warm)
    global _CHLD_PIPE
    _CHLD_PIPE = os.pipe()
    for end in _CHLD_PIPE:
        os.set_blocking(end, False)
    signal.set_wakeup_fd(_CHLD_PIPE[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wakeup fd is written in C)
    fd = sys.stdin.fileno()
    buf = b""
    open_ = True
    while open_:
        while len(waiting) < spares:
            fork()
        ready, _, _ = select.select([fd, _CHLD_PIPE[0]], [], [])
        if _CHLD_PIPE[0] in ready:
            try:
                while os.read(_CHLD_PIPE[0], 4096):
                    pass
            except BlockingIOError:
                pass
        while children:  # reap, and tell the agent how each child ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            if pid in waiting:
                waiting.remove(pid)
            _write_line({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if fd not in ready:
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            open_ = False
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if "took" in msg and msg["took"] in waiting:
                waiting.remove(msg["took"])
            for _ in range(msg.get("fork") or 0):
                fork()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    os._exit(0)
