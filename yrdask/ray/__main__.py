"""``python -m yrdask.ray script.py [args...]``: run a Ray script unchanged on yrdask.

Installs the ``ray`` import alias (``import ray`` / ``from ray.util import ActorPool`` give
yrdask.ray's modules) and runs the script as ``__main__``, with ``sys.argv`` and
``sys.path[0]`` as ``python script.py args...`` would set them.  Nothing named ``ray`` is
installed on disk.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m yrdask.ray SCRIPT.py [ARGS...]\n"
              "Runs a script that does `import ray` on yrdask (see docs/migrating-from-ray.md).",
              file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"python -m yrdask.ray: no such script: {script}", file=sys.stderr)
        return 2
    from yrdask.ray._alias import install

    install()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
