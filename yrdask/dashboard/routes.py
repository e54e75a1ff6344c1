"""The yr JSON API under the scheduler's dashboard, for scripts and alerts.

==================================  =========================================================
``/yr/api``                         index of these URLs
``/yr/api/instances``               a page of instances: ``?state=&class=&name=&offset=&limit=``,
                                    with why the waiting ones wait
``/yr/api/ended``                   ended instances, newest first: ``?limit=100``
``/yr/api/resources``               capacity vs held per worker and per resource tag
``/yr/api/scheduling``              local vs forwarded work, queue lengths; ``?samples=60``
``/individual-plots.json``          Dask's JupyterLab panel list, plus the yr panels
==================================  =========================================================

Replies are the dicts of :mod:`yrdask.dashboard.data`; a bad parameter answers 400 with
``{"error": ...}``, a scheduler without yr 503.  Handlers follow Dask's own
(``distributed.http.utils.RequestHandler``: ``self.server`` is the scheduler).
"""

from __future__ import annotations

from typing import Any

from distributed.http.scheduler.info import IndividualPlots
from distributed.http.utils import RequestHandler

from yrdask.dashboard import PAGES, dashboard_of, data, mount_pages

#: The endpoints, as absolute paths under the dashboard's URL prefix (the index's links).
INDEX = {
    "instances": "/yr/api/instances?state=&class=&name=&offset=0&limit=100",
    "ended": "/yr/api/ended?limit=100",
    "resources": "/yr/api/resources",
    "scheduling": "/yr/api/scheduling?samples=60",
}


class _YrHandler(RequestHandler):
    """Base: JSON replies, and the yr sources of this scheduler (or a 503)."""

    def reply(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(body)

    def sources(self) -> data.Sources | None:
        src = data.sources_of(self.server)
        if src is None:
            self.reply({"error": "yr is not installed on this scheduler "
                                 "(start it with: dask scheduler --preload yrdask)"}, 503)
        return src


class IndexHandler(_YrHandler):
    def get(self) -> None:
        """Absolute links (with the dashboard's prefix): they resolve from ``/yr/api`` and
        ``/yr/api/`` alike."""
        dash = dashboard_of(self.server)
        prefix = dash.prefix if dash is not None else ""
        self.reply({"endpoints": {k: f"{prefix}{url}" for k, url in INDEX.items()}})


class InstancesHandler(_YrHandler):
    def get(self) -> None:
        try:
            q = data.InstanceQuery.from_params(lambda k: self.get_argument(k, None))
        except ValueError as e:
            self.reply({"error": str(e)}, 400)
            return
        src = self.sources()
        if src is not None:
            self.reply(data.query_instances(src, q))


class EndedHandler(_YrHandler):
    def get(self) -> None:
        raw = self.get_argument("limit", "100")
        if not raw.isdigit() or int(raw) > data.MAX_LIMIT:
            self.reply({"error": f"limit={raw!r} is not an integer in 0..{data.MAX_LIMIT}"},
                       400)
            return
        src = self.sources()
        if src is not None:
            self.reply(data.ended_view(src, int(raw)))


class ResourcesHandler(_YrHandler):
    def get(self) -> None:
        src = self.sources()
        if src is not None:
            self.reply(data.resources_view(src))


class SchedulingHandler(_YrHandler):
    def get(self) -> None:
        raw = self.get_argument("samples", "60")
        if not raw.isdigit():
            self.reply({"error": f"samples={raw!r} is not a non-negative integer "
                                 "(0 = every sample kept)"}, 400)
            return
        src = self.sources()
        if src is not None:
            dash = dashboard_of(self.server)
            timeline = dash.timeline if dash is not None else data.Timeline()
            self.reply(data.scheduling_view(src, timeline, int(raw) or None))


class IndividualPlotsWithYr(IndividualPlots):
    """Dask's ``individual-plots.json`` plus the yr panels.

    JupyterLab's Dask extension shows one button per entry (named without "Individual ");
    Dask's own handler lists only the Bokeh application it mounted itself.  This is often the
    dashboard's first request (the embedded cluster mounts Dask's pages just before it), so
    the yr pages are mounted here if they are not yet.
    """

    def write(self, chunk: Any) -> None:
        dash = dashboard_of(self.server)
        if (isinstance(chunk, dict) and dash is not None
                and mount_pages(dash, self.server.http_application)):
            chunk = {**chunk, **{f"Individual Yr {title}": f"/individual-yr-{key}"
                                 for key, title in PAGES.items()}}
        super().write(chunk)


routes: list[tuple[str, type, dict]] = [
    (r"yr/api/?", IndexHandler, {}),
    (r"yr/api/instances", InstancesHandler, {}),
    (r"yr/api/ended", EndedHandler, {}),
    (r"yr/api/resources", ResourcesHandler, {}),
    (r"yr/api/scheduling", SchedulingHandler, {}),
    (r"individual-plots.json", IndividualPlotsWithYr, {}),
]


def install(dash: Any, http: Any) -> None:
    """Add :data:`routes` (under the dashboard's URL prefix) to the scheduler's HTTP app."""
    http.add_handlers(r".*", [(f"{dash.prefix}/{url}", cls, {**kw, "dask_server": dash.scheduler})
                              for url, cls, kw in routes])
