"""``yr.get_node_id``, ``yr.get_node_ip_address`` and ``yr.resources``: what the cluster is made of.

A *node* is a machine (SPEC §6, docs/nodes.md): the resources of all yr worker processes on
one host form one pool.  Its **node id is the host's IP** as the cluster reaches it
(``10.0.0.5``; ``127.0.0.1`` for the embedded cluster), unless its worker processes are given
another with ``YRDASK_NODE_ID`` / the Dask config key ``yrdask.worker.node`` (several "nodes"
on one machine, as Ray's ``cluster_utils`` makes).  Every process sees the same string for
the same node, and a worker process that its nanny restarts joins the same node again.

Inside a task or an instance method the calls describe the node running it.  In a driver,
which is not a node (it offers no resources), ``get_node_id`` returns the driver's own endpoint,
the address of its owner server, and ``get_node_ip_address`` the IP the cluster reaches the
driver on.  Before ``yr.init`` all three raise ``YRRuntimeError`` ("system not initialized"),
as in openYuanrong.
"""

from __future__ import annotations

from yrdask import protocol as P
from yrdask.runtime.context import current_runtime

#: The node status ``yr.resources`` reports for a live worker (openYuanrong: 0 = normal).
NODE_OK = 0


def get_node_id() -> str:
    """The id of the node (host) this code runs on.

    In a driver: the driver's own endpoint (its owner server), which is no node's id.
    """
    rt = current_runtime()
    agent = getattr(rt, "agent", None)
    return getattr(agent, "node_id", None) or rt.address


def get_node_ip_address() -> str:
    """The IP address of the node this code runs on (in a driver: the driver's IP)."""
    from distributed.comm import get_address_host

    rt = current_runtime()
    # an instance's own process knows its worker's host, with or without a runtime started
    return getattr(rt, "node_ip", None) or get_address_host(rt.address)


def resources() -> list[dict]:
    """Every node's resources, as openYuanrong reports them, sorted by id::

        [{"id": "10.0.0.5", "status": 0,
          "capacity": {"CPU": 2000.0, "Memory": 7890.0, "host_a": 1.0},
          "allocatable": {"CPU": 1500.0, "Memory": 7390.0, "host_a": 1.0}}, ...]

    ``capacity`` is what the node's worker processes offer together (CPU in millicores,
    Memory in MB, ``GPU`` devices, their ``--resources`` tags; detected GPUs of a model also
    as ``GPU/<model>/count``); ``allocatable`` is what running tasks and live instances leave
    free.
    A task blocked in ``yr.get`` lends its CPU back, so that CPU counts as free meanwhile.
    """
    return [{k: v for k, v in n.items() if k in ("id", "status", "capacity", "allocatable")}
            for n in nodes_info()]


def nodes_info() -> list[dict]:
    """:func:`resources`, with each node's ``host`` and worker ``processes`` besides."""
    info = current_runtime().scheduler_call(P.CLUSTER_INFO, instances=False)
    out = []
    for address, w in sorted(info["workers"].items()):
        node = _node(address, w["capacity"], w["held"])
        node["host"] = w.get("host") or address
        node["processes"] = list(w.get("processes") or ())
        node["labels"] = dict(w.get("labels") or {})
        out.append(node)
    return out


def _node(address: str, capacity: dict, held: dict) -> dict:
    cap = {r: float(a) for r, a in capacity.items()}
    free = {r: max(0.0, a - float(held.get(r, 0.0))) for r, a in cap.items()}
    for r in list(cap):  # yr names a detected model's GPUs GPU/<model>/count (docs/nodes.md)
        if r.startswith("accelerator_type:") and "GPU" in cap:
            model = r.split(":", 1)[1]
            cap[f"GPU/{model}/count"], free[f"GPU/{model}/count"] = cap["GPU"], free["GPU"]
    return {"id": address, "status": NODE_OK, "capacity": cap, "allocatable": free}
