"""``python -m yrdask.ray script.py`` runs a Ray program unchanged (SPEC §7): ``import ray``
and ``from ray.util import ActorPool`` resolve to yrdask.ray in the driver and, through a
helper module that says ``import ray``, in the workers; a worker crash (``os._exit``) is
retried, user exceptions are retried with ``retry_exceptions``, ActorPool and async actors
work, and ``max_retries=0`` runs a crashing task once.  The expected lines are what Ray 2.40 prints for the same program.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
ROOT = SCRIPTS.parents[2]

EXPECTED = [
    "recovered after a worker crash",
    "WorkerCrashedError after 1 run(s)",
    "succeeded on try 2",
    "helper: 42",
    "helper actor: 84",
    "KeyError caught; is RayTaskError: True",
    "pool: [101, 102, 103, 104]",
    "async: [1, 2, 3, 4, 5]",
    "await: 6",
    "done",
]


def test_ray_program_runs_unchanged(tmp_path):
    env = dict(os.environ)
    # workers import the helper module by name, as they would on Ray with a working_dir
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("YR_SERVER_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", str(SCRIPTS / "ray_program.py"),
                          str(tmp_path)], capture_output=True, text=True, timeout=200, env=env,
                         cwd=str(tmp_path))
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert out.returncode == 0, out.stderr[-3000:]
    assert lines == EXPECTED, out.stderr[-3000:]
    assert (tmp_path / "crashed").exists() and (tmp_path / "flaky").read_text() == "xxx"


def test_no_package_named_ray_is_installed():
    # without the alias, `ray` is not importable from anything yrdask installed
    code = ("import importlib.util as u, yrdask, os; s = u.find_spec('ray');"
            "root = os.path.dirname(os.path.dirname(yrdask.__file__));"
            "print(s is None or not (s.origin or '').startswith(root))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.stdout.strip() == "True", out.stderr


def test_usage_without_a_script():
    out = subprocess.run([sys.executable, "-m", "yrdask.ray"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "usage: python -m yrdask.ray" in out.stderr


def test_processes_multiprocessing_spawns_import_ray_too(tmp_path):
    # a ProcessPoolExecutor under "spawn" imports the program's __main__ again in each
    # child, with its `import ray` (Ray's anti-pattern page on forking does this)
    script = tmp_path / "spawns.py"
    script.write_text(
        "import multiprocessing\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "import ray\n\n"
        "def name(_):\n"
        "    return ray.__name__\n\n"
        "if __name__ == '__main__':\n"
        "    multiprocessing.set_start_method('spawn', force=True)\n"
        "    with ProcessPoolExecutor(max_workers=1) as pool:\n"
        "        print(pool.submit(name, 0).result())\n")
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", str(script)], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "yrdask.ray", out.stderr[-3000:]


def test_python_processes_the_program_starts_import_ray_too(tmp_path):
    # Ray's tests start drivers with subprocess.run([sys.executable, "driver.py"]): under
    # python -m yrdask.ray their `import ray` (and `ray.util`) is yrdask.ray as well
    child = tmp_path / "child.py"
    child.write_text("import ray, ray.util, yrdask.ray, yrdask.ray.util\n"
                     "print(ray is yrdask.ray, ray.util is yrdask.ray.util)\n")
    script = tmp_path / "starts.py"
    script.write_text("import subprocess, sys\n"
                      "import ray\n\n"
                      f"print(subprocess.check_output([sys.executable, {str(child)!r}], "
                      "text=True).strip())\n")
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", str(script)], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "True True", out.stderr[-3000:]
    plain = subprocess.run([sys.executable, str(child)], capture_output=True, text=True,
                           timeout=60, cwd=str(tmp_path),
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert plain.returncode != 0 and "No module named 'ray'" in plain.stderr  # only under it
