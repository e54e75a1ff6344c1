"""Deterministic simulation of yr's state machines.

The real ``SubmitQueue``, ``LeaseQueue`` and ``LeaseGate`` run in a simulated cluster whose
network, clock and faults are driven by ``random.Random(seed)``: see ``world.py``.  A seed
replays exactly (``python -m tests.sim --seed N`` prints its story); ``test_simulation.py``
runs thousands of seeds in CI.  ``calls.py`` is the instance world: the real ``CallOrder``
in every process, ``Lifecycle`` and ``LeaseQueue`` in the scheduler (``python -m tests.sim
--calls --seed N``).
"""
