"""``import yr`` for scripts written for openYuanrong: the public names of :mod:`yrdask`."""

from yrdask import *  # noqa: F401,F403
from yrdask import __all__, __version__  # noqa: F401
