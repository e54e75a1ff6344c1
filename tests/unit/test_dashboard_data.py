"""Unit tests of yrdask.dashboard.data (and the Bokeh panels' update) without a cluster.

The inputs are real yr objects: a ``Lifecycle`` filled through its own methods and a
``Ledger`` with real holdings; only the workers' heartbeat reports are written by hand (they
are plain dicts, the shape ``WorkerAgent.metrics()`` returns).  Includes the 10 000-instance
server-time bound: building a page of the instance list (JSON and Bokeh) stays under a second.
Run with ``-s`` to see the measured times.
"""

from __future__ import annotations

import json
import time

import pytest
from bokeh.document import Document
from bokeh.document.events import ColumnsStreamedEvent
from bokeh.events import ButtonClick

from yrdask import protocol as P
from yrdask.dashboard import YrDashboard, data, pages
from yrdask.scheduler import lifecycle as L
from yrdask.scheduler.lifecycle import Lifecycle
from yrdask.scheduler.resources import Holding, Ledger

pytestmark = pytest.mark.timeout(60)

W1, W2 = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"
SHAPE = {"CPU": 10.0, "Memory": 0.0}


def fill(n: int, classes=("Actor", "Counter")) -> tuple[Lifecycle, Ledger, dict]:
    """``n`` instances: every 10th PENDING, every 7th restarted once, the rest ALIVE."""
    lc, ledger = Lifecycle(), Ledger()
    ledger.add_worker(W1, {"CPU": 100_000.0, "Memory": 1000.0, "gpu": 1.0})
    ledger.add_worker(W2, {"CPU": 100_000.0, "Memory": 1000.0})
    metrics: dict = {W1: {"instances": {}, "tasks_running": 1, "tasks_queued": 2,
                          "tasks_done": 5, "scheduling": {"local": 3, "forwarded": 1,
                                                          "queued": 4, "leases": 1}},
                     W2: {"instances": {}, "tasks_running": 0, "tasks_queued": 0}}
    for i in range(n):
        iid = f"i-{i:05d}"
        lc.add({"instance_id": iid, "owner": "job-1", "name": f"actor-{i}" if i % 2 else "",
                "namespace": "", "detached": False, "holder": "tcp://driver:1",
                "cls_name": classes[i % len(classes)], "shape": SHAPE})
        if i % 10 == 0:
            continue  # PENDING: waiting for resources
        worker = W1 if i % 3 else W2
        lc.placed(iid, worker)
        ledger.hold(Holding(iid, "instance", worker, SHAPE, iid))
        lc.set_state(iid, P.ALIVE)
        metrics[worker]["instances"][iid] = [i, i % 4]
        if i % 7 == 0:
            lc.instances[iid].restarts = 1
    return lc, ledger, metrics


def sources(lc: Lifecycle, ledger: Ledger, metrics: dict) -> data.Sources:
    return data.Sources(lc, ledger, metrics, {"leases_granted": 9, "leases_local": 2}, 1)


def params(**kw):
    return lambda key: kw.get(key)


# -- the query -----------------------------------------------------------------------------


