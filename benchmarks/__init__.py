"""yrdask benchmarks: the same figures measured on yrdask, plain Dask and Ray.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--help`` lists the options.
Every measurement runs in a fresh subprocess (:mod:`benchmarks._one`); the parent
(:mod:`benchmarks.run`) takes medians over runs, prints a table and writes a JSON file.

Layout, for adding figures:

* :mod:`benchmarks.figures` -- the figure catalogue (name, group, unit, parameters, target);
* :mod:`benchmarks.sys_yrdask`, :mod:`benchmarks.sys_dask`, :mod:`benchmarks.sys_ray` -- one
  :class:`benchmarks.registry.System` subclass per system: its cluster and its primitives;
* :mod:`benchmarks.registry` -- :class:`~benchmarks.registry.System`: the figure bodies,
  written once against the primitives (submit, gather, put, fetch, read_in_task, nested,
  nested_burst, create, call) that each system module supplies;
* :mod:`benchmarks.workloads` -- the code that runs on the workers (trivial tasks, the nested
  bodies, the counter and training-worker classes) as plain Python, which each system module
  wraps in its own API;
* :mod:`benchmarks.local_first` -- yrdask's nested figures with the
  ``yrdask.scheduling.local-first`` config key on and off.

A new figure is one ``Figure(...)`` entry in ``figures.py`` plus one ``@measures`` method on
:class:`~benchmarks.registry.System`.  A system that cannot do it lists it in ``unsupported``
with the reason (shown as "n/a").
"""
