"""The yr API on a GPU: a function and an instance that each hold one GPU and run torch on it.

Run: ``python examples/gpu_torch_yr.py``. ``yr.init()`` declares nothing: GPUs are detected
and offered as ``GPU`` (and ``GPU/<model>/count``). On a machine without one it says so and
exits with status 1. yr code reads its devices from ``CUDA_VISIBLE_DEVICES`` (docs/nodes.md).
"""

import os
import sys

import yrdask as yr

ONE_GPU = yr.InvokeOptions(custom_resources={"GPU/.+/count": 1})


@yr.invoke
def matmul(n: int) -> dict:
    """An n×n product on the GPU this call holds."""
    import torch

    x = torch.randn(n, n, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": torch.cuda.get_device_name(0), "finite": bool(torch.isfinite(y).all())}


@yr.instance
class Model:
    """Weights kept on the instance's GPU between calls."""

    def __init__(self, n: int) -> None:
        import torch

        self.w = torch.randn(n, n, device="cuda")

    def step(self) -> str | None:
        import torch

        self.w = torch.tanh(self.w @ self.w)
        return os.environ.get("CUDA_VISIBLE_DEVICES")


def main() -> int:
    yr.init()
    gpus = sum(node["capacity"].get("GPU", 0) for node in yr.resources())
    print("GPUs offered:", gpus, [k for node in yr.resources() for k in node["capacity"]
                                  if k.startswith("GPU/")])
    if not gpus:
        print("no GPU detected on this machine", file=sys.stderr)
        yr.finalize()
        return 1
    print("function:", yr.get(matmul.options(ONE_GPU).invoke(2048)))
    model = Model.options(ONE_GPU).invoke(1024)
    print("instance sees:", set(yr.get([model.step.invoke() for _ in range(5)])))
    model.terminate()
    yr.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
