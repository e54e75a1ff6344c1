"""What a process does with the answers on its call channels (:data:`P.CHANNEL_TO_CALLER`).

:class:`CallerAnswers` is one part of :class:`~yrdask.runtime.runtime.Runtime` (which mixes
it in, as it does :class:`~yrdask.runtime.peers.PeerLiveness`): a ``TASK_DONE`` goes to the
instance router (a method call) or the submitter (a task), a ``GENERATOR_ITEM`` to its
stream, a ``CALL_RETRIED`` (a call runs again after an exception) to the router.  The simulation's runtime (``tests/sim/world.py``) mixes in the same class, so the
seeded worlds route answers by this very code.
"""

from __future__ import annotations

from typing import Any

from yrdask import protocol as P
from yrdask.runtime.generators import on_generator_item


class CallerAnswers:
    """Routes the messages of the call channels (part of the runtime; the attributes below
    are its)."""

    objects: Any  # the object table (borrowing reports)
    submitter: Any  # tasks (runtime/submitter.py)
    router: Any  # method calls (runtime/instance_router.py)

    def on_channel_message(self, msg: dict) -> None:
        """A message from a worker on a call channel (:data:`P.CHANNEL_TO_CALLER`): the
        :class:`P.TaskDone` of a method call goes to the router, of a task to the submitter."""
        if msg["op"] == P.TASK_DONE:  # the one op of P.CHANNEL_TO_CALLER
            # A plain answer (P.PLAIN_TASK_DONE: results, maybe took) is the hot path, read
            # from the dict: no message object.  A task's needs no router lookup (call and
            # task ids never collide: both come from new_id).
            if P.PLAIN_TASK_DONE.issuperset(msg):
                task_id = msg["task_id"]
                if task_id in self.submitter.tasks:
                    self.submitter.on_task_ok(task_id, msg.get("results") or [],
                                              msg.get("took"))
                    return
                if self.router.on_result(task_id, msg.get("results")):
                    return
            done = P.TaskDone.from_msg(msg)
            if done.refs is not None:  # before the call lets go of its argument refs
                self.objects.on_done_refs(done.refs)
            if not self.router.on_done(done):
                self.submitter.on_task_done(done)
        elif msg["op"] == P.GENERATOR_ITEM:
            on_generator_item(self, msg)
        elif msg["op"] == P.CALL_RETRIED:
            self.router.retried(msg["task_id"])
