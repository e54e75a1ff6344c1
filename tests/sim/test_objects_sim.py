"""The object world (``tests/sim/objects.py``): borrowers counted across processes, with
refs in flight, duplicate and reordered messages and dying processes, checked after every
step (nothing freed while referenced) and at quiescence (everything freed, once).

``YRDASK_OBJECT_SEEDS`` sets how many seeds run here (default 2000, about 10 s);
``python -m tests.sim --objects --seeds 0:5000`` runs more.
"""

from __future__ import annotations

import os

import pytest

from tests.sim.objects import ObjectWorld, run_object_seed
from tests.sim.world import SimFailure
from yrdask.runtime import refcount as R

SEEDS = int(os.environ.get("YRDASK_OBJECT_SEEDS", "2000"))

pytestmark = pytest.mark.timeout(300)


def test_object_seeds_free_everything_and_nothing_early() -> None:
    for seed in range(SEEDS):
        try:
            run_object_seed(seed)
        except SimFailure as e:
            pytest.fail(f"{e.message}\nreplay: python -m tests.sim --objects --seed {seed}\n"
                        f"{e.world.story(60)}")


def test_object_seed_replays_identically() -> None:
    assert ObjectWorld(7).run().log == ObjectWorld(7).run().log


def _first_failure(limit: int = 400) -> str | None:
    for seed in range(limit):
        try:
            run_object_seed(seed)
        except SimFailure as e:
            return e.message
    return None


def test_harness_catches_a_poll_answered_while_a_result_still_holds_the_ref(monkeypatch):
    """A borrower that ignores ``via`` answers before the result holding the ref is gone."""
    orig = R.RefCounter._wait
    monkeypatch.setattr(R.RefCounter, "_wait", lambda self, ev, out: orig(
        self, R.WaitReceived(ev.stimulus_id, ev.object_id, ev.owner, ev.seq), out))
    message = _first_failure()
    assert message is not None and "freed" in message


def test_harness_catches_a_borrower_of_a_borrower_never_registered(monkeypatch):
    orig = R.RefCounter._lent

    def forgetful(self, ev, out):
        rec = self.refs.get(ev.object_id)
        if rec is None or rec.owner is None:
            orig(self, ev, out)

    monkeypatch.setattr(R.RefCounter, "_lent", forgetful)
    message = _first_failure()
    assert message is not None and "freed" in message


def test_harness_catches_a_ref_returned_to_its_own_process_freed_with_the_frame(monkeypatch):
    """A call to this very process (a task calling an instance on its own worker) returns a
    ref nested in its result: ignoring that lend frees the ref before the result is read."""
    orig = R.RefCounter._lent

    def ignore_self(self, ev, out):
        if ev.borrower != self.address:
            orig(self, ev, out)

    monkeypatch.setattr(R.RefCounter, "_lent", ignore_self)
    message = _first_failure()
    assert message is not None and "freed" in message
