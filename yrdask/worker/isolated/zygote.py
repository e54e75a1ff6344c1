"""The zygote: one warm interpreter per worker that ``fork()``s the isolated processes.

Agent side (:class:`Zygote`, :class:`ForkedProcess`, :func:`spawn`) and the zygote's own loop
(:func:`zygote_main`, run by ``python -m yrdask.worker.isolated``).  A forked child first
listens (its loop and Dask ``Server`` up), then waits for its assignment on a pipe of its
own: the zygote keeps ``yrdask.instances.spare-processes`` such *spares* ahead, so a request
only hands one its environment, directory and worker, and it becomes that isolated process
(:mod:`.child`).  No orphans: the zygote exits when its stdin closes and kills its children
(spares included) first; a child dies with the zygote (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from yrdask.errors import YRValueError, describe_exit
from yrdask.worker.isolated import START_TIMEOUT_S
from yrdask.worker.threads import follow_env


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


def spawn(isolation: dict, info: dict | None = None) -> tuple[Any, str]:
    """Start a child with the instance's env and cwd; returns it and its listening address.

    Handed a spare of this worker's zygote (a warm interpreter with Dask and yrdask
    imported, which forks its children ahead), so a start costs neither an interpreter
    start nor, mostly, a fork.  Blocking (run it in a thread; :func:`spawn_async` on a
    loop).  A missing working directory raises ``YRValueError``.
    """
    env, cwd = _request(isolation)
    return Zygote.get(info).fork(env, cwd, info or {})


async def spawn_async(isolation: dict, info: dict | None = None) -> tuple[Any, str]:
    """:func:`spawn` on an event loop: no thread waits for the child (the zygote's reader
    wakes the loop), unless the zygote itself must start (once per worker, in a thread)."""
    import asyncio

    loop = asyncio.get_running_loop()
    env, cwd = _request(isolation)
    z = Zygote._current
    if z is None or z.dead:
        z = await loop.run_in_executor(None, Zygote.get, info)
    done = loop.create_future()

    def answered() -> None:
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except RuntimeError:  # the loop closed: the worker is gone, nobody waits
            pass

    slot = z.request(env, cwd, info or {}, answered)
    try:
        await asyncio.wait_for(asyncio.shield(done), START_TIMEOUT_S)
    except asyncio.TimeoutError:
        pass  # told by Zygote.answer
    return Zygote.answer(slot)


class ForkedProcess:
    """A child forked by the zygote, seen from the agent: ``pid``, ``kill()``, ``wait()``
    like ``subprocess.Popen`` (the zygote, its parent, reports its exit status)."""

    stdin = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

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

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class Zygote:
    """One warm interpreter per worker that forks the isolated processes on request.

    Requests and answers are JSON lines on its stdin and stdout: ``{"id", "env", "cwd"}`` in;
    ``{"id", "pid", "address"}`` from the child it was handed to once that one has applied
    it, and ``{"exit": pid, "code": n, "id": request}`` when the zygote reaps one (``n < 0``:
    killed by signal ``-n``; a spare, never handed a request, is not told).  The zygote
    exits when its stdin closes (the agent closed it, or the worker died) and takes its
    children with it; a child also dies with the zygote (``PR_SET_PDEATHSIG``).
    """

    _current: "Zygote | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls, info: dict | None = None) -> "Zygote":
        """This worker's zygote, started on first use; its children listen as ``info``
        (:func:`child_info`) says: on the worker's host, with its TLS certificates."""
        with cls._lock:
            z = cls._current
            if z is None or z.dead:
                z = cls._current = Zygote(info or {})
            return z

    @classmethod
    def close_current(cls) -> None:
        with cls._lock:
            z, cls._current = cls._current, None
        if z is not None:
            z.close()

    def __init__(self, info: dict) -> None:
        from yrdask.config import spare_processes

        # where the children listen is the worker's, the same for every child: the spares
        # listen before they are handed a request
        listen = {"host": info.get("host") or "127.0.0.1", "tls": info.get("tls") or {}}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yrdask.worker.isolated", "--zygote",
             "--spares", str(spare_processes()), "--listen", json.dumps(listen)],
            env=_child_env(None),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self.ids = iter(range(1, 1 << 62))
        self.waiting: dict[int, list] = {}  # request id -> its slot (see request())
        self.children: dict[int, ForkedProcess] = {}
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="yr-zygote-reader").start()

    def fork(self, env: dict, cwd: str | None, info: dict) -> tuple[ForkedProcess, str]:
        """Hand a child this request and wait for its answer (blocking)."""
        slot = self.request(env, cwd, info)
        slot[0].wait(START_TIMEOUT_S)
        return self.answer(slot)

    def request(self, env: dict, cwd: str | None, info: dict,
                answered: Any = None) -> list:
        """Send a request; its slot is answered (``answered()`` called, from the reader
        thread) when the child has taken it, or failed."""
        with self.lock:
            if self.dead:
                raise RuntimeError("the worker's zygote process has exited")
            # [answered event, answer, answered(), the request, retries left]
            slot: list = [threading.Event(), None, answered, {"env": env, "cwd": cwd, **info},
                          1]
            self._send(slot)
        return slot

    def _send(self, slot: list) -> None:
        """Write ``slot``'s request under a new id (with ``self.lock`` held)."""
        rid = next(self.ids)
        self.waiting[rid] = slot
        try:
            self.proc.stdin.write((json.dumps({"id": rid, **slot[3]}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self.waiting.pop(rid, None)
            self.dead = True
            raise RuntimeError("the worker's zygote process has exited") from None

    @staticmethod
    def answer(slot: list) -> tuple[ForkedProcess, str]:
        """The child and its address, once ``slot`` is answered; else why not."""
        if not slot[0].is_set():
            raise RuntimeError(f"the isolated process did not start in {START_TIMEOUT_S:g} s")
        answer = slot[1]
        if answer is None:
            raise RuntimeError("the worker's zygote process exited while it forked")
        if "error" in answer:
            raise RuntimeError(f"the isolated process did not start: {answer['error']}")
        return answer["proc"], answer["address"]

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                slot = self.waiting.pop(msg.get("id"), None)
                if "exit" in msg:  # after its answer, if it gave one (the same pipe)
                    child = self.children.pop(msg["exit"], None)
                    if child is not None:
                        child._exited(msg["code"])
                    if slot is None:
                        continue
                    # it died before it answered its request: a spare killed while it
                    # waited (its pipe took the request) gets it again once, then it fails
                    if slot[4] > 0:
                        slot[4] -= 1
                        try:
                            self._send(slot)
                            continue
                        except RuntimeError:
                            pass
                    msg = {"error": f"{describe_exit_of(msg['exit'], msg['code'])} before it "
                                    "listened"}
                if "pid" in msg:
                    msg["proc"] = self.children[msg["pid"]] = ForkedProcess(msg["pid"])
            if slot is not None:
                _answered(slot, msg)
        with self.lock:  # the zygote is gone, and its children with it
            self.dead = True
            waiting, self.waiting = self.waiting, {}
            children, self.children = self.children, {}
        for slot in waiting.values():
            _answered(slot, None)
        for child in children.values():
            child._exited(-signal.SIGKILL)

    def close(self) -> None:
        """Kill every child (the zygote does so when its stdin closes) and reap the zygote."""
        with self.lock:
            children = list(self.children.values())
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


def _answered(slot: list, msg: dict | None) -> None:
    slot[1] = msg
    slot[0].set()
    if slot[2] is not None:
        slot[2]()


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


def _forked_child(zygote_pid: int, assignments: int, others: list[int], listen: dict) -> None:
    """In a child just forked by the zygote: listen, then become the isolated process of the
    request that arrives on ``assignments`` (a pipe from the zygote; its end, and a spare
    goes quietly); ``others`` are the zygote's ends of the other spares' pipes."""
    import asyncio
    import ctypes

    code = 0
    req: dict | None = None
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
        if os.getppid() != zygote_pid:  # it died before the prctl
            os._exit(1)
        for fd in others:
            os.close(fd)
        global _PROTO_FD
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the zygote's requests are not this process's input
        _PROTO_FD = os.dup(1)
        os.dup2(2, 1)  # the user's prints go where the worker's stderr goes, not into the pipe

        async def assigned() -> dict:
            nonlocal req
            req = await _read_request(assignments)
            _apply(req)
            return req

        def announce(address: str) -> None:
            _write_line({"id": req["id"], "pid": os.getpid(), "address": address})

        from yrdask.worker.isolated.child import child_main

        asyncio.run(child_main(assigned, announce, listen))
    except BaseException as e:  # noqa: BLE001 - told to the agent, then this process ends
        code = 1
        try:
            if req is None:  # it failed as a spare: the request handed to it next is told
                req = _read_request_now(assignments)
            _write_line({"id": req["id"], "error": f"{type(e).__name__}: {e}"})
        except BaseException:  # noqa: BLE001 - the zygote reports the exit to the request
            pass
    os._exit(code)


def _apply(req: dict) -> None:
    """What a request makes of a spare, before any user code runs: its environment (and the
    thread limits of the libraries loaded already) and its directory."""
    import tempfile

    before = dict(os.environ)
    env = req["env"]
    for key in [key for key in before if key not in env]:
        del os.environ[key]
    for key, value in env.items():  # mostly the zygote's own (the worker's): set what differs
        if before.get(key) != value:
            os.environ[key] = value
    follow_env(before)  # numpy, loaded by the zygote, takes the new thread limits
    tempfile.tempdir = None  # the zygote's choice; this process's TMPDIR decides
    if req.get("cwd"):
        os.chdir(req["cwd"])


async def _read_request(fd: int) -> dict:
    """The request the zygote hands this spare (one JSON line on ``fd``); the pipe's end (the
    zygote let this spare go, or died) ends the process."""
    import asyncio

    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    got = loop.create_future()
    buf = bytearray()

    def readable() -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        buf.extend(data)
        if not data or b"\n" in buf:
            loop.remove_reader(fd)
            got.set_result(bytes(buf))

    loop.add_reader(fd, readable)
    line = await got
    if b"\n" not in line:
        os._exit(0)
    os.close(fd)
    return json.loads(line)


def _read_request_now(fd: int) -> dict:
    """:func:`_read_request`, blocking (a spare that failed before its loop could)."""
    os.set_blocking(fd, True)
    buf = b""
    while b"\n" not in buf:
        data = os.read(fd, 1 << 16)
        if not data:
            os._exit(1)
        buf += data
    return json.loads(buf)


_PROTO_FD = 1  # where the zygote protocol's lines go (a forked child moves it off stdout)


def _write_line(msg: dict) -> None:
    os.write(_PROTO_FD, (json.dumps(msg) + "\n").encode())  # one write: lines never interleave


def zygote_main(spares: int = 1, listen: dict | None = None) -> None:
    """Import what a child needs once, keep ``spares`` children forked and listening, and
    hand each request line to one (a fresh fork when none is left; see :class:`Zygote`)."""
    import select

    import distributed.comm.tcp  # noqa: F401 - what every child uses, imported once here
    import distributed.core  # noqa: F401
    import tornado.platform.asyncio  # noqa: F401 - a Server's first loop (~1 ms a child)
    import yrdask.runtime.context  # noqa: F401
    import yrdask.serialization  # noqa: F401 - with the next: ~6 ms a child, measured
    import yrdask.stream  # noqa: F401
    import yrdask.worker.hosting  # noqa: F401
    import yrdask.worker.isolated.child  # noqa: F401
    import yrdask.worker.output  # noqa: F401
    from yrdask.runtime import runtime, transport  # noqa: F401 - a nested call's runtime

    runtime._load_machines()  # (its submitter and router): ~40 ms less at a first nested call
    from yrdask.worker.threads import LIMITS

    LIMITS._controller()  # threadpoolctl's scan: ~20 ms a child whose thread limits change

    import gc

    gc.collect()
    gc.freeze()  # the children's collections then leave the shared pages alone (less copying)
    me = os.getpid()
    children: dict[int, int | None] = {}  # pid -> the request it serves (None: a spare)
    waiting: list[tuple[int, int]] = []  # the spares: (pid, the zygote's end of its pipe)

    def fork() -> tuple[int, int]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(w)
                _forked_child(me, r, [fd for _pid, fd in waiting], listen or {})
            finally:
                os._exit(1)  # never back into the zygote's loop
        os.close(r)
        children[pid] = None
        return pid, w

    def hand(req: dict) -> None:
        line = (json.dumps(req) + "\n").encode()
        while True:
            pid, w = waiting.pop(0) if waiting else fork()
            try:
                os.write(w, line)  # (one longer than the pipe's buffer waits for the reader)
            except OSError:  # a spare that died: the next one
                continue
            finally:
                os.close(w)
            children[pid] = req["id"]
            return

    fd = sys.stdin.fileno()
    buf = b""
    open_ = True
    while open_:
        while len(waiting) < spares:
            waiting.append(fork())
        ready, _, _ = select.select([fd], [], [], 0.02)
        while children:  # reap, and tell the agent how each child ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is None:  # a spare: nobody waits for it
                for k, (spare, w) in enumerate(waiting):
                    if spare == pid:
                        os.close(waiting.pop(k)[1])
                        break
                continue
            _write_line({"exit": pid, "code": os.waitstatus_to_exitcode(status), "id": rid})
        if not ready:
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            open_ = False
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            hand(json.loads(line))
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
