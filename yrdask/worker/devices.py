"""What a worker process offers to its node: the node's id, its GPUs, and node-wide resources.

A *node* is a host (``docs/nodes.md``): the scheduler pools the offers of every worker
process that names the same node.  The node id is the worker's host IP unless the process
is told otherwise (``YRDASK_NODE_ID`` or the Dask config key ``yrdask.worker.node``), which
is how one machine can play several nodes, as Ray's ``cluster_utils`` does.

GPUs are device ids (the strings ``CUDA_VISIBLE_DEVICES`` takes).  Declared ones win over
detection: ``yrdask.worker.gpus`` (a count or a list of ids; the embedded cluster sets it
from ``ray.init(num_gpus=)`` / ``Config(num_gpus=)``), then a ``GPU`` entry in the worker's
``--resources``.  Otherwise NVIDIA GPUs are detected through NVML (the optional
``nvidia-ml-py`` package) or else ``nvidia-smi``.  An existing ``CUDA_VISIBLE_DEVICES``
restricts them either way, as CUDA itself would.

Ascend NPUs follow the same rules with their own names: ``yrdask.worker.npus``, an ``NPU``
entry of ``--resources``, else detection (AscendCL's ``acl`` module if it imports, else the
``/dev/davinci<N>`` device files), restricted by ``ASCEND_RT_VISIBLE_DEVICES``.  Their ids
travel as ``NPU:<id>`` (the ledger keeps both kinds in one table of devices), and work that
holds them sees ``ASCEND_RT_VISIBLE_DEVICES=<ids>``, as Ray sets it.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from typing import Any

from yrdask.worker.threads import with_cpus

#: Environment variable naming the node a worker process belongs to (wins over the config).
NODE_ENV = "YRDASK_NODE_ID"
SMI_TIMEOUT_S = 10.0


def node_id(address: str) -> str:
    """The node of a worker process at ``address``: ``YRDASK_NODE_ID``, else the config key
    ``yrdask.worker.node``, else the address's host."""
    import dask

    named = os.environ.get(NODE_ENV) or dask.config.get("yrdask.worker.node", None)
    if named:
        return str(named)
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host.strip("[]")


#: What restricts, and then names, the NPUs a process sees (Ray sets the same one).
NPU_VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
#: The prefix of an NPU's id in the ledger and in lease ids (``"NPU:0"``).
NPU_PREFIX = "NPU:"


def visible_devices(env: str = "CUDA_VISIBLE_DEVICES") -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (or ``env``): None if it is not set, ``[]``
    if empty."""
    value = os.environ.get(env)
    if value is None:
        return None
    out = []
    for item in value.split(","):
        item = item.strip()
        if not item or item == "-1":
            break  # CUDA stops at the first invalid entry
        out.append(item)
    return out


def accelerator_type(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"H200"``, ``"Tesla V100-SXM2-16GB"`` -> ``"V100"``: the model
    as Ray names it in ``accelerator_type:<model>``."""
    words = name.split()
    word = words[1] if len(words) > 1 else (words[0] if words else "")
    m = re.match(r"[A-Za-z0-9]+", word)
    return m.group(0).upper() if m else ""


def detect_gpus() -> tuple[list[str], str]:
    """The NVIDIA GPUs this process may use and their model: ``(["0", "1"], "H200")``.

    NVML first (``pip install yrdask[gpu]`` brings ``nvidia-ml-py``), else ``nvidia-smi``;
    ``([], "")`` when neither finds any.  ``CUDA_VISIBLE_DEVICES`` restricts the result.
    """
    names = _nvml_names()
    if names is None:
        names = _smi_names()
    ids = [str(i) for i in range(len(names))]
    visible = visible_devices()
    if visible is not None:
        ids = [v for v in visible if v in ids or not v.isdigit()]
    model = ""
    if ids:
        first = ids[0]
        model = accelerator_type(names[int(first)] if first.isdigit() else names[0])
    return ids, model


def _nvml_names() -> list[str] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                out.append(name.decode() if isinstance(name, bytes) else str(name))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no device: no GPUs
        return []


