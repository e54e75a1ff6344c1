"""The yr pages of the Dask dashboard (Bokeh), live through periodic callbacks.

=============================  ==================================================================
``/yr-instances``              instances: filter by state, class, name/id; pages of 50-500 rows
``/yr-resources``              capacity vs held per worker and per resource tag
``/yr-scheduling``             local vs forwarded work and queue lengths over time
``/individual-yr-*``           the same panels without the navigation bar (JupyterLab panels
                               "Yr Instances", "Yr Resources", "Yr Scheduling")
=============================  ==================================================================

Every panel reads :mod:`yrdask.dashboard.data` once a second and sends only what changed;
the instance table holds one page, so 10 000 instances cost one filter pass per update, and
the scheduling plots stream only the samples taken since the last update.
The instances page takes its filters from the URL too (``/yr-instances?state=ALIVE&name=x``),
which is what instance handles link to.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any, Callable

from bokeh.layouts import column, row
from bokeh.models import (AllIndices, Button, ColumnDataSource, DataTable, Div, FactorRange, HoverTool,
                          NumberFormatter, Select, TableColumn, TextInput)
from bokeh.plotting import figure
from distributed.dashboard.components import add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.dashboard.core import BokehApplication
from distributed.dashboard.scheduler import template_variables
from distributed.utils import log_errors
from tornado.ioloop import IOLoop

from yrdask.dashboard import PAGES, YrDashboard, dashboard_of, data

UPDATE_MS = 1000
PAGE_SIZES = ("50", "100", "200", "500")
SCHEDULING_WINDOW = 300  # samples on the scheduling plots: 5 minutes


def _set(source: ColumnDataSource, cols: dict[str, list], table: DataTable | None = None,
         fit: bool = False, most: int = 20) -> None:
    """Replace a source's data only when it changed (no websocket traffic otherwise).

    ``table``: the DataTable showing ``source``.  Bokeh's table redraws its grid only when
    its CDSView's row indices change, i.e. when the number of rows changes: new rows in the
    same number (an instance replaced by another, held amounts changing) would stay unseen
    until a reload.  So when the row count stays the same, the table's view gets a fresh
    (equal) filter, which makes it redraw (keeping its sort order).  ``fit``: make the table
    as tall as its rows (up to ``most`` of them).
    """
    if source.data != cols:
        rows_before = len(next(iter(source.data.values()), ()))
        source.data = cols
        if table is not None and rows_before == len(next(iter(cols.values()), ())):
            table.view.filter = AllIndices()
    if fit and table is not None:
        height = 32 + 26 * min(most, max(1, len(next(iter(cols.values()), ()))))
        if table.height != height:
            table.height = height


def _columns(rows: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in keys}


def _keys(spec: list[tuple]) -> tuple[str, ...]:
    """The fields of a table spec: ``[(field, title[, width]), ...]``."""
    return tuple(c[0] for c in spec)


_NUMERIC = {"capacity", "held", "free", "restarts", "leases", "tasks_running", "tasks_queued",
            "tasks_done", "local", "forwarded", "lease_requests", "submit_queued",
            "instances", "calls_running"}


def _table(source: ColumnDataSource, spec: list[tuple], **kw: Any) -> DataTable:
    """A DataTable over ``source`` with (field, title[, relative width]) columns."""
    def col(field: str, title: str, width: int = 100) -> TableColumn:
        if field in _NUMERIC:  # counts: right-aligned with thousands separators
            return TableColumn(field=field, title=title, width=width, formatter=NumberFormatter(
                format="0,0.[00]", text_align="right"))
        return TableColumn(field=field, title=title, width=width)

    return DataTable(source=source, columns=[col(*c) for c in spec], index_position=None,
                     sortable=True, reorderable=True, **kw)


class _Panel:
    """A panel: ``root`` (its Bokeh layout) and :meth:`update`, run once a second.

    Subclasses build their models in ``__init__`` (after this one's) and show one
    :class:`~yrdask.dashboard.data.Sources` snapshot in :meth:`show`.
    """

    root: Any

    def __init__(self, dash: YrDashboard) -> None:
        self.dash = dash
        self.summary = Div(text="", styles={"font-size": "14px"})

    @log_errors
    def update(self) -> None:
        src = self.dash.sources()
        if src is None:
            self.summary.text = "yr is not installed on this scheduler"
        else:
            self.show(src)

    def show(self, src: data.Sources) -> None:
        raise NotImplementedError


class InstancesPanel(_Panel):
    """The instance table with its filters and pager."""

    COLUMNS = [("name", "Name", 120), ("instance_id", "Id", 110), ("class", "Class", 100),
               ("state", "State", 80), ("worker", "Worker", 160), ("owner", "Owner", 110),
               ("restarts", "Restarts", 60), ("resources", "Resources", 220),
               ("calls_done", "Calls done", 70), ("calls_pending", "Calls pending", 80),
               ("created", "Created at", 140), ("waiting", "Waiting for", 400)]
    KEYS = _keys(COLUMNS)
    ENDED = [("class", "Class", 100), ("name", "Name", 100), ("instance_id", "Id", 110),
             ("job", "Job", 110), ("owner", "Owner", 110), ("worker", "Worker", 160),
             ("reason", "Why it ended", 320), ("ended", "Ended at", 140)]
    ENDED_KEYS = _keys(ENDED)
    ENDED_SHOWN = 200

    def __init__(self, dash: YrDashboard, args: dict[str, str], **kw: Any) -> None:
        super().__init__(dash)
        self.page = 0
        state = args.get("state", "").upper()
        self.state = Select(title="State", value=state if state in data.STATES else "",
                            options=[("", "all"), *[(s, s) for s in data.STATES]], width=140)
        self.cls = Select(title="Class", value=args.get("class", ""), options=[("", "all")],
                          width=180)
        self.text = TextInput(title="Name or id contains", value=args.get("name", ""),
                              value_input=args.get("name", ""), width=220)
        self.size = Select(title="Rows per page", value="100", options=list(PAGE_SIZES),
                           width=110)
        self.prev = Button(label="◀ previous", width=100, align="end")
        self.next = Button(label="next ▶", width=100, align="end")
        self.source = ColumnDataSource(_columns([], self.KEYS))
        # A full page fits the table to its rows (no blank area above "Ended"); the
        # JupyterLab panel (stretch_both) fills its window instead.
        self.fit = kw.get("sizing_mode") != "stretch_both"
        self.table = _table(self.source, self.COLUMNS, **kw,
                            **({} if self.fit else {"min_height": 300}))
        for widget in (self.state, self.cls, self.size):
            widget.on_change("value", self._refilter)
        self.text.on_change("value_input", self._refilter)
        self.prev.on_click(lambda: self._turn(-1))
        self.next.on_click(lambda: self._turn(+1))
        self.waiting = Div(text="", styles={"font-size": "13px"})
        self.ended_title = Div(text="<h3>Ended</h3>")
        self.ended = ColumnDataSource(_columns([], self.ENDED_KEYS))
        self.ended_table = _table(self.ended, self.ENDED, sizing_mode="stretch_width")
        self.root = column(row(self.state, self.cls, self.text, self.size, self.prev, self.next),
                           self.summary, self.waiting, self.table, self.ended_title,
                           self.ended_table, **kw)

    def _refilter(self, attr: str, old: Any, new: Any) -> None:
        self.page = 0
        self.update()

    def _turn(self, step: int) -> None:
        self.page = max(0, self.page + step)
        self.update()

    def query(self) -> data.InstanceQuery:
        limit = int(self.size.value)
        return data.InstanceQuery(self.state.value, self.cls.value, self.text.value_input,
                                  self.page * limit, limit)

    def show(self, src: data.Sources) -> None:
        view = data.query_instances(src, self.query())
        if view["offset"] >= view["matched"] > 0:  # the page ran past the end (rows went away)
            self.page = (view["matched"] - 1) // view["limit"]
            view = data.query_instances(src, self.query())
        options = [("", "all"), *[(c, c) for c in view["classes"]]]
        if self.cls.value and self.cls.value not in view["classes"]:
            options.append((self.cls.value, self.cls.value))
        if self.cls.options != options:
            self.cls.options = options
        rows = [{**r, "resources": data.format_shape(r["resources"]),
                 "calls_done": "" if r["calls_done"] is None else r["calls_done"],
                 "calls_pending": "" if r["calls_pending"] is None else r["calls_pending"],
                 "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"]))}
                for r in view["instances"]]
        _set(self.source, _columns(rows, self.KEYS), self.table, fit=self.fit)
        first = view["offset"] + 1 if rows else 0
        states = " · ".join(f"{s} <b>{n}</b>" for s, n in view["by_state"].items())
        self.summary.text = (
            f"Instances {first}–{view['offset'] + len(rows)} of {view['matched']} matching "
            f"({view['total']} in all) &nbsp;|&nbsp; {states}")
        self.prev.disabled = self.page == 0
        self.next.disabled = view["offset"] + len(rows) >= view["matched"]
        waiting, total = view["waiting"], src.pending_requests
        if self.cls.value:  # the class filter applies to the waiting list too
            records = src.lifecycle.instances
            waiting = [w for w in waiting if w.get("kind") == "instance" and (
                rec := records.get(w.get("holding_id") or "")) is not None
                and rec.spec.get("cls_name") == self.cls.value]
            total = len(waiting)
        self._show_waiting(waiting, total)
        ended = data.ended_view(src, self.ENDED_SHOWN)
        _set(self.ended, _columns([
            {**t, "ended": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t["ended_at"]))}
            for t in ended["ended"]], self.ENDED_KEYS), self.ended_table, fit=True,
            most=20 if self.fit else 6)  # the JupyterLab panel keeps room for the instances
        title = (f"<h3>Ended ({ended['total']})</h3>newest first; the last {ended['kept']} "
                 "ended instances are kept (yrdask.scheduling.ended-instances-kept)")
        if self.ended_title.text != title:
            self.ended_title.text = title

    def _show_waiting(self, waiting: list[dict], total: int) -> None:
        """Why requests wait: one line each (what, for how long, what each worker lacks),
        for the waits that can be a problem; ordinary queueing behind a job's own work is
        one count (``problem`` "", scheduler/waits.py)."""
        queued = sum(1 for w in waiting if not w.get("problem", True))
        waiting = [w for w in waiting if w.get("problem", True)]
        total = max(len(waiting), total - queued)
        note = (f"<b>Queued behind their own job's work: {queued}</b> requests (normal: they "
                "run as that work ends)<br>") if queued else ""
        if not waiting:
            text = note
        else:
            items = "".join(
                f"<li><b>{escape(w['what'])}</b> waits for {escape(data.format_shape(w['needs']))}"
                f" ({w['waited_s'] or 0:.0f} s; {escape(w.get('problem') or '')}): "
                f"{escape('; '.join(w['reasons']))}</li>"
                for w in waiting[:20])
            more = f"<li>... {total - 20} more</li>" if total > 20 else ""
            text = (f"{note}<b>Waiting for resources ({total})</b><ul>{items}{more}</ul>"
                    f"<i>{escape(waiting[0].get('fix', ''))}</i>")
        if self.waiting.text != text:
            self.waiting.text = text


class ResourcesPanel(_Panel):
    """Capacity vs held: a bar per (worker, resource) and the same figures as tables."""

    ROWS = [("worker", "Worker"), ("resource", "Resource"), ("capacity_text", "Capacity"),
            ("held_text", "Held"), ("free_text", "Free"), ("used_pct", "Used %")]
    TOTALS = [("resource", "Resource"), ("capacity_text", "Capacity"), ("held_text", "Held"),
              ("free_text", "Free")]
    WORKERS = [("worker", "Worker"), ("leases", "Leases"), ("instances", "Instances"),
               ("tasks_running", "Tasks running"), ("tasks_queued", "Tasks queued")]
    ROW_KEYS = (*_keys(ROWS), "key", "used", "label", "capacity", "held")  # bars need these
    TOTAL_KEYS, WORKER_KEYS = _keys(TOTALS), _keys(WORKERS)

    def __init__(self, dash: YrDashboard, args: dict[str, str], **kw: Any) -> None:
        super().__init__(dash)
        self.rows = ColumnDataSource(_columns([], self.ROW_KEYS))
        self.totals = ColumnDataSource(_columns([], self.TOTAL_KEYS))
        self.workers = ColumnDataSource(_columns([], self.WORKER_KEYS))
        self.fig = figure(title="Held / capacity per worker and resource", height=300,
                          y_range=FactorRange(), x_range=(0, 1.05), tools="",
                          toolbar_location=None, sizing_mode="stretch_width")
        self.fig.hbar(y="key", right=1.0, height=0.8, source=self.rows, color="#e0e0e0")
        self.fig.hbar(y="key", right="used", height=0.8, source=self.rows, color="#1f77b4")
        self.fig.text(x=0.01, y="key", text="label", source=self.rows, text_font_size="11px",
                      text_baseline="middle")
        self.fig.xaxis.axis_label = "fraction held"
        self.fig.add_tools(HoverTool(tooltips=[("", "@worker"), ("resource", "@resource"),
                                               ("held", "@label")]))
        self.tables = (_table(self.totals, self.TOTALS, width=480),
                       _table(self.workers, self.WORKERS, sizing_mode="stretch_width"),
                       _table(self.rows, self.ROWS, sizing_mode="stretch_width"))
        self.root = column(self.summary, self.fig, *self.tables, **kw)

    def show(self, src: data.Sources) -> None:
        view = data.resources_view(src)
        rows = [{**r, "key": f"{_short(r['worker'])} {r['resource']}",
                 "used_pct": round(100 * r["used"], 1), "used": min(r["used"], 1.05),
                 "label": f"{r['resource']}: {r['held_text']} / {r['capacity_text']}"}
                for r in view["rows"]]
        keys = [r["key"] for r in rows]
        if list(self.fig.y_range.factors) != keys:
            self.fig.y_range.factors = keys
            self.fig.height = max(160, 60 + 22 * len(keys))
        totals = [{"resource": r, **t} for r, t in view["totals"].items()]
        _set(self.totals, _columns(totals, self.TOTAL_KEYS), self.tables[0], fit=True)
        _set(self.workers, _columns(view["workers"], self.WORKER_KEYS), self.tables[1], fit=True)
        _set(self.rows, _columns(rows, self.ROW_KEYS), self.tables[2], fit=True)
        self.summary.text = (f"{len(view['workers'])} yr workers &nbsp;|&nbsp; " + " · ".join(
            f"{r} held <b>{t['held_text']}</b> of {t['capacity_text']}"
            for r, t in view["totals"].items())
            + " &nbsp;|&nbsp; units: CPU in cores (m = millicores, 1000 m = 1 core), "
              "Memory in MB, custom resources as their workers declared them")


def _short(address: str) -> str:
    return address.split("://", 1)[-1]


class SchedulingPanel(_Panel):
    """Local vs forwarded work per second and queue lengths over the last minutes.

    The plots' source grows by the samples taken since the last update (streamed, the oldest
    rolling over past :data:`SCHEDULING_WINDOW`), so an update sends a row, not the window.
    """

    WORKERS = [("worker", "Worker"), ("tasks_running", "Tasks running"),
               ("calls_running", "Instance calls"), ("tasks_queued", "Queued"),
               ("tasks_done", "Done"), ("local", "Pushed local"),
               ("forwarded", "Pushed forwarded"), ("lease_requests", "Lease requests"),
               ("submit_queued", "Waiting for lease"), ("leases", "Leases held"),
               ("instances", "Instances")]
    WORKER_KEYS = _keys(WORKERS)
    RATE_LINES = [("local_per_s", "tasks pushed locally /s", "#2ca02c"),
                  ("forwarded_per_s", "tasks forwarded /s", "#d62728"),
                  ("leases_per_s", "leases granted /s", "#1f77b4"),
                  ("leases_local_per_s", "local leases /s", "#9467bd")]
    QUEUE_LINES = [("running", "running (tasks + instance calls)", "#2ca02c"),
                   ("calls_running", "instance calls in progress", "#17becf"),
                   ("tasks_queued", "tasks queued in workers", "#ff7f0e"),
                   ("submit_queued", "tasks waiting for a lease", "#d62728"),
                   ("lease_requests_waiting", "requests waiting at the scheduler", "#1f77b4")]

    def __init__(self, dash: YrDashboard, args: dict[str, str], **kw: Any) -> None:
        super().__init__(dash)
        self.series = ColumnDataSource({**data.Timeline().series(), "t_ms": []})
        self.streamed = 0  # the timeline's ``added`` when the plots last got its samples
        self.workers = ColumnDataSource(_columns([], self.WORKER_KEYS))
        self.rates = self._plot("Work started: local vs forwarded (per second)",
                                self.RATE_LINES)
        self.queues = self._plot("Queue lengths", self.QUEUE_LINES)
        self.table = _table(self.workers, self.WORKERS, sizing_mode="stretch_width")
        self.root = column(self.summary, row(self.rates, self.queues, sizing_mode="stretch_width"),
                           self.table, **kw)

    def _plot(self, title: str, lines: list[tuple[str, str, str]]) -> Any:
        fig = figure(title=title, x_axis_type="datetime", height=280, tools="",
                     toolbar_location=None, sizing_mode="stretch_width")
        for field, label, color in lines:
            fig.line(x="t_ms", y=field, source=self.series, color=color, line_width=2,
                     legend_label=label)
        fig.legend.location = "top_left"
        fig.legend.background_fill_alpha = 0.5
        fig.y_range.start = 0
        return fig

    def show(self, src: data.Sources) -> None:
        timeline = self.dash.timeline
        new = min(timeline.added - self.streamed, SCHEDULING_WINDOW, len(timeline.samples))
        if new > 0:
            series = timeline.series(new)
            series["t_ms"] = [t * 1000 for t in series["time"]]
            self.series.stream(series, rollover=SCHEDULING_WINDOW)
        self.streamed = timeline.added
        _set(self.workers, _columns(data.worker_scheduling(src), self.WORKER_KEYS), self.table,
             fit=True)
        now = data.scheduling_sample(src)
        text = (
            f"Tasks pushed by workers: local <b>{now['tasks_local_total']}</b>, forwarded "
            f"<b>{now['tasks_forwarded_total']}</b> &nbsp;|&nbsp; leases granted "
            f"<b>{now['leases_granted_total']}</b> (local {now['leases_local_total']}) "
            f"&nbsp;|&nbsp; running <b>{now['running']}</b> ({now['tasks_running']} tasks, "
            f"{now['calls_running']} instance calls on {now['instances_hosted']} instances), "
            f"queued {now['tasks_queued']}, "
            f"waiting for a lease {now['submit_queued']}, requests waiting "
            f"{now['lease_requests_waiting']}")
        if src.placement:
            text += "<br>Placement by the scheduler: " + " &nbsp;|&nbsp; ".join(
                f"{kind} <b>{p['count']}</b> (p50 {p['p50_ms']:.2f} ms, p99 {p['p99_ms']:.2f} ms)"
                for kind, p in sorted(src.placement.items()))
        self.summary.text = text  # one change (sent only if it differs)


# -- Bokeh documents and installation ------------------------------------------------------


def _args(doc: Any) -> dict[str, str]:
    """The page URL's query parameters (first value of each)."""
    request = getattr(doc.session_context, "request", None)
    args = getattr(request, "arguments", None) or {}
    return {k: v[0].decode() if isinstance(v[0], bytes) else str(v[0])
            for k, v in args.items() if v}


