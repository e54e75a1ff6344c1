"""``import yr`` for scripts written for openYuanrong: the public names of :mod:`yrdask`, and
yr's submodules as attributes (``yr.decorator.instance_proxy.InstanceProxy`` after a bare
``import yr``, as openYuanrong's package imports them)."""

from yrdask import *  # noqa: F401,F403
from yrdask import __all__, __version__  # noqa: F401
from yr import (affinity, apis, config, decorator, exception, generator, group,  # noqa: F401
                object_ref, resource_group, runtime)
