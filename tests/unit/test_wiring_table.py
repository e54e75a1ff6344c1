"""docs/state-machines.md's wiring table stays true: for each machine, the decisions class
production drives it through is the one the simulation drives, on an edge of its own, and
the simulation re-implements no handler that a decisions class provides."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from yrdask import protocol as P

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| machine | decisions class | production edge | simulated edge |"


def _rows() -> list[list[list[str]]]:
    """The table's rows, each a list of cells, each the dotted names in its backticks."""
    text = (ROOT / "docs" / "state-machines.md").read_text()
    lines = text[text.index(HEADER):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append([re.findall(r"`([\w.]+)`", c) for c in cells])
    return rows


def _resolve(dotted: str) -> tuple[Any, str, Any]:
    """(module, name, object) of ``package.module.Name``."""
    modname, _, name = dotted.rpartition(".")
    module = importlib.import_module(modname)
    return module, name, getattr(module, name)


def _source(module: Any) -> str:
    return Path(module.__file__).read_text()


ROWS = _rows()


def test_the_table_names_every_machine_the_worlds_drive() -> None:
    machines = {row[0][0].rsplit(".", 1)[1] for row in ROWS}
    assert {"LeaseQueue", "SubmitQueue", "LeaseGate", "GroupMachine", "Lifecycle",
            "CallOrder", "CallQueue"} <= machines
    for row in ROWS:
        assert len(row) == 4 and all(row), f"a cell without a class name: {row}"


@pytest.mark.parametrize("row", ROWS, ids=[r[0][0].rsplit(".", 1)[1] for r in ROWS])
def test_production_and_simulation_drive_the_same_decisions_class(row: list) -> None:
    (machine,), (decisions,), (prod_edge,), sim_edges = row
    mmod, mname, mcls = _resolve(machine)
    assert isinstance(mcls, type) and callable(getattr(mcls, "validate", None)), \
        f"{machine} is not a machine"
    dmod, dname, dcls = _resolve(decisions)
    assert mname in _source(dmod), f"{decisions}'s module never names its machine {mname}"
    pmod, pname, pcls = _resolve(prod_edge)
    psrc, dsrc = _source(pmod), _source(dmod)
    built = (f"{dname}({pname}(" in psrc  # the adapter builds the decisions on its edge
             or f"cls({pname}(" in dsrc  # a factory on the decisions class does
             or f"{dname}(self," in psrc)  # the edge builds it on itself (the router)
    assert built, f"{prod_edge} does not drive {decisions}"
    for sim_edge in sim_edges:
        smod, sname, _ = _resolve(sim_edge)
        assert f"{dname}({sname}(" in _source(smod), \
            f"the simulation does not drive {decisions} on {sim_edge}"


def _handled_by_decisions() -> dict[str, str]:
    """handler name -> the decisions class that provides it, for every protocol op."""
    out = {}
    for row in ROWS:
        _, dname, dcls = _resolve(row[1][0])
        for cls in P.MESSAGES.values():
            if callable(getattr(dcls, cls.handler, None)):
                out[cls.handler] = dname
    return out


def test_the_simulation_defines_no_handler_a_decisions_class_provides() -> None:
    handled = _handled_by_decisions()
    assert {"return_leases", "withdraw_lease_requests", "lease_blocked", "lease_unblocked",
            "revoke_leases"} <= set(handled)
    # the instance ops: the instance service's and the worker's instance side's own
    assert {"create_instance", "locate_instance", "kill_instance", "save_state",
            "handle_refs", "instance_state", "start_instance", "call_method"} <= set(handled)
    for path in sorted((ROOT / "tests" / "sim").glob("*.py")):
        if path.name.startswith("mutations"):  # (it patches production handlers on purpose)
            continue
        tree = ast.parse(path.read_text())
        edges = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                 and c.name.endswith("Edge") for f in c.body}  # (an edge sends them)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and id(node) not in edges:
                assert node.name not in handled, (
                    f"{path.name}:{node.lineno} defines {node.name}(), the handler "
                    f"{handled[node.name]} provides: dispatch the message to it instead")