def test_query_parameters_are_checked():
    q = data.InstanceQuery.from_params(params(state="alive", **{"class": "C"}, name="x",
                                              offset="10", limit="5"))
    assert q == data.InstanceQuery("ALIVE", "C", "x", 10, 5)
    assert data.InstanceQuery.from_params(params()) == data.InstanceQuery()
    for bad, message in [({"state": "GONE"}, "state='GONE' is not one of"),
                         ({"limit": "x"}, "limit='x' is not an integer"),
                         ({"limit": "5000"}, "limit=5000 is out of range (0..1000)"),
                         ({"offset": "-1"}, "offset=-1 is out of range")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            data.InstanceQuery.from_params(params(**bad))


def test_filters_count_and_page():
    src = sources(*fill(100))
    everything = data.query_instances(src, data.InstanceQuery(limit=1000))
    assert everything["total"] == everything["matched"] == 100
    assert everything["by_state"] == {"PENDING": 10, "ALIVE": 90, "RESTARTING": 0, "DEAD": 0}
    assert everything["classes"] == ["Actor", "Counter"]

    pending = data.query_instances(src, data.InstanceQuery(state=P.PENDING))
    assert pending["matched"] == 10
    assert {r["state"] for r in pending["instances"]} == {P.PENDING}
    assert all(r["worker"] == "" and r["calls_done"] is None for r in pending["instances"])

    counters = data.query_instances(src, data.InstanceQuery(cls="Counter", limit=1000))
    assert counters["matched"] == 50 and {r["class"] for r in counters["instances"]} == {"Counter"}

    named = data.query_instances(src, data.InstanceQuery(text="ACTOR-9"))  # name, any case
    assert sorted(r["name"] for r in named["instances"]) == [
        "actor-9", "actor-91", "actor-93", "actor-95", "actor-97", "actor-99"]
    by_id = data.query_instances(src, data.InstanceQuery(text="i-00042"))
    assert [r["instance_id"] for r in by_id["instances"]] == ["i-00042"]

    page = data.query_instances(src, data.InstanceQuery(offset=20, limit=7))
    assert [r["instance_id"] for r in page["instances"]] == [f"i-{i:05d}" for i in range(20, 27)]
    assert page["matched"] == 100 and page["offset"] == 20 and page["limit"] == 7
    assert data.query_instances(src, data.InstanceQuery(offset=500))["instances"] == []


def test_row_has_the_columns_of_the_page():
    lc, ledger, metrics = fill(10)
    row = data.query_instances(sources(lc, ledger, metrics),
                               data.InstanceQuery(text="i-00007"))["instances"][0]
    rec = lc.instances["i-00007"]
    assert row == {"instance_id": "i-00007", "name": "actor-7", "namespace": "",
                   "class": "Counter", "state": "ALIVE", "worker": W1, "owner": "job-1",
                   "detached": False, "restarts": 1, "resources": SHAPE, "calls_done": 7,
                   "calls_pending": 3, "created_at": rec.created_at, "reason": "",
                   "waiting": ""}
    assert json.loads(json.dumps(row)) == row


# -- resources and scheduling --------------------------------------------------------------


def test_resources_capacity_vs_held_per_worker_and_tag():
    lc, ledger, metrics = fill(10)  # 9 placed: 6 on W1, 3 on W2, 10 millicores each
    ledger.hold(Holding("L1", "lease", W1, {"CPU": 1000.0, "gpu": 1.0}, "tcp://driver:1"))
    view = data.resources_view(sources(lc, ledger, metrics))
    w1 = next(w for w in view["workers"] if w["worker"] == W1)
    assert w1["held"]["CPU"] == 1060.0 and w1["held"]["gpu"] == 1.0
    assert w1["free"]["CPU"] == 100_000.0 - 1060.0
    assert (w1["leases"], w1["instances"], w1["tasks_queued"]) == (1, 6, 2)
    gpu = [r for r in view["rows"] if r["resource"] == "gpu"]
    assert gpu == [{"worker": W1, "resource": "gpu", "unit": "", "capacity": 1.0, "held": 1.0,
                    "free": 0.0, "used": 1.0, "capacity_text": "1", "held_text": "1",
                    "free_text": "0"}]
    cpu = view["totals"]["CPU"]
    assert {k: cpu[k] for k in ("unit", "capacity", "held", "free")} == {
        "unit": "millicores", "capacity": 200_000.0, "held": 1090.0, "free": 200_000.0 - 1090.0}
    assert list(view["totals"]) == ["CPU", "Memory", "gpu"]
    # Units: CPU in cores and millicores, Memory in MB.
    assert view["units"] == {"CPU": "millicores", "Memory": "MB", "gpu": ""}
    assert cpu["capacity_text"] == "200 cores (200000 m)"
    assert cpu["held_text"] == "1.09 cores (1090 m)"
    assert view["totals"]["Memory"]["capacity_text"] == "2000 MB"
    assert data.format_amount("CPU", 1000.0) == "1 core (1000 m)"


def test_scheduling_sample_and_rates():
    src = sources(*fill(3))
    s = data.scheduling_sample(src, now=100.0)
    assert (s["tasks_local_total"], s["tasks_forwarded_total"], s["submit_queued"]) == (3, 1, 4)
    assert (s["tasks_running"], s["tasks_queued"], s["lease_requests_waiting"]) == (1, 2, 1)
    assert (s["leases_granted_total"], s["leases_local_total"]) == (9, 2)
    tl = data.Timeline(maxlen=3)
    for t, local in [(0.0, 0), (1.0, 10), (3.0, 30), (4.0, 5)]:  # last: counters reset
        tl.add({**s, "time": t, "tasks_local_total": local})
    series = tl.series()
    assert series["time"] == [1.0, 3.0, 4.0]  # maxlen kept the newest three
    assert tl.added == 4
    assert series["local_per_s"] == [0.0, 10.0, 0.0]
    assert tl.series(last=2)["local_per_s"] == [10.0, 0.0]  # rate of the first uses one more
    src.placement = {"lease": {"count": 2, "mean_ms": 1.0, "p50_ms": 0.5, "p99_ms": 1.5}}
    view = data.scheduling_view(src, tl, last=1)
    assert view["placement"] == src.placement and view["series"]["time"] == [4.0]
    workers = data.worker_scheduling(src)
    assert workers[0]["worker"] == W1 and workers[0]["local"] == 3 and workers[1]["local"] == 0


def test_restart_counter_only_grows():
    lc, _, _ = fill(20)  # i-00007 and i-00014 restarted once
    counter = data.RestartCounter()
    assert counter.observe(lc.instances.values()) == 2
    lc.instances["i-00007"].restarts = 3
    lc.instances["i-00003"].restarts = 1  # its first restart
    lc.end("i-00014", "terminated")
    lc.forget("i-00014")
    assert counter.observe(lc.instances.values()) == 5
    assert counter.observe(lc.instances.values()) == 5  # nothing new


# -- the Bokeh panels ----------------------------------------------------------------------


def dashboard(src: data.Sources | None) -> YrDashboard:
    return YrDashboard(None, read=lambda: src)


def test_panels_say_when_yr_is_missing():
    for panel in (pages.InstancesPanel, pages.ResourcesPanel, pages.SchedulingPanel):
        p = panel(dashboard(None), {})
        p.update()
        assert p.summary.text == "yr is not installed on this scheduler", panel


def test_instances_panel_filters_from_the_url_and_pages():
    lc, ledger, metrics = fill(300)
    expected = [iid for iid, rec in lc.instances.items()  # creation order
                if rec.state == P.ALIVE and rec.spec["cls_name"] == "Actor"]
    assert 100 < len(expected) < 200  # two pages of 100 rows
    panel = pages.InstancesPanel(dashboard(sources(lc, ledger, metrics)),
                                 {"state": "alive", "class": "Actor"})
    panel.update()
    assert panel.source.data["instance_id"] == expected[:100]
    assert f"Instances 1–100 of {len(expected)} matching (300 in all)" in panel.summary.text
    assert "PENDING <b>30</b>" in panel.summary.text
    assert panel.prev.disabled and not panel.next.disabled
    panel.next._trigger_event(ButtonClick(panel.next))  # as the browser's click does
    assert panel.source.data["instance_id"] == expected[100:]
    assert not panel.prev.disabled and panel.next.disabled
    for iid in expected[50:]:  # rows go away: the second page is past the end
        lc.end(iid, "terminated")
        lc.forget(iid)
    panel.update()
    assert panel.page == 0 and panel.source.data["instance_id"] == expected[:50]
    panel.text.value_input = expected[7]  # typing in the filter box refilters at once
    assert panel.source.data["instance_id"] == [expected[7]]


def test_resources_panel_shows_the_ledger():
    lc, ledger, metrics = fill(10)
    panel = pages.ResourcesPanel(dashboard(sources(lc, ledger, metrics)), {})
    panel.update()
    assert panel.rows.data["key"] == ["10.0.0.1:1 CPU", "10.0.0.1:1 Memory", "10.0.0.1:1 gpu",
                                      "10.0.0.2:1 CPU", "10.0.0.2:1 Memory"]
    assert list(panel.fig.y_range.factors) == panel.rows.data["key"]
    assert panel.workers.data["instances"] == [6, 3]
    assert "2 yr workers" in panel.summary.text and "CPU held <b>0.09 cores (90 m)</b> of 200 cores (200000 m)" in \
        panel.summary.text


def test_scheduling_panel_streams_new_samples_only():
    src = sources(*fill(3))
    dash = dashboard(src)
    for t in range(5):
        dash.timeline.add(data.scheduling_sample(src, now=1000.0 + t))
    panel = pages.SchedulingPanel(dash, {})
    panel.update()
    assert panel.series.data["time"] == [1000.0 + t for t in range(5)]
    assert panel.series.data["t_ms"][-1] == 1_004_000.0
    assert "local <b>3</b>, forwarded <b>1</b>" in panel.summary.text
    assert panel.workers.data["worker"] == [W1, W2]
    doc = Document()  # what a browser session holds: record what the updates send it
    doc.add_root(panel.root)
    sent: list = []
    doc.on_change(lambda event: sent.append(event) if getattr(event, "model", None) is
                  panel.series else None)
    panel.update()  # no new sample: nothing to send
    assert sent == []
    dash.timeline.add({**data.scheduling_sample(src, now=1005.0), "tasks_local_total": 13})
    panel.update()
    (event,) = sent  # one row streamed, its rate taken against the sample before
    assert isinstance(event, ColumnsStreamedEvent) and event.rollover == pages.SCHEDULING_WINDOW
    assert event.data["time"] == [1005.0] and event.data["local_per_s"] == [10.0]
    assert panel.series.data["time"][-2:] == [1004.0, 1005.0]


# -- 10 000 instances ----------------------------------------------------------------------


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def test_10k_instances_page_server_time_under_a_second():
    src = sources(*fill(10_000))
    assert len(src.lifecycle.instances) == 10_000
    figures = {}
    for label, q in [("first page", data.InstanceQuery()),
                     ("state filter", data.InstanceQuery(state=P.PENDING)),
                     ("name filter", data.InstanceQuery(text="actor-99")),
                     ("last page of 500", data.InstanceQuery(offset=9500, limit=500))]:
        figures[f"JSON {label}"] = best_of(
            3, lambda q=q: json.dumps(data.query_instances(src, q)).encode())
    figures["JSON resources"] = best_of(3, lambda: json.dumps(data.resources_view(src)))

    dash = dashboard(src)
    figures["sampler (every second, pages or not)"] = best_of(3, dash.sample)
    panel = pages.InstancesPanel(dash, {}, sizing_mode="stretch_width")
    figures["Bokeh instances update"] = best_of(3, panel.update)
    assert len(panel.source.data["instance_id"]) == 100
    assert "of 10000 matching (10000 in all)" in panel.summary.text
    panel.size.value = "500"  # on_change refilters at once
    assert len(panel.source.data["instance_id"]) == 500
    figures["Bokeh resources update"] = best_of(
        3, pages.ResourcesPanel(dash, {}, sizing_mode="stretch_width").update)
    figures["Bokeh scheduling update"] = best_of(
        3, pages.SchedulingPanel(dash, {}, sizing_mode="stretch_width").update)
    print("\nserver time with 10 000 instances (best of 3):")
    for label, seconds in figures.items():
        print(f"  {label:38s} {seconds * 1000:7.1f} ms")
    slow = {k: v for k, v in figures.items() if v >= 1.0}
    assert not slow, f"over a second of server time: {slow}"


def test_instances_panel_shows_why_requests_wait_and_the_ended_instances():
    """Waiting explanations come from a real LeaseQueue, tombstones from the Lifecycle."""
    from yrdask.scheduler.leases import HoldRequested, LeaseQueue, WorkerJoined

    lc, _, metrics = fill(3)
    queue = LeaseQueue()
    queue.handle(WorkerJoined("t", W1, {"CPU": 500.0}))
    for i, iid in enumerate(("i-00000", "i-00001")):  # the second one waits
        queue.handle(HoldRequested("t", f"r{i}", iid, "instance", {"CPU": 500.0}, -1, None,
                                   "", (), (), (), iid, 0.0, "Actor"))
    waiting = [queue.explain_wait("r1", now=9.0)]
    lc.now = 42.0
    lc.handle(L.Kill("k", "i-00002", "terminated"))
    lc.handle(L.Stopped("s", "i-00002"))
    src = data.Sources(lc, queue.ledger, metrics, {}, 1, {}, waiting)
    rows = data.query_instances(src, data.InstanceQuery(text="i-00001"))
    assert rows["instances"][0]["waiting"].startswith("Actor instance i-00001 waits for")
    assert data.ended_view(src)["ended"][0]["instance_id"] == "i-00002"
    panel = pages.InstancesPanel(dashboard(src), {})
    panel.update()
    assert "Waiting for resources (1)" in panel.waiting.text
    assert f"worker {W1}: needs CPU 500, free 0 of 500 millicores; held by Actor instance " \
           "i-00000" in panel.waiting.text
    assert "InvokeOptions(cpu=" in panel.waiting.text
    assert panel.ended.data["instance_id"] == ["i-00002"]
    assert panel.ended.data["reason"] == ["terminated"]
    assert panel.ended_title.text.startswith("<h3>Ended (1)</h3>")
