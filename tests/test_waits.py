"""Waiting requests end with their job (issue 12): a driver that leaves while its instance
and its task wait for resources leaves nothing counted as waiting at the scheduler; while
they wait, the driver (on another host than the scheduler) is told why.

A second driver (a subprocess) joins the cli cluster, creates an instance and submits a task
that both wait (64 CPUs: more than any worker offers; a two-minute schedule timeout), says so
once the scheduler lists both of its requests as waiting, and leaves when told to.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import wait_until
from yrdask.cli import fetch_cluster_info
from yrdask.runtime.context import current_runtime

pytestmark = pytest.mark.timeout(180)

T = 60

DRIVER = textwrap.dedent('''
    import asyncio, json, sys, time
    import yrdask as yr
    from yrdask.cli import fetch_cluster_info
    from yrdask.runtime.context import current_runtime

    @yr.instance
    class Big:
        def ping(self):
            return 1

    @yr.invoke
    def big_task():
        return 1

    import logging, threading
    warned = threading.Event()  # the scheduler's long-wait warning reached this driver

    class Catch(logging.Handler):
        def emit(self, record):
            if "waits for" in record.getMessage() and "Big instance" in record.getMessage():
                warned.set()
    logging.getLogger("yrdask.transport").addHandler(Catch())

    address = sys.argv[1]
    yr.init(yr.Config(server_address=address))
    job = current_runtime().info.job_id
    many = dict(cpu=64_000, memory=0, schedule_timeout_ms=120_000)
    h = Big.options(yr.InvokeOptions(**many)).invoke()
    ref = big_task.options(yr.InvokeOptions(**many)).invoke()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the scheduler's view, another process: polled
        rows = [w for w in asyncio.run(fetch_cluster_info(address, 30))["waiting"]
                if w["job"] == job]
        if {w["kind"] for w in rows} == {"instance", "lease"}:
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the two requests were not listed as waiting")
    # after yrdask.scheduling.wait-warning (5 s by default) the driver logs why it waits
    print(json.dumps({"job": job, "instance": h.instance_id, "warned": warned.wait(60)}),
          flush=True)
    sys.stdin.readline()  # the test says when to leave
    yr.finalize()
''')


def test_a_finished_job_leaves_no_waiting_request_counted(cli_cluster):
    address = current_runtime().info.scheduler_address
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, address], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        job = json.loads(line)
        assert job["warned"], "the driver was not told why its instance waits"
        proc.stdin.write("leave\n")
        proc.stdin.flush()
        assert proc.wait(T) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)
        proc.stdout.close()
        proc.stdin.close()
        proc.stderr.close()

    def info():
        return asyncio.run(fetch_cluster_info(address, T))

    def settled():
        now = info()
        mine = [w for w in now["waiting"] if w["job"] == job["job"]]
        pending = [i for i in now["instances"] if i["instance_id"] == job["instance"]]
        return (not mine and not pending) and now
    now = wait_until(settled, T, lambda: f"job {job} to leave nothing waiting: {info()}")
    # Nothing of it counts: no waiting row at all is left (this module's job waits for none).
    assert not now["waiting"], now["waiting"]
    tomb = next(t for t in now["ended"] if t["instance_id"] == job["instance"])
    assert tomb["class"] == "Big" and tomb["job"] == job["job"] and "ended" in tomb["reason"]