def _page(panel: type[_Panel], title: str, individual: bool) -> Callable[[Any, dict, Any], None]:
    """A Bokeh document function showing ``panel``: a full dashboard page (Dask's navigation
    bar and theme), or, ``individual``, the panel alone filling the window (JupyterLab)."""
    @log_errors
    def doc_fn(scheduler: Any, extra: dict, doc: Any) -> None:
        sizing = "stretch_both" if individual else "stretch_width"
        p = panel(dashboard_of(scheduler), _args(doc), sizing_mode=sizing)
        p.update()
        add_periodic_callback(doc, p, UPDATE_MS)
        doc.title = f"Dask: yr {title}"
        doc.add_root(p.root)
        if not individual:
            doc.template = env.get_template("simple.html")
            doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME
    return doc_fn


PANELS = {"instances": InstancesPanel, "resources": ResourcesPanel,
          "scheduling": SchedulingPanel}
APPLICATIONS = {f"/{prefix}yr-{key}": _page(PANELS[key], title, individual=bool(prefix))
                for prefix in ("", "individual-") for key, title in PAGES.items()}


def install(dash: YrDashboard, http: Any) -> None:
    """Mount the yr Bokeh application next to Dask's and link it from Dask's navigation."""
    scheduler = dash.scheduler
    # Dask's pages share these lists (memoized per scheduler): the yr pages join its
    # navigation bar, and its "More..." menu lists the yr panels.
    tv = template_variables(scheduler)
    for key in PAGES:
        if f"yr-{key}" not in tv["pages"]:
            tv["pages"].append(f"yr-{key}")
    urls = {p["url"] for p in tv["plots"]}
    tv["plots"].extend({"url": f"individual-yr-{key}", "name": f"Yr {title}"}
                       for key, title in PAGES.items() if f"individual-yr-{key}" not in urls)
    tv["plots"].sort(key=lambda p: p["name"])
    app = BokehApplication(APPLICATIONS, scheduler, prefix=dash.prefix or "/",
                           template_variables=tv)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    dash.pages_mounted = True
