"""The checker's power: every rule-breaking change of ``mutations.py`` is caught.

Each mutation is applied in this process (``monkeypatch``), with the mutated machine's own
``validate()`` off, and the simulation must fail within the mutation's seed budget; the
failure must be the simulation's (a ``SimFailure``), found by its independent checks.
``python -m tests.sim.mutations`` prints the seed that catches each (under
``PYTHONHASHSEED=0``; the instance world iterates sets of ids, so under another hash seed
the catching seed may differ: the budgets leave room for that).
"""
from __future__ import annotations

import os

import pytest

from tests.sim import mutations as MU
from tests.sim import mutations_fresh as FR

pytestmark = pytest.mark.timeout(120)


def test_at_least_ten_mutations_across_machines():
    assert len(MU.MUTATIONS) >= 10
    targets = {cls for m in MU.MUTATIONS for _mod, cls in m.validate_off}
    assert {"LeaseQueue", "SubmitQueue", "LeaseGate", "CallOrder", "Lifecycle",
            "GroupMachine", "LendNotices"} <= targets
    names = {m.name for m in MU.MUTATIONS}
    assert {"ledger-fits-ever", "lost-worker-leases-kept"} <= names
    # the production adapters the simulation drives are mutated too
    assert {"adapter-serves-gone-requester", "submitter-retryable-as-final",
            "submitter-channel-lost-ignored", "task-side-keeps-bounced",
            "task-side-end-not-told"} <= names
    # resource groups: a removal that leaves leases in its bundles, a bundle over-committed
    assert {"group-removal-keeps-leases", "bundle-fit-ignores-use"} <= names
    # lending notices: a lasting wait never told (nested work hangs), a told one never ended
    assert {"block-never-told", "unblock-untold"} <= names
    # revokes: a kept lease's return and bound, firm revokes, revokes before their grant
    assert {"kept-lease-held-when-dry", "keep-unbounded", "firm-revoke-kept",
            "early-revoke-dropped"} <= names
    # results against the executing side, concurrency per lease, timers, progress
    assert {"died-call-succeeds", "gate-slot-extra", "timer-for-later",
            "group-never-retried", "release-grants-nothing"} <= names


def test_mutations_reach_the_production_adapters():
    """The adapters the worlds drive as production code are mutated too: the lease service,
    the group service, the instance router, the instance manager, hosting's call queue and
    call rules, and the worker agent's instance side."""
    names = {m.name for m in MU.MUTATIONS}
    assert {"departure-keeps-groups", "departure-skips-instances"} <= names  # departures.py
    assert {"adapter-serves-gone-requester", "group-for-gone-owner", "router-sends-reversed",
            "router-ignores-lost-channel", "manager-forgets-dead-worker",
            "manager-never-releases", "hosting-exceeds-concurrency",
            "hosting-before-init"} <= names
    # the worker agent's instance side and a hosted instance's call rules (instance_side.py)
    assert {"instance-side-drops-early-calls", "instance-side-starts-after-stop",
            "hosting-cancel-not-kept", "hosting-stop-keeps-calls",
            "hosting-init-error-ignored"} <= names
    # the caller's rules for a cancelled method call: its answer (call_router.py), and a
    # call cancelled before it left never goes (call_order.py)
    assert {"router-cancelled-whatever-answered", "order-cancel-unsent-still-goes"} <= names
    # process instances: a death while restarting, the budget, the crash-charging rule
    assert {"restarting-death-ignored", "restart-budget-reset", "crash-charged-to-none",
            "crash-charged-to-oldest"} <= names


def test_mutations_reach_generators_and_borrowing():
    """Generators (the stream's machine and adapter) and ref arguments (the submitter's hold
    on them, the object table, the reference counter) are mutated too."""
    names = {m.name for m in MU.MUTATIONS}
    assert {"stream-rerun-restarts", "stream-keeps-duplicates", "stream-error-swallowed",
            "stream-end-kept-open"} <= names
    assert {"task-args-let-go-when-queued", "borrowers-not-recorded", "contains-ignored",
            "refs-death-ignored", "refs-never-freed"} <= names


def test_fresh_set_spans_the_blind_spots():
    """The fresh set (``mutations_fresh.py``, written from the production code alone) is
    twelve mutations, none of them the authors' own, in the machines and in the wiring
    around them, with every blind-spot kind among them."""
    assert len(FR.FRESH) == 12
    names = {m.name for m in FR.FRESH}
    assert len(names) == 12 and not names & {m.name for m in MU.MUTATIONS}
    kinds = " ".join(m.what for m in FR.FRESH)
    for kind in ("(progress", "(results", "(capacity", "(timer", "(race", "(safety"):
        assert kind in kinds, kind
    targets = {m.what.split(" ", 1)[0].split(".", 1)[0] for m in FR.FRESH}
    assert {"leases", "resources", "groups", "lifecycle", "lease_gate", "call_order",
            "submit_queue"} <= targets
    assert {"call_router", "instance_side"} <= targets  # the wiring around the machines
    assert {m.world for m in FR.FRESH} == {"tasks", "calls"}


@pytest.mark.parametrize("mutation", MU.MUTATIONS + FR.FRESH, ids=lambda m: m.name)
def test_mutation_is_caught(mutation, monkeypatch):
    MU.apply(mutation, monkeypatch.setattr)
    seed, line = MU.first_catch(mutation, range(mutation.budget))
    assert seed is not None, (
        f"the simulation missed {mutation.name} ({mutation.what}) in {mutation.budget} seeds "
        f"(PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED')})")
    # caught by a check, not by the mutation's own crash (a patch whose signature no longer
    # matches the method it replaces raises, and would count as caught while proving nothing)
    assert not line.startswith("exception at step"), (
        f"{mutation.name} was caught only by an exception, not a check: {line}")
