"""yrdask benchmarks: the same figures measured on yrdask, plain Dask and Ray.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--help`` lists the options.
Every measurement runs in a fresh subprocess (:mod:`benchmarks._one`); the parent
(:mod:`benchmarks.run`) takes medians over runs, prints a table and writes a JSON file.

Layout, for adding figures:

* :mod:`benchmarks.figures` -- the figure catalogue (name, group, unit, parameters);
* :mod:`benchmarks.sys_yrdask`, :mod:`benchmarks.sys_dask`, :mod:`benchmarks.sys_ray` -- one
  :class:`benchmarks.registry.System` per system, whose methods decorated with
  ``@measures("figure_name")`` implement the figures on that system.

A new figure is one ``Figure(...)`` entry in ``figures.py`` plus one ``@measures`` method per
system (a system without one reports ``null`` for it).
"""
