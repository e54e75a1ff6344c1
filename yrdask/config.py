"""yrdask's Dask configuration keys (``yrdask.*``), with defaults from ``yrdask.yaml``.

Read with ``dask.config.get("yrdask.scheduling.local-first")``; set like any Dask key (YAML
in ``~/.config/dask``, ``DASK_YRDASK__...`` environment variables, ``dask.config.set``).
docs/scheduling.md describes each key.
"""

from __future__ import annotations

import os

import dask
import yaml

_FILE = os.path.join(os.path.dirname(__file__), "yrdask.yaml")

with open(_FILE) as f:
    _DEFAULTS = yaml.safe_load(f)

dask.config.update_defaults(_DEFAULTS)
