"""The node's object store: large values as files in shared memory, mapped by every reader.

One store per node (:func:`node_id`: by default the host), shared by every yr process there:
the driver, the workers and their isolated children.  A large value (a pickle whose
protocol-5 out-of-band buffers make it bigger than the inline limit) is written once, as one
file under ``/dev/shm/yrdask-<uid>-<node>/objects/``; any process on the node reads it by
``mmap``-ing that file read-only and unpickling with the mapped buffers, so a NumPy array
comes back as a read-only view of the shared pages (no copy, as on Ray).  Why files under
``/dev/shm`` and not ``multiprocessing.shared_memory`` (docs/objects.md says more):

* a file is unlinked at any time without breaking readers: a mapping outlives its name, so
  freeing never waits for readers, and a reader that crashes leaves nothing to clean;
* ``multiprocessing.shared_memory`` registers every segment with the resource tracker of the
  process that opened it, which unlinks it when *that* process exits (bpo-38119) or warns
  about "leaked" segments: wrong for a store that outlives its writers;
* spilling is a copy to a file on disk and an unlink; reading the spilled file maps it the
  same way (page cache), so a spilled value is restored transparently.

Freed files are recycled: a file nobody maps any more (every mapping holds a shared
``flock`` on it) goes to a small pool whose pages the next write of a similar size reuses.

Cleanup.  Every process that writes to the store registers its pid (with its start time, so
a reused pid is not mistaken for it) under ``pids/``.  A tiny *reaper* process
(:mod:`yrdask.runtime.store_reaper`, run as ``python -I -S``, detached) watches those pids and removes the whole directory, and the node's spill
directory, once none is alive: the last process ending by ``SIGKILL`` leaves nothing behind.
A process that attaches checks the reaper too and starts a new one if it died.  Changes of
the registry, reserving room for a write, and spilling happen under an ``flock`` on ``lock``
(dropped by the kernel if its holder dies).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

from yrdask.errors import YRValueError
from yrdask.runtime import store_reaper
from yrdask.runtime.store_reaper import (alive as _alive, listdir as _listdir,
                                         remove_store as _remove_store,
                                         start_time as _start_time, unlink as _unlink)
from yrdask.serialization import Frames

__all__ = ["node_id", "node_store", "NodeStore", "set_capacity", "close_node_store",
           "drop_local_copy", "configure"]

MAGIC = b"YRDS0001"
ALIGN = 64  # every buffer starts on a cache line (NumPy's SIMD loops like that)
CHUNK = 1 << 30  # one write() moves at most 2 GiB on Linux
SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
REAPER_POLL_S = 0.5


def node_id() -> str:
    """The node whose store this process uses: ``YRDASK_NODE_ID`` if set, else the Dask key
    ``yrdask.worker.node`` (as the scheduler groups worker processes, docs/nodes.md), else
    the host name.  One helper on purpose: everything that means "this node" for objects
    asks it."""
    named = os.environ.get("YRDASK_NODE_ID")
    if not named and "dask" in sys.modules:  # never imports Dask itself
        named = sys.modules["dask"].config.get("yrdask.worker.node", None)
    return str(named) if named else socket.gethostname()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:100]


def store_dir(node: str | None = None) -> str:
    """Where the store of ``node`` (default: this process's node) keeps its files."""
    return os.path.join(SHM_ROOT, f"yrdask-{os.getuid()}-{_safe(node or node_id())}")


def spill_dir(node: str | None = None) -> str:
    """The local-disk directory a node's store spills to."""
    return os.path.join(tempfile.gettempdir(), f"yrdask-spill-{os.getuid()}-{_safe(node or node_id())}")


@functools.lru_cache(maxsize=1)
def default_capacity() -> int:
    """Ray's default: 30 % of the machine's memory, and no more than the shared-memory mount."""
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:  # pragma: no cover - psutil is a dependency of distributed
        mem = 8 << 30
    try:
        st = os.statvfs(SHM_ROOT)
        mem = min(int(mem * 0.3), int(st.f_blocks * st.f_frsize * 0.9))
    except OSError:
        mem = int(mem * 0.3)
    return mem


def check_capacity(value: Any, what: str) -> int | None:
    """A store size in bytes (int > 0) or None; ``YRValueError`` naming ``what`` otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        from dask.utils import parse_bytes

        try:
            value = parse_bytes(value)
        except ValueError:
            raise YRValueError(f"{what}: {value!r} is not a size (say 2e9 or '2GB')") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise YRValueError(f"{what} must be a positive number of bytes (or None: 30 % of the "
                           f"node's memory), got {value!r}")
    return int(value)


class NodeStore:
    """This process's handle on its node's store (see module docstring)."""

    def __init__(self, node: str | None = None) -> None:
        self.node = node or node_id()
        self.dir = store_dir(self.node)
        self.objects = os.path.join(self.dir, "objects")
        self.pids = os.path.join(self.dir, "pids")
        self.spill = spill_dir(self.node)
        self.lock_path = os.path.join(self.dir, "lock")
        self.pid = os.getpid()
        self.tag = f"{self.pid}-{_start_time(self.pid) or '0'}"
        self.attached = False

    # -- registry --------------------------------------------------------------------------

    def _locked(self) -> int:
        """An fd holding the store's lock (its directory made if needed); caller unlocks."""
        while True:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the reaper removed the store while we waited: make it again

    def attach(self) -> None:
        """Register this process (and start a reaper if none watches the store)."""
        fd = self._locked()
        try:
            for sub in (self.objects, self.pids, os.path.join(self.dir, "dying"),
                        os.path.join(self.dir, "free")):
                os.makedirs(sub, exist_ok=True)
            open(os.path.join(self.pids, self.tag), "wb").close()
            if not self._reaper_alive():
                self._start_reaper()
            if _capacity is not None:
                self.set_capacity(_capacity)
            self.attached = True
        finally:
            os.close(fd)

    def ensure_attached(self) -> None:
        """Writers register (their values must outlive readers); readers need not."""
        if not self.attached:
            with _store_lock:
                if not self.attached:
                    self.attach()

    def _reaper_alive(self) -> bool:
        try:
            with open(os.path.join(self.dir, "reaper")) as f:
                return _alive(f.read().strip())
        except OSError:
            return False

    def _start_reaper(self) -> None:
        # The reaper forks once more and its parent exits: nobody has to wait for it.  It
        # runs as a file (no site, no yrdask package import): store_reaper imports the
        # standard library only.
        subprocess.run([sys.executable, "-I", "-S", store_reaper.__file__, self.dir,
                        self.spill, str(REAPER_POLL_S)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                       start_new_session=True, check=False, timeout=30)

    def close(self) -> None:
        """This process leaves the store; the last live one removes it (the reaper would)."""
        if not self.attached:
            return
        self.attached = False
        try:
            fd = self._locked()
        except OSError:
            return
        try:
            try:
                os.unlink(os.path.join(self.pids, self.tag))
            except FileNotFoundError:
                pass
            if not any(_alive(t) for t in _listdir(self.pids)):
                _remove_store(self.dir, self.spill)
        finally:
            os.close(fd)

    # -- values ----------------------------------------------------------------------------

    def capacity(self) -> int:
        """The node's store size in bytes (``capacity`` file, else the default)."""
        try:
            with open(os.path.join(self.dir, "capacity")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return default_capacity()

    def set_capacity(self, nbytes: int) -> None:
        tmp = os.path.join(self.dir, f".capacity-{self.pid}")
        with open(tmp, "w") as f:
            f.write(str(int(nbytes)))
        os.replace(tmp, os.path.join(self.dir, "capacity"))

    def used(self) -> int:
        """Bytes of values held in shared memory now (spilled ones not counted)."""
        total = 0
        for e in _scandir(self.objects):  # values being written count: their size is reserved
            try:
                total += e.stat().st_size
            except OSError:
                pass
        return total

    def pull(self, object_id: str, fetch: Callable[[], Any]) -> Any:
        """The payload of ``object_id`` fetched with ``fetch()`` once for the whole node.

        Processes of the node that want it at the same time wait on one lock; the first
        fetches and stores it, the others map the stored copy.  Small payloads (bytes) are
        returned as they came, not stored.
        """
        self.ensure_attached()
        pulls = os.path.join(self.dir, "pulls")
        os.makedirs(pulls, exist_ok=True)
        path = os.path.join(pulls, object_id)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            got = self.get(object_id)
            if got is not None:
                return got
            payload = fetch()
            if type(payload) is Frames:
                return self.put(object_id, payload)
            return payload
        finally:
            _unlink(path)
            os.close(fd)

    def put(self, object_id: str, frames: Frames) -> Frames:
        """Store a value's frames under ``object_id`` (one copy); returns the stored frames.

        Values beyond the capacity make room by spilling the least recently used others to
        disk; a value larger than the whole store goes to disk itself.
        """
        views = [memoryview(f).cast("B") for f in frames.frames]
        header = struct.pack(f"<8sI{len(views)}Q", MAGIC, len(views), *(v.nbytes for v in views))
        size = _aligned(len(header)) + sum(_aligned(v.nbytes) for v in views)
        self.ensure_attached()
        lock = self._locked()  # room is made and reserved (the file's size) under the lock
        try:
            target = self.objects
            if self.used() + size > self.capacity():
                target = self._make_room(size)
            tmp = os.path.join(target, f".{object_id}.{self.pid}.{threading.get_ident()}")
            if target is self.objects:
                _reclaim(self.dir)
            if target is self.objects and _from_pool(self.dir, size, tmp):
                fd = os.open(tmp, os.O_WRONLY)
            else:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(lock)
        try:
            _write_all(fd, memoryview(header), 0)
            off = _aligned(len(header))
            for v in views:
                _write_all(fd, v, off)
                off += _aligned(v.nbytes)
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(target, object_id))
        return self.get(object_id)

    def _make_room(self, size: int) -> str:
        """Spill least recently used values until ``size`` fits (the caller holds the lock);
        the directory to write to."""
        cap = self.capacity()
        if size > cap:
            os.makedirs(self.spill, mode=0o700, exist_ok=True)
            return self.spill
        entries = []
        for e in _scandir(self.objects):
            if not e.name.startswith("."):  # not the ones being written
                try:
                    st = e.stat()
                except OSError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, e.name))
        used = self.used()
        entries.sort()
        for _, nbytes, name in entries:
            if used + size <= cap:
                break
            if self._spill_one(name):
                used -= nbytes
        if used + size > cap:  # what is left is being written: this one goes to disk
            os.makedirs(self.spill, mode=0o700, exist_ok=True)
            return self.spill
        return self.objects

    def _spill_one(self, object_id: str) -> bool:
        """Copy one value to disk, then drop it from shared memory (mappings stay valid)."""
        src = os.path.join(self.objects, object_id)
        os.makedirs(self.spill, mode=0o700, exist_ok=True)
        tmp = os.path.join(self.spill, f".{object_id}.{self.pid}")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, os.path.join(self.spill, object_id))
            os.unlink(src)
        except FileNotFoundError:  # freed meanwhile
            _unlink(tmp)
            return False
        return True

    def get(self, object_id: str) -> Frames | None:
        """The stored frames of ``object_id`` as read-only views of its mapping, or None.

        The mapping holds a shared ``flock`` on its file for as long as it lives (``mmap``
        keeps a duplicate of the descriptor): :meth:`delete` recycles a file's pages only
        when nobody holds one.
        """
        import mmap

        for where in (self.objects, self.spill):
            path = os.path.join(where, object_id)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                try:  # recycled between our open and our lock: it is gone
                    if os.stat(path).st_ino != os.fstat(fd).st_ino:
                        continue
                except FileNotFoundError:
                    continue
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                if where is self.objects:
                    try:
                        os.utime(fd)  # recently read: spilled last
                    except OSError:
                        pass
            finally:
                os.close(fd)
            return _frames(m)
        return None

    def contains(self, object_id: str) -> bool:
        return (os.path.exists(os.path.join(self.objects, object_id))
                or os.path.exists(os.path.join(self.spill, object_id)))

    def delete(self, object_id: str) -> None:
        """Drop the node's copy of ``object_id`` (idempotent).  Readers keep their mappings;
        the memory goes back once the last of them is dropped."""
        _delete(self.dir, self.spill, object_id)


