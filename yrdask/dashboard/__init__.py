"""yr monitoring on the Dask scheduler: dashboard pages, a JSON API and Prometheus metrics.

:func:`install` is called once by the yr scheduler extension when the scheduler starts (the
embedded cluster and ``dask scheduler --preload yrdask`` alike).  By then Dask has built its
HTTP server, so yr adds to it at run time instead of through Dask's import-time tables:

* the JSON handlers (:mod:`.routes`) are added with ``http_application.add_handlers``, and so
  is a handler for ``individual-plots.json`` that lists Dask's panels plus yr's (JupyterLab);
* the Prometheus collector (:mod:`.prometheus`) joins ``prometheus_client.REGISTRY``, which
  Dask's ``/metrics`` handler renders;
* the Bokeh pages (:mod:`.pages`) go in a second Bokeh Tornado application added with
  ``http_application.add_application``, the way Dask mounts its own.  That happens as soon as
  Dask's Bokeh application is there: at once under ``dask scheduler``, which builds it in
  ``Scheduler.__init__``; on the first dashboard request when the scheduler mounts it lazily
  (the embedded cluster's ``LazyDashboard``), so Bokeh is never imported for nothing.

State of its own (the scheduling time series, the restart counter) lives in a
:class:`YrDashboard` kept in ``scheduler.extensions["yr-dashboard"]``; its sampler is one of
the scheduler's ``periodic_callbacks``, so Dask stops it when the scheduler closes.  Bokeh and
prometheus_client are optional: without one, only its part is missing.  URLs and metric
names: docs/monitoring.md.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any, Callable

from tornado.ioloop import PeriodicCallback

from yrdask.dashboard.data import RestartCounter, Sources, Timeline, scheduling_sample, sources_of

logger = logging.getLogger("yrdask.dashboard")

NAME = "yr-dashboard"  # key in scheduler.extensions and scheduler.periodic_callbacks
SAMPLE_MS = 1000
#: The pages: ``/yr-<key>`` (full page) and ``/individual-yr-<key>`` (JupyterLab panel).
PAGES = {"instances": "Instances", "resources": "Resources", "scheduling": "Scheduling"}


class YrDashboard:
    """One scheduler's monitoring state: the scheduling timeline and the restart counter.

    ``read`` gives the :class:`~yrdask.dashboard.data.Sources` to show (default: the yr
    extension of ``scheduler``).
    """

    def __init__(self, scheduler: Any,
                 read: Callable[[], Sources | None] | None = None) -> None:
        self.scheduler = scheduler
        self._read = read or functools.partial(sources_of, scheduler)
        self.timeline = Timeline()
        self.restarts = RestartCounter()
        self.prefix = ""  # the dashboard's URL prefix ("" or "/something")
        self.pages_mounted = False  # the Bokeh pages are served
        self._pages_tried = False

    def sources(self) -> Sources | None:
        """What the pages read now (None if yr is not on this scheduler)."""
        return self._read()

    def sample(self) -> None:
        """Periodic: append a scheduling sample and count restarts."""
        src = self.sources()
        if src is None:
            return
        self.timeline.add(scheduling_sample(src))
        self.restarts.observe(src.lifecycle.instances.values())

    def teardown(self) -> None:
        """Called by Dask when the scheduler closes: the collector stops reporting it.

        Only if the collector was ever installed (importing it here would fail, or import
        prometheus_client for nothing, when it was not).
        """
        prometheus = sys.modules.get("yrdask.dashboard.prometheus")
        if prometheus is not None:
            prometheus.forget(self)


def dashboard_of(scheduler: Any) -> YrDashboard | None:
    return scheduler.extensions.get(NAME)


def install(scheduler: Any) -> YrDashboard:
    """Add the yr pages, JSON routes and metrics to a started scheduler (idempotent).

    Each part is optional and logged when it cannot be added, so monitoring never stops
    the scheduler from serving yr.
    """
    existing = dashboard_of(scheduler)
    if existing is not None:
        return existing
    dash = YrDashboard(scheduler)
    scheduler.extensions[NAME] = dash
    pc = PeriodicCallback(dash.sample, SAMPLE_MS)
    scheduler.periodic_callbacks[NAME] = pc
    pc.start()
    dash.sample()
    http = getattr(scheduler, "http_application", None)
    if http is not None:
        dash.prefix = _dashboard_prefix(http)
        _optional("JSON routes", "routes", lambda m: m.install(dash, http))
        mount_pages(dash, http)
        if not dash._pages_tried:  # Dask mounts its Bokeh application later (lazily)
            _mount_pages_later(dash, http)
    _optional("Prometheus metrics", "prometheus", lambda m: m.install(dash))
    return dash


def mount_pages(dash: YrDashboard, http: Any) -> bool:
    """Mount the Bokeh pages if Dask's Bokeh application is there; True if they are served.

    Mounted once: a failure is logged and not retried.
    """
    if _can_mount(dash, http):
        dash._pages_tried = True
        dash.prefix = _dashboard_prefix(http)
        _optional("pages", "pages", lambda m: m.install(dash, http))
    return dash.pages_mounted


def _can_mount(dash: YrDashboard, http: Any) -> bool:
    return not dash._pages_tried and _dask_bokeh(http) is not None


def _mount_pages_later(dash: YrDashboard, http: Any) -> None:
    """Mount the pages at the first request after Dask mounted its Bokeh application.

    A rule matches every request while Dask's application is there and yr's is not yet; its
    handler mounts yr's and redirects to the same URL, which is then served as usual.  (yr's
    own routes come first; ``individual-plots.json`` mounts the pages itself.)
    """
    from tornado import web
    from tornado.routing import Matcher, Rule

    class DaskBokehMounted(Matcher):
        def match(self, request: Any) -> dict | None:
            return {} if _can_mount(dash, http) else None

    class MountPages(web.RequestHandler):
        def prepare(self) -> None:
            mount_pages(dash, http)
            self.redirect(self.request.uri, status=307)

    http.add_handlers(r".*", [Rule(DaskBokehMounted(), MountPages)])


def _optional(what: str, module: str, add: Callable[[Any], None]) -> None:
    """Import ``yrdask.dashboard.<module>`` and run ``add(module)``; log instead of failing."""
    try:
        add(importlib.import_module(f"yrdask.dashboard.{module}"))
    except ImportError as e:  # bokeh or prometheus_client missing or unsupported
        logger.info("yr dashboard %s not added: %s", what, e)
    except Exception:
        logger.warning("yr dashboard %s not added", what, exc_info=True)


def _dask_bokeh(http: Any) -> Any:
    """Dask's Bokeh Tornado application in the scheduler's HTTP app, or None (not mounted).

    Checked by class name, so that asking does not import Bokeh.
    """
    for app in http.applications:
        if any(c.__name__ == "BokehTornado" for c in type(app).__mro__):
            return app
    return None


def _dashboard_prefix(http: Any) -> str:
    """The URL prefix of Dask's Bokeh application (``--dashboard-prefix``), or ""."""
    app = _dask_bokeh(http)
    return (getattr(app, "prefix", "") or "").rstrip("/") if app is not None else ""
