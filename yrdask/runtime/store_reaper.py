"""The node store's reaper: removes a store once no process registered in it is alive.

A detached process (``python -I -S <this file>``, started by :class:`~yrdask.runtime.store.NodeStore`)
polls the store's ``pids/`` registry and removes the store directory and its spill directory
once every registered process has ended, so the last one ending by ``SIGKILL`` leaves
nothing behind.  It imports the standard library only (no ``site``, no yrdask, no Dask): it
starts in milliseconds and outlives the package's own imports.  ``store.py`` uses the same
helpers (:func:`alive`, :func:`remove_store`), so the rules exist once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time


def start_time(pid: int) -> str | None:
    """The start time of a live process ``pid`` (None if it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        if not os.path.isdir("/proc"):  # no procfs: trust kill(0)
            try:
                os.kill(pid, 0)
                return "0"
            except ProcessLookupError:
                return None
            except PermissionError:
                return "0"
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def alive(tag: str) -> bool:
    """``tag`` is ``"<pid>-<start time>"``: is that very process still running?"""
    pid, _, start = tag.partition("-")
    try:
        now = start_time(int(pid))
    except ValueError:
        return False
    return now is not None and (start == now or now == "0")


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def remove_store(directory: str, spill: str) -> None:
    """Remove a store nobody uses (under its lock): objects, spill, registry, then the lock."""
    shutil.rmtree(spill, ignore_errors=True)
    for name in ("objects", "pids"):
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name != "lock":
            p = os.path.join(directory, name)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else unlink(p)
    unlink(os.path.join(directory, "lock"))
    try:
        os.rmdir(directory)
    except OSError:
        pass


def _anyone_alive(pids: str) -> bool:
    return any(alive(t) for t in listdir(pids))


def reap(directory: str, spill: str, poll: float) -> None:
    """Watch the store at ``directory`` (this process as its one reaper) until nobody is
    alive in it, then remove it.  Returns when done, or when another reaper took over."""
    me = f"{os.getpid()}-{start_time(os.getpid())}"
    lock = os.path.join(directory, "lock")
    try:  # announce this reaper, under the store's lock
        fd = os.open(lock, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(os.path.join(directory, ".reaper"), "w") as f:
            f.write(me)
        os.replace(os.path.join(directory, ".reaper"), os.path.join(directory, "reaper"))
        os.close(fd)
    except OSError:
        return
    pids = os.path.join(directory, "pids")
    while True:
        time.sleep(poll)
        if _anyone_alive(pids):
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with open(os.path.join(directory, "reaper")) as f:
                if f.read().strip() != me:
                    return  # another reaper took over
        except OSError:
            return
        if _anyone_alive(pids):  # one registered meanwhile
            os.close(fd)
            continue
        remove_store(directory, spill)  # (removing the lock file; the kernel drops the flock)
        return


def main(argv: list[str]) -> None:
    """``<store dir> <spill dir> <poll seconds>``: detach (fork once more, new session) so
    nobody waits for this process, then :func:`reap`."""
    directory, spill, poll = argv[0], argv[1], float(argv[2])
    if os.fork():
        os._exit(0)
    if os.getsid(0) != os.getpid():
        os.setsid()
    reap(directory, spill, poll)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
