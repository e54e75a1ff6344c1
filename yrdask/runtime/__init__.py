"""The per-process yr runtime, used by drivers and by code running inside workers alike.

It sits under the public facade (``yrdask.api``) and above the base modules (protocol,
errors, options, serialization).  It never imports the facade, the scheduler extension, the
worker agent or the composition root (``yrdask.deploy``): the worker agent reaches it through
the :class:`~yrdask.runtime.node.LocalNode` interface it implements.
"""
