"""The programs in examples/ run as a new user would run them, each in its own process on its
own embedded cluster, and print what they promise (the README's main example included)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)

#: example -> (how it is run, a line its output must contain)
EXAMPLES = {
    "training_tree.py": ([], "试验完成"),
    "fan_out_fan_in.py": ([], "from 16 tasks"),
    "nested_recursion.py": ([], "sum(range(100)) = 4950"),
    "wait_backpressure.py": ([], "100 results, at most 20 tasks in flight"),
    "ray_quickstart.py": (["-m", "yrdask.ray"], "caught: RayTaskError(ZeroDivisionError)"),
}


def test_every_example_is_covered():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_prints_its_result(name, tmp_path):
    how, expected = EXAMPLES[name]
    env = {k: v for k, v in os.environ.items() if k != "YR_SERVER_ADDRESS"}
    out = subprocess.run([sys.executable, *how, str(ROOT / "examples" / name)],
                         capture_output=True, text=True, timeout=150, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expected in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])
