"""What a worker process offers of its accelerators, and what work holding them sees
(yrdask/worker/devices.py; docs/nodes.md).  Pure functions: no cluster."""

from __future__ import annotations

import dask
import pytest

from yrdask.options import InvokeOptions, gpu_resource
from yrdask.worker import devices as D


def test_declared_npus_come_from_the_config_then_from_resources(monkeypatch):
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    with dask.config.set({"yrdask.worker.npus": 2, "yrdask.worker.npu-type": "Ascend910B"}):
        assert D.npu_offer({}) == (["NPU:0", "NPU:1"], "Ascend910B")
    with dask.config.set({"yrdask.worker.npus": None}):
        assert D.npu_offer({"NPU": 3.0})[0] == ["NPU:0", "NPU:1", "NPU:2"]
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,6")  # a count takes the visible ones
    with dask.config.set({"yrdask.worker.npus": 1}):
        assert D.npu_offer({})[0] == ["NPU:4"]


def test_detected_npus_are_device_files_restricted_by_ascend_rt_visible_devices(monkeypatch):
    files = ["/dev/davinci1", "/dev/davinci0", "/dev/davinci_manager", "/dev/davinci10"]
    monkeypatch.setattr(D.glob, "glob", lambda pattern: files)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert D.detect_npus() == (["0", "1", "10"], "")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1,7")
    assert D.detect_npus() == (["1"], "")
    monkeypatch.setattr(D.glob, "glob", lambda pattern: [])
    assert D.detect_npus() == ([], "")


def test_work_holding_gpus_and_npus_sees_exactly_them():
    env = D.device_isolation(None, "1,NPU:0,NPU:3", 2.0)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == env["YRDASK_GPU_IDS"] == "1"
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == env["YRDASK_NPU_IDS"] == "0,3"
    assert env["OMP_NUM_THREADS"] == "2"
    only_npu = D.device_isolation({"env": {"A": "b"}, "cwd": ""}, "NPU:1", 1.0)["env"]
    assert "CUDA_VISIBLE_DEVICES" not in only_npu and only_npu["A"] == "b"
    assert only_npu["ASCEND_RT_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("key, shape", [
    ("NPU/.+/count", {"NPU": 2.0}),
    ("NPU/Ascend910B/count", {"NPU": 2.0, "accelerator_type:Ascend910B": 0.001}),
    ("GPU/.+/count", {"GPU": 2.0}),
    ("NPU/.+/HBM", {"NPU/.+/HBM": 2.0}),
])
def test_yr_accelerator_keys_map_to_the_ledgers(key, shape):
    assert gpu_resource(key, 2.0) == shape
    opts = InvokeOptions(custom_resources={key: 2})
    assert {k: v for k, v in opts.resource_shape().items() if k not in ("CPU", "Memory")} \
        == shape


def test_declared_npus_are_a_whole_number():
    import yrdask as yr
    from yrdask.errors import YRValueError

    with pytest.raises(YRValueError, match="whole number of NPUs"):
        yr.Config(resources={"NPU": 1.5}).validate()
    assert yr.Config(resources={"NPU": 2}).validate().resources == {"NPU": 2}
