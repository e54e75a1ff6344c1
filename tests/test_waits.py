"""Waiting requests end with their job: a driver that leaves while its instance
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


# -- waits in the caller's words -------------------------------------------------------------

import logging  # noqa: E402
import time  # noqa: E402

import dask  # noqa: E402

import yrdask as yr  # noqa: E402
from yrdask.scheduler.waits import in_ray_words, ray_shape  # noqa: E402


@yr.invoke
def nap(s: float) -> int:
    time.sleep(s)
    return 1


@yr.instance
class Huge:
    def ping(self) -> int:
        return 1


def test_queueing_behind_own_work_is_no_warning(cluster, caplog):
    """200 short tasks on 2 CPUs queue behind each other: no warning, though their lease
    requests wait past the (lowered) threshold; a request that can never run still warns."""
    cluster(kind="embedded", num_cpus=2)  # its scheduler logs in this process
    with dask.config.set({"yrdask.scheduling.wait-warning": "0.2s"}), \
            caplog.at_level(logging.WARNING, logger="yrdask.scheduler"):
        assert sum(yr.get([nap.invoke(0.03) for _ in range(200)], T)) == 200
        queued = [r.getMessage() for r in caplog.records if "waits for" in r.getMessage()]
        assert not queued, queued
        h = Huge.options(yr.InvokeOptions(cpu=64_000, memory=0,
                                          schedule_timeout_ms=120_000)).invoke()
        try:
            text = wait_until(lambda: next((r.getMessage() for r in caplog.records
                                            if "Huge instance" in r.getMessage()), None),
                              T, "the warning about an instance that can never run")
        finally:
            h.terminate()
    assert "can never run" in text and "InvokeOptions(cpu=" in text, text


def test_ray_jobs_hear_ray_words(cluster, caplog):
    """A Ray program's waits name num_cpus, actors and ray.init, not InvokeOptions."""
    import yrdask.ray as ray

    cluster.finalize()
    with dask.config.set({"yrdask.scheduling.wait-warning": "0.2s"}), \
            caplog.at_level(logging.WARNING, logger="yrdask.scheduler"):
        ray.init(num_cpus=2)
        try:
            @ray.remote(num_cpus=64)
            class Giant:
                def ping(self) -> int:
                    return 1
            actor = Giant.remote()
            text = wait_until(lambda: next((r.getMessage() for r in caplog.records
                                            if "Giant actor" in r.getMessage()), None),
                              T, lambda: f"a Ray-worded warning in {caplog.text}")
            ray.kill(actor)
        finally:
            ray.shutdown()
    assert "num_cpus=64" in text and "ray.init(num_cpus=" in text, text
    assert "InvokeOptions" not in text and "millicores" not in text, text


def test_ray_words_for_shapes_and_reasons():
    assert ray_shape({"CPU": 1500.0, "Memory": 0.0, "GPU": 1.0, "disk": 2.0}) == \
        "num_cpus=1.5, num_gpus=1, resources={'disk': 2}"
    why = {"what": "task lease request R5 of tcp://a:1", "needs": {"CPU": 1000.0},
           "waited_s": 6.0, "reasons": ["worker tcp://w:2: needs CPU 1000, free 0 of 2000 "
                                        "millicores; held by 2 Counter instances (I1, I2)"]}
    in_ray_words(why)
    assert why["text"].startswith("Ray task request R5 of tcp://a:1 waits for num_cpus=1 "
                                  "(6 s so far): worker tcp://w:2: needs 1 CPU, 0 of 2 free; "
                                  "held by 2 Counter actors (I1, I2). To place it"), why["text"]
