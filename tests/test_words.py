"""The one table of each API's words (yrdask/words.py), walked row by row.

For every situation a program can meet, the yr message is provoked on a real cluster and
read twice: by ``yr.get`` (yr's words only) and by ``ray.get`` on the same ref (the Ray
facade's path, Ray's words only).  Then every row of the table is shown to turn its yr
phrase into Ray's.  Waits are walked in tests/test_waits.py (a yr job's and a Ray job's
warnings from the scheduler).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import cloudpickle
import pytest

import yrdask as yr
from yrdask.words import FIX_HINT, RAY_FIX_HINT, RAY_WORDS, YR_ONLY, in_ray_words

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)

T = 60

#: Ray's words no yr message may use.
RAY_ONLY = (".options(", "ray.init", "ray.kill", "actor", "max_retries", "'CPU'")


@yr.invoke
def one() -> int:
    return 1


@yr.invoke
def sleeps(s: float) -> int:
    time.sleep(s)
    return 1


@yr.invoke
def crashes() -> None:
    os._exit(3)


@yr.instance
class Box:
    def ping(self) -> int:
        return 1


def now(**kw) -> yr.InvokeOptions:
    """Options whose request fails at once when no worker can ever run it."""
    return yr.InvokeOptions(schedule_timeout_ms=0, **kw)


SITUATIONS = {
    "unschedulable CPU": (lambda: one.options(now(cpu=64_000)).invoke(),
                          ("InvokeOptions(cpu=", "millicores"),
                          ("num_cpus=", "num_cpus=64 (largest offer", "ray.init(num_cpus=")),
    "unknown resource": (lambda: one.options(now(custom_resources={"nosuch": 1})).invoke(),
                         ("nosuch: 1", "yr.init(Config("),
                         ("'nosuch': 1.0", "resources={...}")),
    "unschedulable actor": (lambda: Box.options(now(cpu=64_000)).invoke().ping.invoke(),
                            ("Box instance", "end instances"),
                            ("can never be scheduled", "Box actor", "ray.kill")),
    "task crashed its process": (lambda: crashes.invoke(),
                                 ("retry_times=0", "exited with code 3"),
                                 ("max_retries=0", "exited with code 3")),
}


def read(get, ref) -> str:
    with pytest.raises(Exception) as info:
        get(ref, timeout=T)
    return str(info.value)


@pytest.mark.parametrize("situation", sorted(SITUATIONS))
def test_each_api_reads_the_same_failure_in_its_own_words(cluster, situation):
    import yrdask.ray as ray

    cluster(num_cpus=2)
    ray.init()  # attaches to the yr runtime: the same cluster, the same refs
    try:
        provoke, yr_words, ray_words = SITUATIONS[situation]
        ref = provoke()
        yr_text, ray_text = read(yr.get, ref), read(ray.get, ref)
    finally:
        ray.shutdown()
    for word in yr_words:
        assert word in yr_text, (word, yr_text)
    for word in ray_words:
        assert word in ray_text, (word, ray_text)
    assert not [w for w in RAY_ONLY if w in yr_text], yr_text
    assert not [w for w in YR_ONLY if w in ray_text], ray_text


def test_a_get_timeout_and_a_dead_actor_in_each_apis_words(cluster):
    import yrdask.ray as ray

    cluster(num_cpus=2)
    ray.init()
    try:
        slow = sleeps.invoke(30)
        with pytest.raises(yr.YRTimeoutError) as yr_late:
            yr.get(slow, timeout=0.3)
        with pytest.raises(ray.exceptions.GetTimeoutError) as ray_late:
            ray.get(slow, timeout=0.3)
        box = Box.invoke()
        assert yr.get(box.ping.invoke(), timeout=T) == 1
        yr.kill_instance(box.instance_id)  # ended elsewhere: its next call fails at get
        ref = box.ping.invoke()
        yr_dead, ray_dead = read(yr.get, ref), read(ray.get, ref)
    finally:
        ray.shutdown()
    yr_late, ray_late = str(yr_late.value), str(ray_late.value)
    assert "timeout=-1" in yr_late and "timeout=None" in ray_late, (yr_late, ray_late)
    assert "has ended" in yr_dead and "instance" in yr_dead, yr_dead
    assert ray_dead.startswith("The actor is dead because"), ray_dead
    for text in (ray_late, ray_dead):
        assert not [w for w in YR_ONLY if w in text], text
    for text in (yr_late, yr_dead):
        assert not [w for w in RAY_ONLY if w in text], text


def test_a_bad_ray_init_argument_names_ray_init():
    """``ray.init(num_cpus=-1)`` is refused in ray.init's words (yr's is Config.num_cpus);
    in a fresh process, where no runtime is installed yet."""
    code = ("import yrdask.ray as ray\n"
            "try:\n    ray.init(num_cpus=-1)\n"
            "except ValueError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, YR_SERVER_ADDRESS="", RAY_ADDRESS=""))
    assert out.stdout.strip() == "ValueError ray.init(num_cpus=...) must be >= 0, got -1", \
        out.stdout + out.stderr[-2000:]
    with pytest.raises(yr.YRValueError, match=r"^Config\.num_cpus must be >= 0, got -1"):
        yr.Config(num_cpus=-1)


#: a yr phrase of each row's situation, as yrdask writes it.
SAMPLES = {
    "remedy of a request that cannot be placed": f"did not fit in time. {FIX_HINT}",
    "an argument of the session's start": "Config.num_cpus must be >= 0, got -1",
    "options that ask for less": "ask for less (InvokeOptions(cpu=..., memory=...))",
    "amounts of a request or an offer": "request {CPU: 1500, Memory: 512, x: 1}",
    "what no worker offers": "no worker offers CPU=64000 (largest offer: 2000), "
                             "Memory=100 (largest offer: 50)",
    "what a waiting request lacks on a worker": "needs CPU 500, free 0 of 2000 millicores",
    "the kind of work waiting": "task lease request R1 of tcp://a:1",
    "a stateful worker": "held by Counter instance i-1 and 2 instances; Instance i-2",
    "reruns after lost workers": "more than its own bound of 2 reruns allows",
    "reruns after the task's own crash": "more than retry_times=0 allows (InvokeOptions."
                                         "retry_times reruns a task whose process crashed)",
    "a get that ran out of time": "yr.get of obj-1",
    "waiting forever": "or use timeout=-1 to wait forever",
}


def test_every_row_of_the_table_turns_its_yr_phrase_into_rays():
    assert {row.situation for row in RAY_WORDS} == set(SAMPLES)  # a new row needs a sample
    for row in RAY_WORDS:
        text = SAMPLES[row.situation]
        assert row.yr.search(text), row.situation
        ray_text = in_ray_words(text)
        assert not row.yr.search(ray_text), (row.situation, ray_text)
        assert not [w for w in YR_ONLY if w in ray_text], (row.situation, ray_text)
    assert in_ray_words(SAMPLES["amounts of a request or an offer"]) == \
        "request {'CPU': 1.5, 'memory': 536870912.0, 'x': 1.0}"
    assert in_ray_words(SAMPLES["what no worker offers"]) == (
        "no worker offers num_cpus=64 (largest offer: 2), "
        "memory=104857600 (largest offer: 52428800)")
    assert in_ray_words(SAMPLES["a stateful worker"]) == \
        "held by Counter actor i-1 and 2 actors; Actor i-2"
    assert RAY_FIX_HINT in in_ray_words(SAMPLES["remedy of a request that cannot be placed"])
    # what is not yr's shape stays as it is (Ray's own dicts, a set literal)
    assert in_ray_words("resources={'x': 1} and {1, 2}") == "resources={'x': 1} and {1, 2}"
