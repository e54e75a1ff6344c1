"""The import alias that lets ``import ray`` mean ``import yrdask.ray`` in one process.

``python -m yrdask.ray script.py`` installs it in the driver; work submitted from there
installs it in the worker processes that run it (task bodies and actor classes carry the
flag), and so do the processes ``multiprocessing`` spawns from a process that has it (a
``ProcessPoolExecutor`` under the "spawn" start method imports the program's ``__main__``
again, with its ``import ray``).  Nothing named ``ray`` is installed anywhere: the finder
maps ``ray`` and ``ray.X`` to the very module objects ``yrdask.ray`` and ``yrdask.ray.X``,
so pickles of their functions and classes still name ``yrdask.ray``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_PREFIX = "ray"
_TARGET = "yrdask.ray"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # Already executed under its own name; importlib set ``__spec__`` to the alias's.
        module.__spec__ = self.own_spec


class RayAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``ray`` and ``ray.*`` to ``yrdask.ray`` and ``yrdask.ray.*``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _PREFIX and not fullname.startswith(_PREFIX + "."):
            return None
        real = _TARGET + fullname[len(_PREFIX):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def installed() -> bool:
    return any(isinstance(f, RayAliasFinder) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if installed():
        return
    if "ray" in sys.modules and not sys.modules["ray"].__name__.startswith(_TARGET):
        raise ImportError("the real 'ray' package is already imported in this process; "
                          "yrdask.ray cannot stand in for it")
    sys.meta_path.insert(0, RayAliasFinder())
    _spawned_children_install()


_SPAWN_PREFIX = "from yrdask.ray._alias import install; install(); "


def _spawned_children_install() -> None:
    """A process ``multiprocessing`` spawns (``python -c "...spawn_main(...)"``) installs
    the alias first: its command line is prefixed with :func:`install`."""
    import multiprocessing.spawn as spawn

    original = spawn.get_command_line
    if getattr(original, "_yrdask", False):
        return

    def get_command_line(**kwds: Any) -> list:
        line = original(**kwds)
        if "-c" in line[:-1]:
            at = line.index("-c") + 1
            line[at] = _SPAWN_PREFIX + line[at]
        return line

    get_command_line._yrdask = True  # type: ignore[attr-defined]
    spawn.get_command_line = get_command_line


def prepare_imports(alias: bool, code_paths: tuple = ()) -> None:
    """On a worker, before a job's task or actor class is unpickled: the alias (``alias``:
    its driver runs under ``python -m yrdask.ray``) and the job's
    ``JobConfig(code_search_path=...)`` directories at the end of ``sys.path`` (once each;
    the process serves other jobs too, whose own modules keep precedence)."""
    if alias:
        install()
    for path in code_paths:
        if path not in sys.path:
            sys.path.append(path)
