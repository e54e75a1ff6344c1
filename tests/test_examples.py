"""The programs in examples/ run as a new user would run them, each in its own process on its
own embedded cluster, and print what they promise (the README's main example included)."""

from __future__ import annotations

import os
import pathlib
import shutil
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
    "dask_meets_ray.py": ([], "groupby checked against pandas: 4 stores"),
}


#: GPU examples: they need a detected GPU and torch (benchmarks/device_check.sh runs them on
#: one); on a machine without a GPU they must say so and fail, not hang or pretend
GPU_EXAMPLES = {
    "gpu_torch.py": (["-m", "yrdask.ray"], "GPU resources: {}"),
    "gpu_torch_yr.py": ([], "GPUs offered: 0"),
}
HAS_GPU = shutil.which("nvidia-smi") is not None


def run_example(how: list, name: str, cwd) -> subprocess.CompletedProcess:
    """``examples/name`` as a user runs it, on its own embedded cluster."""
    env = {k: v for k, v in os.environ.items() if k != "YR_SERVER_ADDRESS"}
    return subprocess.run([sys.executable, *how, str(ROOT / "examples" / name)],
                          capture_output=True, text=True, timeout=150, cwd=cwd, env=env)


def test_every_example_is_covered():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(
        [*EXAMPLES, *GPU_EXAMPLES])


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: device_check.sh runs these")
@pytest.mark.parametrize("name", sorted(GPU_EXAMPLES))
def test_gpu_example_without_a_gpu_says_so_and_fails(name, tmp_path):
    how, expected = GPU_EXAMPLES[name]
    out = run_example(how, name, tmp_path)
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-3000:])
    assert expected in out.stdout and "no GPU detected" in out.stderr, (out.stdout, out.stderr)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_prints_its_result(name, tmp_path):
    how, expected = EXAMPLES[name]
    out = run_example(how, name, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expected in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])
