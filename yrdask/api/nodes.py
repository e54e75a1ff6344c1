"""``yr.get_node_id``, ``yr.get_node_ip_address`` and ``yr.resources``: what the cluster is made of.

A *node* is one Dask worker process: it is the unit that offers resources (SPEC §6), so it is
the unit these calls describe.  Its **node id is the worker's Dask address**
(``tcp://10.0.0.5:40123``).  The address is unique in the cluster, every process sees the same
string for the same worker (the scheduler, the driver, the worker itself), it is what Dask
tools take (``Client.run(workers=[...])``, the dashboard), and it carries the node's IP.  It
lasts as long as the worker process: a worker that its nanny restarts comes back on a new port,
as a new node, like a restarted raylet in Ray.

Inside a task or an instance method the calls describe the worker running it.  In a driver,
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
    """The id of the node this code runs on: the Dask address of its worker process.

    In a driver: the driver's own endpoint (its owner server), which is no worker's id.
    """
    return current_runtime().address


def get_node_ip_address() -> str:
    """The IP address of the node this code runs on (in a driver: the driver's IP)."""
    from distributed.comm import get_address_host

    return get_address_host(current_runtime().address)


def resources() -> list[dict]:
    """Every node's resources, as openYuanrong reports them, sorted by id::

        [{"id": "tcp://10.0.0.5:40123", "status": 0,
          "capacity": {"CPU": 2000.0, "Memory": 7890.0, "host_a": 1.0},
          "allocatable": {"CPU": 1500.0, "Memory": 7390.0, "host_a": 1.0}}, ...]

    ``capacity`` is what the worker process offers (CPU in millicores, Memory in MB, its
    ``--resources`` tags); ``allocatable`` is what running tasks and live instances leave free.
    A task blocked in ``yr.get`` lends its CPU back, so that CPU counts as free meanwhile.
    """
    info = current_runtime().scheduler_call(P.CLUSTER_INFO, instances=False)
    return [_node(address, w["capacity"], w["held"])
            for address, w in sorted(info["workers"].items())]


def _node(address: str, capacity: dict, held: dict) -> dict:
    return {
        "id": address,
        "status": NODE_OK,
        "capacity": {r: float(a) for r, a in capacity.items()},
        "allocatable": {r: max(0.0, float(a) - float(held.get(r, 0.0)))
                        for r, a in capacity.items()},
    }
