"""How many worker processes the embedded cluster starts, and what each offers
(yrdask/deploy/embedded.py; SPEC §6, docs/nodes.md)."""

from __future__ import annotations

import dask.system

from yrdask.deploy.embedded import worker_layout


def test_one_process_per_usable_core_at_most_num_cpus(monkeypatch):
    monkeypatch.setattr(dask.system, "CPU_COUNT", 16)  # affinity and cgroup quota applied
    assert worker_layout(None) == (16, [1000] * 16)
    assert worker_layout(2) == (2, [1000, 1000])
    monkeypatch.setattr(dask.system, "CPU_COUNT", 2)
    assert worker_layout(5) == (2, [2500, 2500])  # num_cpus beyond the cores: larger offers
    assert worker_layout(1) == (1, [1000])
