"""The state API's own errors, under Ray's names and module (``ray.util.state.exception``)."""

from __future__ import annotations


class RayStateApiException(Exception):
    """A state query the cluster could not answer as asked (a filter on a column that cannot
    be filtered, a limit out of range, output that would be incomplete), as Ray raises it."""


class ServerUnavailable(RayStateApiException):
    """The cluster to ask could not be reached."""
