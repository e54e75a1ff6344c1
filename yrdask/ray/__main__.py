"""``python -m yrdask.ray script.py [args...]``: run a Ray program unchanged on yrdask.

Also ``python -m yrdask.ray -m module [args...]`` and ``python -m yrdask.ray -c CODE
[args...]``, as ``python`` takes them.  Installs the ``ray`` import alias (``import ray`` /
``from ray.util import ActorPool`` give yrdask.ray's modules) and runs the program as
``__main__``, with ``sys.argv`` and ``sys.path[0]`` as ``python`` would set them.  Nothing
named ``ray`` is installed in site-packages: the Python processes the program starts get
``yrdask/ray/_program_path`` (a ``ray`` package that hands over yrdask.ray) first on their
``PYTHONPATH``, so their ``import ray`` is yrdask.ray as well.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = ("usage: python -m yrdask.ray SCRIPT.py [ARGS...]\n"
         "       python -m yrdask.ray -m MODULE [ARGS...]\n"
         "       python -m yrdask.ray -c CODE [ARGS...]\n"
         "Runs a program that does `import ray` on yrdask (see docs/migrating-from-ray.md).")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    if argv[0] in ("-m", "-c") and len(argv) < 2:
        print(f"python -m yrdask.ray: {argv[0]} needs an argument\n{USAGE}", file=sys.stderr)
        return 2
    if argv[0] not in ("-m", "-c") and not os.path.isfile(argv[0]):
        print(f"python -m yrdask.ray: no such script: {argv[0]}", file=sys.stderr)
        return 2
    from yrdask.ray._alias import install

    install()
    _program_path_for_children()
    if argv[0] == "-m":  # as `python -m MODULE`: argv[0] becomes the module's file
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":  # as `python -c CODE`: argv[0] is "-c", the path starts with ""
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _program_path_for_children() -> None:
    """Python processes the program starts (``sys.executable driver.py``) inherit
    ``PYTHONPATH`` with ``yrdask/ray/_program_path`` first, whose ``ray`` package is
    yrdask.ray: their ``import ray`` is yrdask.ray too, as on a machine with Ray installed."""
    from yrdask.ray import _program_path

    here = os.path.dirname(os.path.abspath(_program_path.__file__))
    current = os.environ.get("PYTHONPATH", "")
    if here not in current.split(os.pathsep):
        os.environ["PYTHONPATH"] = here + (os.pathsep + current if current else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
