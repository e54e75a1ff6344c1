"""Threads of a fresh worker that unpickle ray work at once import yrdask.ray safely.

On a worker, an actor class and the tasks that call it are unpickled by different threads;
each unpickle imports its own submodule of ``yrdask.ray`` (``remote_function``, ``actor``,
``exceptions``, the ``ray`` alias).  Python lets a thread import a submodule while another
still initialises the package; a submodule that then waits for the package (``import
yrdask.ray.X as Y`` does) deadlocks with it, and Python breaks the deadlock by handing one
thread a half-initialised module: ``ImportError: cannot import name 'RemoteFunction' from
partially initialized module`` or ``KeyError: 'yrdask.ray'`` inside ``pickle.loads``.
"""

from __future__ import annotations

import ast
import json
import time
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "ray_surface" / "scripts"

# One process, many "fresh workers": build the payloads, then in each round forget every
# yrdask.ray module (and the helper that says `import ray`) and unpickle them all at once
# from six threads, as a worker's task threads and instance starter do.
CHILD = r"""
import sys, threading, traceback, cloudpickle
import yrdask.worker.agent, yrdask.api.instances, yrdask.api.functions
from yrdask.serialization import loads
import yrdask.ray as ray
import yrdask.ray.util.queue
from yrdask.ray._alias import install
install()
import ray_helpers
from yrdask.ray.remote_function import TaskBody
from yrdask.ray._actor_host import host_class
ctx = {"namespace": "n", "job_id": "j", "alias": True, "resources": {}}
body = cloudpickle.dumps(TaskBody(ray_helpers.doubled_via_object_store, ctx, False, 0))
cls = cloudpickle.dumps(host_class(ray_helpers.Doubler, ctx, {}, None, 0)[0])
err = cloudpickle.dumps(ray.exceptions.RayTaskError("f", "tb", ValueError()))
empty = cloudpickle.dumps(yrdask.ray.util.queue.Empty)
payloads = [body, cls, err, empty, body, cls]
failures = []
for _ in range(ROUNDS):
    for name in [m for m in sys.modules if m in ("ray", "ray_helpers") or m.startswith(
            ("ray.", "yrdask.ray"))]:
        del sys.modules[name]
    if hasattr(yrdask, "ray"):
        del yrdask.ray  # the parent's attribute, set once the package was imported
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "RayAliasFinder"]
    barrier = threading.Barrier(len(payloads))
    def run(p):
        barrier.wait()
        try:
            loads(p)
        except BaseException:
            failures.append(traceback.format_exc())
    threads = [threading.Thread(target=run, args=(p,)) for p in payloads]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(len(failures))
print(failures[0] if failures else "")
"""


def test_threads_unpickling_ray_work_on_a_fresh_worker_import_it_safely():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(SCRIPTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD.replace("ROUNDS", "40")],
                         capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    count, _, first = out.stdout.partition("\n")
    assert count == "0", f"{count} unpickles failed in 40 rounds; the first:\n{first}"


def _flood(address: str, rounds: int) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(SCRIPTS / "first_tasks_flood.py"), address,
                          str(rounds)], capture_output=True, text=True, timeout=100, env=env)
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAILED")]
    assert out.returncode == 0 and out.stdout.endswith("done\n"), out.stdout + out.stderr[-3000:]
    assert not failed, f"{len(failed)} first tasks failed; the first: {failed[0]}"


def test_first_tasks_of_fresh_embedded_workers_find_yrdask_ray_whole():
    # Two fresh embedded clusters, each flooded with first tasks of both APIs at once.
    _flood("embedded", 2)


def test_first_tasks_of_a_fresh_dask_worker_find_yrdask_ray_whole(tmp_path):
    # ``dask worker --preload yrdask`` processes (not forked from the embedded launcher):
    # their plugin imports yrdask.ray before the agent takes work.
    sched_file = tmp_path / "sched.json"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--preload", "yrdask",
         "--port", "0", "--dashboard-address", ":0", "--scheduler-file", str(sched_file)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists() or not sched_file.read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, "no scheduler"
            time.sleep(0.05)
        address = json.loads(sched_file.read_text())["address"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--preload",
             "yrdask", "--nworkers", "2", "--nthreads", "4"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)
        _flood(address, 1)
    finally:
        from conftest import _stop_processes

        _stop_processes(procs[::-1])


def test_no_submodule_imports_a_sibling_module_object_by_dotted_path():
    # `import yrdask.ray.X as Y` waits for the package yrdask.ray to be initialised: the
    # deadlock above.  Submodules import names (`from yrdask.ray.X import name`).
    bad = []
    for path in sorted((ROOT / "yrdask" / "ray").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name} as {a.asname}"
                        for a in node.names
                        if a.name.startswith("yrdask.ray.") and a.asname]
    assert not bad, bad
