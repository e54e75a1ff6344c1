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
from yrdask.ray.actor import host_class
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
