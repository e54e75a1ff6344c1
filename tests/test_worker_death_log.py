"""On the embedded cluster a worker death prints one yrdask line naming the worker:
the nanny's bare "Restarting worker" warnings no longer reach the driver's stderr.

The driver runs as a subprocess so its real stderr can be read: it kills one of its worker
processes, waits until the nanny's replacement has registered, and exits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

DRIVER = textwrap.dedent('''
    import asyncio, os, signal, time
    import yrdask as yr
    from yrdask.cli import fetch_cluster_info
    from yrdask.runtime.context import current_runtime

    @yr.invoke
    def where():
        return os.getpid()

    yr.init(yr.Config(num_cpus=2))
    address = current_runtime().info.scheduler_address
    def processes(info):  # the worker processes of every node (a node is a host)
        return {p for node in info["workers"].values() for p in node["processes"]}

    def dask_view():  # pid -> address, by pid: a restarted worker may get its old port again
        workers = current_runtime().cluster.scheduler.workers  # a SortedDict, changed by the
        return {ws.pid: a for a, ws in list(dict.items(workers))}  # loop: copied in C

    before = processes(asyncio.run(fetch_cluster_info(address, 30)))
    killed = yr.get(where.invoke(), 60)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # polls the scheduler's state over its comm
        now = processes(asyncio.run(fetch_cluster_info(address, 30)))
        pids = dask_view()
        if len(now) == len(before) and set(pids.values()) == now and killed not in pids:
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the nanny did not bring a worker back")
    print("BACK", flush=True)
    yr.finalize()
''')


def test_a_worker_death_is_one_line_naming_the_worker():
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True,
                          timeout=150, stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert done.returncode == 0 and "BACK" in done.stdout, done.stderr
    lines = [line for line in done.stderr.splitlines() if "died; its nanny" in line]
    assert len(lines) == 1, done.stderr
    assert re.search(r"yrdask: worker process tcp://[\d.]+:\d+ died; its nanny tcp://", lines[0])
    assert "yrdask restarts or ends the instances it hosted" in lines[0]
    assert "Restarting worker" not in done.stderr, done.stderr
