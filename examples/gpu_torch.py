"""A Ray GPU program: tasks and an actor that each hold one GPU and run torch on it.

Run it unchanged on yrdask with ``python -m yrdask.ray examples/gpu_torch.py``, or on Ray with
``python examples/gpu_torch.py``. ``ray.init()`` declares nothing: the GPUs are detected. On a
machine without one it says so and exits with status 1. What each piece sees is printed, so
the two systems can be compared line by line (docs/nodes.md).
"""

import os
import sys
import tempfile
import time
import uuid

import ray


@ray.remote(num_gpus=1)
def matmul(n: int) -> dict:
    """One GPU's worth of work: an n×n product on the device this task holds."""
    import torch

    x = torch.randn(n, n, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "device": torch.cuda.get_device_name(0), "finite": bool(torch.isfinite(y).all())}


@ray.remote(num_gpus=0.5)
def half(room: str) -> bool:
    """Half a GPU: two of these hold one device at the same time, so each sees the other
    arrive in ``room`` (a folder) while it holds its half."""
    import torch

    torch.ones(1, device="cuda").add_(1)
    open(os.path.join(room, uuid.uuid4().hex), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(room)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(os.listdir(room)) >= 2


@ray.remote(num_gpus=1)
class Model:
    """An actor that keeps its weights on its GPU between calls."""

    def __init__(self, n: int) -> None:
        import torch

        self.w = torch.randn(n, n, device="cuda")

    def step(self) -> dict:
        import torch

        self.w = torch.tanh(self.w @ self.w)
        return {"gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "accelerators": ray.get_runtime_context().get_accelerator_ids().get("GPU"),
                "norm": float(self.w.norm())}


def main() -> int:
    t0 = time.perf_counter()
    ray.init()
    resources = ray.cluster_resources()
    print("init_s:", round(time.perf_counter() - t0, 2))
    print("GPU resources:", {k: v for k, v in resources.items()
                             if k == "GPU" or k.startswith("accelerator_type")})
    if not resources.get("GPU"):
        print("no GPU detected on this machine", file=sys.stderr)
        ray.shutdown()
        return 1

    t = time.perf_counter()
    first = ray.get(matmul.remote(4096))
    print("first GPU task:", first, f"({time.perf_counter() - t:.2f} s, CUDA start included)")
    t = time.perf_counter()
    for _ in range(5):
        ray.get(matmul.remote(256))
    print(f"GPU task round trip, warm: {(time.perf_counter() - t) / 5 * 1000:.1f} ms")

    with tempfile.TemporaryDirectory() as room:
        print("two num_gpus=0.5 tasks held the GPU together:",
              all(ray.get([half.remote(room), half.remote(room)])))

    model = Model.remote(1024)
    steps = ray.get([model.step.remote() for _ in range(5)])
    print("actor:", steps[-1]["gpu_ids"], steps[-1]["accelerators"],
          "same GPU every call:", len({tuple(s["gpu_ids"]) for s in steps}) == 1)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