def _smi_names() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def detect_npus() -> tuple[list[str], str]:
    """The Ascend NPUs this process may use and their model: ``(["0", "1"], "Ascend910B")``.

    AscendCL (``acl``, part of the CANN toolkit) if it imports, else the ``/dev/davinci<N>``
    device files (Ray looks at the same two); ``([], "")`` when there are none.
    ``ASCEND_RT_VISIBLE_DEVICES`` restricts the result.
    """
    ids: list[str] = []
    model = ""
    try:
        import acl  # type: ignore[import-not-found]

        count, ret = acl.rt.get_device_count()
        if ret == 0:
            ids = [str(i) for i in range(count)]
            model = str(acl.get_soc_name() or "")
    except Exception:  # noqa: BLE001 - no CANN toolkit, no driver: look for device files
        found = (re.fullmatch(r"/dev/davinci(\d+)", f) for f in glob.glob("/dev/davinci*"))
        ids = sorted((m.group(1) for m in found if m), key=int)
    visible = visible_devices(NPU_VISIBLE_ENV)
    if visible is not None:
        ids = [v for v in visible if v in ids]
    return ids, model if ids else ""


def declared_ids(declared: Any, env: str = "CUDA_VISIBLE_DEVICES") -> list[str]:
    """Device ids from a declaration: a count (the first ``n`` of ``CUDA_VISIBLE_DEVICES``,
    or ``env``, else ``0..n-1``), a list of ids, or a ``"0,1"`` string."""
    if isinstance(declared, str):
        return [x.strip() for x in declared.split(",") if x.strip()]
    if isinstance(declared, (list, tuple)):
        return [str(x) for x in declared]
    n = int(float(declared))
    visible = visible_devices(env)
    if visible is not None and len(visible) >= n:
        return visible[:n]
    return [str(i) for i in range(n)]


def gpu_offer(resources: dict[str, float]) -> tuple[list[str], str]:
    """The GPU ids and model a worker process offers: ``yrdask.worker.gpus`` if set, else a
    ``GPU`` entry of its Dask ``--resources``, else what :func:`detect_gpus` finds."""
    import dask

    declared = dask.config.get("yrdask.worker.gpus", None)
    model = str(dask.config.get("yrdask.worker.accelerator-type", None) or "")
    if declared is not None:
        return declared_ids(declared), model
    if "GPU" in resources:
        return declared_ids(resources["GPU"]), model
    ids, found = detect_gpus()
    return ids, model or found


def npu_offer(resources: dict[str, float]) -> tuple[list[str], str]:
    """The NPU ids (as ``NPU:<id>``) and model a worker process offers:
    ``yrdask.worker.npus`` if set, else an ``NPU`` entry of its Dask ``--resources``, else
    what :func:`detect_npus` finds."""
    import dask

    declared = dask.config.get("yrdask.worker.npus", None)
    model = str(dask.config.get("yrdask.worker.npu-type", None) or "")
    if declared is not None:
        ids = declared_ids(declared, NPU_VISIBLE_ENV)
    elif "NPU" in resources:
        ids = declared_ids(resources["NPU"], NPU_VISIBLE_ENV)
    else:
        ids, found = detect_npus()
        model = model or found
    return [f"{NPU_PREFIX}{i}" for i in ids], model


#: Set in the process of work that holds GPUs: the ids it holds (``ray.get_gpu_ids()``).
GPU_IDS_ENV = "YRDASK_GPU_IDS"
#: The same for NPUs (``get_accelerator_ids()["NPU"]``).
NPU_IDS_ENV = "YRDASK_NPU_IDS"


def device_isolation(isolation: dict | None, devices: str, cpus: float) -> dict:
    """The isolation spec (``{"env", "cwd"}``) of work that holds the devices ``devices``
    (``"0,1"``, ``"NPU:0"``, ...): its own process whose ``CUDA_VISIBLE_DEVICES`` and
    ``ASCEND_RT_VISIBLE_DEVICES`` name exactly the GPUs and NPUs it holds, with
    ``OMP_NUM_THREADS`` and friends set to its whole CPUs unless its own ``env_vars`` set any
    of them (docs/nodes.md)."""
    ids = [d for d in devices.split(",") if d]
    gpus = ",".join(d for d in ids if not d.startswith(NPU_PREFIX))
    npus = ",".join(d[len(NPU_PREFIX):] for d in ids if d.startswith(NPU_PREFIX))
    isolation = with_cpus(isolation, cpus)
    env = isolation["env"]
    if gpus:
        env.update({"CUDA_VISIBLE_DEVICES": gpus, GPU_IDS_ENV: gpus})
    if npus:
        env.update({NPU_VISIBLE_ENV: npus, NPU_IDS_ENV: npus})
    return isolation
