"""The composition root: the only place where the scheduler extension and the worker agent meet.

``preload`` is what ``--preload yrdask`` runs on a Dask scheduler or worker; ``embedded``
builds the cluster ``yr.init()`` starts when it has no address.
"""
