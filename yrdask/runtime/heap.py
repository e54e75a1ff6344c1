"""The GC's permanent generation for what a yrdask process holds once it has started.

A driver after ``yr.init`` tracks about 75 000 objects, nearly all of them the imported
libraries (Dask, Tornado, numpy, yrdask).  A burst of pending tasks or calls adds tens of
thousands of young objects (refs, entries), which sets off full collections, and each full
collection walked all of them again: 6-8 µs of GC per task or call in the driver.
``gc.freeze()`` moves the objects alive at start-up into the permanent generation, which
collections skip (docs/changelog/performance-history.md, "2026-11-27: The driver's garbage collector").
"""

from __future__ import annotations

import gc

from yrdask.errors import YRValueError

KEY = "yrdask.process.gc-freeze"


def freeze_enabled() -> bool:
    """``yrdask.process.gc-freeze``, checked: a bool."""
    import dask  # not at import: ``import yrdask`` imports no Dask (yr.init does)

    value = dask.config.get(KEY, True)
    if not isinstance(value, bool):
        raise YRValueError(f"{KEY} is {value!r}; set it to true or false (a YAML bool, or "
                           "DASK_YRDASK__PROCESS__GC_FREEZE=False in the environment)")
    return value


def freeze() -> bool:
    """Move the objects alive now to the permanent generation (callers check the key);
    False, and nothing done, when the program froze objects itself: it manages its
    collector, and ``unfreeze`` at ``yr.finalize`` would undo its freeze too."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def unfreeze() -> None:
    """Give the frozen objects back to the collector (``yr.finalize``): whatever of them
    became garbage since is collected again, so init/finalize cycles leak nothing."""
    gc.unfreeze()
