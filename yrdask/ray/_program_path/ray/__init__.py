"""``import ray`` in a Python process started by a program that runs under ``python -m
yrdask.ray`` (this directory's parent is first on its ``PYTHONPATH``): installs the import
alias and hands over ``yrdask.ray`` itself, so the process runs Ray code on yrdask too."""

import sys

if __name__ == "ray":  # (not when imported under its own yrdask.ray._program_path name)
    del sys.modules["ray"]  # this stand-in goes: the alias maps ray and ray.* to yrdask.ray
    from yrdask.ray._alias import install

    install()
    import yrdask.ray

    sys.modules["ray"] = yrdask.ray  # what `import ray` binds (importlib reads it back)