def _delete(directory: str, spill: str, object_id: str) -> None:
    """Drop a value's files.  A shared-memory one moves to ``dying``: once nobody maps it
    any more, :func:`_reclaim` puts it in the ``free`` pool, whose pages the next write of
    a similar size reuses (allocating and zeroing fresh tmpfs pages costs more than the
    copy itself, and freeing them costs again)."""
    path = os.path.join(directory, "objects", object_id)
    dying = os.path.join(directory, "dying")
    try:
        os.rename(path, os.path.join(dying, object_id))
    except FileNotFoundError:
        if os.path.isdir(os.path.join(directory, "objects")) and not os.path.isdir(dying):
            os.makedirs(dying, exist_ok=True)
            try:
                os.rename(path, os.path.join(dying, object_id))
            except FileNotFoundError:
                pass
    _unlink(os.path.join(spill, object_id))
    _reclaim(directory)


POOL_FILES = 4  # freed files kept for reuse, per node
POOL_BYTES = 512 << 20  # and their bytes at most


def _reclaim(directory: str) -> None:
    """Files in ``dying`` that no process maps any more go to the pool (or are unlinked)."""
    dying = os.path.join(directory, "dying")
    pool = os.path.join(directory, "free")
    for name in _listdir(dying):
        path = os.path.join(dying, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # still mapped by a reader
                continue
            size = os.fstat(fd).st_size
            if size > POOL_BYTES:
                _unlink(path)
                continue
            os.makedirs(pool, exist_ok=True)
            kept = sorted(_listdir(pool))
            total = sum(_pool_size(n) for n in kept)
            while kept and (len(kept) >= POOL_FILES or total + size > POOL_BYTES):
                total -= _pool_size(kept[0])
                _unlink(os.path.join(pool, kept.pop(0)))  # oldest out
            import time

            try:
                os.rename(path, os.path.join(pool, f"{time.monotonic_ns():020d}-{size}-{os.getpid()}"))
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)