def test_the_task_world_speaks_the_protocol_for_these_ops() -> None:
    """No private spelling (``"RETURN_LEASES"``, ``"GRANT"``) of an op a decisions class
    handles, nor of the scheduler's lease rpc and its answer, in the task or the instance
    world: they send ``protocol.py`` messages."""
    handled = set(_handled_by_decisions())
    ops = {op for op, cls in P.MESSAGES.items() if cls.handler in handled}
    ops |= {P.REQUEST_LEASE, P.WORKER_LOST, P.CLOSE_STREAM, P.CREATE_RESOURCE_GROUP,
            P.REMOVE_RESOURCE_GROUP}
    private = {op.removeprefix("yr_").upper() for op in ops} | {"GRANT", "REFUSE", "REFUSED"}
    for name in ("world.py", "calls.py"):
        tree = ast.parse((ROOT / "tests" / "sim" / name).read_text())
        strings = {n.value for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & private, (name, sorted(strings & private))


#: what the worlds' kernels carry that is no protocol message: a process's own steps (a loop
#: turn, an executor picking up or finishing a call, a ref argument ready, a batched flush),
#: a broken channel, and a handle pickled from one driver to another (user data)
KERNEL_STEPS = {"SOON", "INIT", "RUN", "FINISH", "EXIT", "DEPS", "CDEPS", "FLUSH", "LOST",
                "HANDLE"}


def test_every_message_between_processes_is_a_protocol_message() -> None:
    """The worlds send no private tuple for what crosses a process: a tuple on a link is
    one of the kernel's own steps (``KERNEL_STEPS``); every other message is built by a
    ``protocol.py`` class (or is an rpc's reply)."""
    for name in ("world.py", "calls.py"):
        tree = ast.parse((ROOT / "tests" / "sim" / name).read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "send" and len(node.args) == 4):
                continue
            msg = node.args[3]
            if isinstance(msg, ast.Tuple):
                head = msg.elts[0]
                assert isinstance(head, ast.Constant) and head.value in KERNEL_STEPS, \
                    f"{name}:{node.lineno} sends a private tuple {ast.unparse(msg)[:60]}"


def test_the_task_world_runs_the_runtimes_own_parts() -> None:
    """A process's answers on its call channels and its lost workers and channels are
    carried out by the runtime's own parts (``CallerAnswers``, ``PeerLiveness``), which the
    task world's runtime mixes in as ``Runtime`` does; tests/sim defines none of their
    methods (but on an edge, which implements a decisions class's protocol)."""
    from yrdask.runtime.answers import CallerAnswers
    from yrdask.runtime.peers import PeerLiveness
    from yrdask.runtime.runtime import Runtime
    from tests.sim.world import _SimRuntime

    for part in (CallerAnswers, PeerLiveness):
        assert issubclass(Runtime, part) and issubclass(_SimRuntime, part), part
    own = {name for part in (CallerAnswers, PeerLiveness) for name in vars(part)
           if callable(vars(part)[name]) and not name.startswith("__")}
    for path in sorted((ROOT / "tests" / "sim").glob("*.py")):
        if path.name.startswith("mutations"):
            continue
        tree = ast.parse(path.read_text())
        edges = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                 and c.name.endswith("Edge") for f in c.body}  # (an edge's own protocol)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and id(node) not in edges:
                assert node.name not in own, (
                    f"{path.name}:{node.lineno} defines {node.name}(), the runtime's own")


def test_a_departure_runs_through_the_same_decisions_everywhere() -> None:
    """A job's end and a worker's removal: the extension and both worlds run
    ``Departures`` (the order in which the services hear it), and nothing else feeds the
    services a departure."""
    from yrdask.scheduler import departures, extension
    from tests.sim import calls, world

    for module in (extension, world, calls):
        assert "Departures(" in _source(module), module.__name__
    for module in (extension, world, calls):
        src = _source(module)
        for call in (".owner_gone(", ".worker_left(", ".worker_lost(", ".on_owner_gone("):
            for line in src.splitlines():
                if call in line and "departures" not in line and "def " not in line:
                    assert "service" not in line and "leases" not in line \
                        and "instances" not in line and "groups" not in line, \
                        f"{module.__name__} feeds a departure past Departures: {line.strip()}"
    assert "P.WorkerLost(" in _source(departures)



def test_a_cancelled_method_call_runs_the_same_rules_everywhere() -> None:
    """Ray's cancel of a method call and its answer: ``InstanceRouter`` and the instance
    world both hand the cancel to ``CallRouter.cancel`` and take a cancelled call's answer
    from ``call_router.cancelled_answer``; neither sends a ``CANCEL_TASK`` of its own
    after a call (their edges' ``send_cancel`` sends the router's)."""
    from yrdask.runtime import instance_router
    from tests.sim import calls

    assert "self.decisions.cancel(" in _source(instance_router)
    assert 'do_unanswered(dname, "cancel", cid)' in _source(calls)
    for module in (instance_router, calls):
        src = _source(module)
        assert "cancelled_answer(" in src, module.__name__
        assert "P.CancelTask(" not in src, module.__name__
    assert "Task: {cid} was cancelled" not in _source(calls)  # no settlement of its own


def test_the_lease_rpc_is_decided_by_the_lease_service_everywhere() -> None:
    """``REQUEST_LEASE``: the extension's rpc and both worlds hand it to
    ``LeaseService.request_lease`` (refused at once or opened); none of them builds the
    request itself."""
    from yrdask.scheduler import extension
    from tests.sim import calls, world

    for module in (extension, world, calls):
        src = _source(module)
        assert "lease_service.request_lease(" in src or ".request_lease(answer" in src, \
            module.__name__
        assert ".lease_request(" not in src, module.__name__


def test_the_instance_worlds_workers_run_the_agents_own_stop_and_cancel() -> None:
    """``STOP_INSTANCE`` and ``CANCEL_TASK`` at a worker of the instance world are the worker
    agent's own handlers (``WorkerAgent.stop_instance``, ``TaskRunner.cancel_task``) over
    the world's instance side, dispatched from a table built by ``P.handlers``."""
    from yrdask.worker.agent import WorkerAgent
    from yrdask.worker.instance_side import InstanceSide
    from tests.sim.calls import Proc

    w = Proc("w0", "worker")
    w.hosting(InstanceSide(None))
    assert w.agent[P.STOP_INSTANCE].__func__ is WorkerAgent.stop_instance
    assert w.agent[P.CANCEL_TASK].__func__ is WorkerAgent.cancel_task
