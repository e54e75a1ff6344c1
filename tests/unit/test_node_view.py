"""yr.resources()'s view of one node (api/nodes.py ``_node``), without a cluster."""

from yrdask.api.nodes import _node


def test_a_detected_gpu_model_also_shows_as_yr_gpu_model_count():
    node = _node("n1", {"CPU": 16000, "GPU": 2, "accelerator_type:H200": 1},
                 {"CPU": 1000, "GPU": 1})
    assert node["capacity"]["GPU/H200/count"] == 2.0
    assert node["allocatable"]["GPU/H200/count"] == 1.0
    assert node["allocatable"]["CPU"] == 15000.0


def test_declared_gpus_without_a_model_get_no_model_count():
    node = _node("n1", {"CPU": 2000, "GPU": 2}, {})
    assert not [r for r in node["capacity"] if r.startswith("GPU/")]
    assert node["capacity"]["GPU"] == 2.0 and node["allocatable"]["GPU"] == 2.0