def _pool_size(name: str) -> int:
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return 0


def _from_pool(directory: str, size: int, tmp: str) -> bool:
    """Claim a freed file of about ``size`` bytes as ``tmp`` (its pages are kept)."""
    pool = os.path.join(directory, "free")
    try:
        names = os.listdir(pool)
    except FileNotFoundError:
        return False
    for name in names:
        have = _pool_size(name)
        if size <= have <= size + size // 2:
            try:
                os.rename(os.path.join(pool, name), tmp)  # atomic: one claimer wins
                return True
            except FileNotFoundError:
                continue
    return False


def _frames(m: Any) -> Frames:
    view = memoryview(m)
    magic, n = struct.unpack_from("<8sI", view)
    if magic != MAGIC:
        raise ValueError("not a yrdask object file")
    lengths = struct.unpack_from(f"<{n}Q", view, 12)
    off = _aligned(12 + 8 * n)
    frames = []
    for length in lengths:
        frames.append(view[off:off + length])
        off += _aligned(length)
    return Frames(frames)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    """Write ``view`` at ``offset``; a large one in parallel slices (as Ray's put copies with
    several threads: page allocation and copying scale with cores)."""
    n = view.nbytes
    workers = min(PARALLEL_MAX, (os.cpu_count() or 1), n // PARALLEL_SLICE)
    if workers < 2:
        _pwrite(fd, view, offset)
        return
    step = -(-n // workers) // ALIGN * ALIGN + ALIGN
    list(_writers().map(lambda i: _pwrite(fd, view[i * step:(i + 1) * step], offset + i * step),
                        range(-(-n // step))))


PARALLEL_SLICE = 16 << 20  # bytes per writing thread, at least
PARALLEL_MAX = 8
_pool: Any = None


def _writers() -> Any:
    global _pool
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        with _store_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(PARALLEL_MAX, thread_name_prefix="yr-store-write")
    return _pool


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:done + CHUNK], offset + done)


def _scandir(path: str) -> list:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


_store: NodeStore | None = None
_store_lock = threading.RLock()
_capacity: int | None = None


def node_store() -> NodeStore:
    """This process's store handle (a new one after a fork); it registers on first write."""
    global _store
    st = _store
    if st is not None and st.pid == os.getpid():
        return st
    with _store_lock:
        st = _store
        if st is None or st.pid != os.getpid():
            st = NodeStore()
            _store = st
    return st


def configure(explicit: Any = None, what: str = "object_store_memory") -> None:
    """Size this node's store from ``explicit`` (``Config``/``ray.init``) or the Dask key
    ``yrdask.object-store.memory``; nothing set keeps the node's size (default 30 %)."""
    value = explicit
    if value is None:
        import dask

        value = dask.config.get("yrdask.object-store.memory", None)
        what = "the Dask config key yrdask.object-store.memory"
    nbytes = check_capacity(value, what)
    if nbytes is not None:
        set_capacity(nbytes)


def drop_local_copy(object_id: str) -> None:
    """Free this node's copy of ``object_id``, shared memory or spilled (idempotent; no
    need to be attached: unlinking a name is enough, mappings keep their pages alive)."""
    st = _store
    if st is None or st.pid != os.getpid():
        _delete(store_dir(), spill_dir(), object_id)
        return
    st.delete(object_id)


def set_capacity(nbytes: int | None) -> None:
    """Size this node's store (``object_store_memory``); None keeps what the node has."""
    global _capacity
    _capacity = nbytes
    if nbytes is not None:
        st = node_store()
        if st.attached:
            st.set_capacity(nbytes)
        else:
            st.ensure_attached()  # writes it


def close_node_store() -> None:
    """This process leaves its node's store (finalize / worker close)."""
    global _store, _pool
    with _store_lock:
        st, _store = _store, None
        pool, _pool = _pool, None
    if pool is not None:  # its idle threads end
        pool.shutdown(wait=False)
    if st is not None and st.pid == os.getpid():
        st.close()
