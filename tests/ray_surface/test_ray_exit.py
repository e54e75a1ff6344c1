"""A Ray program that ends with work in flight ends quietly (exit code 0), as on Ray: no
"Event loop is closed" from workers that finish a task while they close, no traceback for
the futures of refs that ``asyncio`` stopped waiting for."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
ROOT = SCRIPTS.parents[2]


def test_program_ending_with_work_in_flight_is_quiet(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("YR_SERVER_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", str(SCRIPTS / "ray_exit_program.py")],
                         capture_output=True, text=True, timeout=100, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["first", "[0.0]", "timed", "out", "shut", "down"], out.stdout
    assert "Traceback" not in out.stderr and "Error" not in out.stderr, out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr[-3000:]  # no worker death reported
