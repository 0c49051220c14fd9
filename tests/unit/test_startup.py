"""The start-up record (asyncrl.obs.startup): process start times against psutil's, a record
and its line computed by hand, and its spans on the timeline."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from asyncrl.obs.startup import Startup, describe, process_start_time
from asyncrl.obs.timeline import chrome_trace, spans
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import FromWorker, Ready, WorkerStamps


def test_process_start_time_falls_between_the_spawn_and_its_return() -> None:
    # the kernel counts a process's start in clock ticks (10 ms): it may read up to a tick
    # before the spawn began (psutil's own figure is coarser: its boot time is whole seconds)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    for _ in range(3):
        before = time.time()
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"]) as child:
            after = time.time()
            try:
                assert before - tick <= process_start_time(child.pid) <= after
            finally:
                child.kill()
        assert process_start_time(child.pid) is None  # reaped: gone
    assert process_start_time() < before


# a run launched at wall time 100: the controller's clock starts at 103, the workers are
# ready at 110, the first evaluation runs 7.5-9.0 on the run clock (110.5-112 on the wall),
# step 1 is done at 12.0 (115), its refit 11.0-11.5
STAMPS = WorkerStamps(process=101.0, serving=102.0, init=103.5, created=104.0, started=109.0)
STARTUP = Startup(launched=100.0, controller=103.0, ready=110.0, workers={"rollout:0": STAMPS})


def test_the_record_by_hand() -> None:
    r = STARTUP.record(first_eval=(7.5, 9.0), first_step=12.0, refit=(11.0, 11.5))
    assert r["kind"] == "startup"
    assert r["first_step_s"] == 15.0
    assert r["phases"] == {"launch": 3.0, "workers": 7.0, "first_eval": 2.0, "first_step": 3.0}
    assert sum(r["phases"].values()) == r["first_step_s"]
    assert r["controller_s"] == 3.0
    assert r["first_eval_s"] == [10.5, 12.0] and r["refit_s"] == [14.0, 14.5]
    assert r["workers"] == {"rollout:0": {"process_s": 1.0, "ready_s": 9.0, "imports": 1.0,
                                          "handshake": 1.5, "plugin": 0.5, "backend": 5.0}}
    assert describe(r) == (
        "first step 15.0 s after the launch: launch 3.0 s, workers 7.0 s (rollout:0: imports "
        "1.0, plugin 0.5, backend 5.0), first eval 2.0 s, step 1 3.0 s (refit 0.50 s)"
    )


def test_a_run_without_a_first_evaluation() -> None:
    r = STARTUP.record(first_eval=None, first_step=12.0, refit=None)
    assert r["phases"] == {"launch": 3.0, "workers": 7.0, "first_eval": 0.0, "first_step": 5.0}
    assert r["first_eval_s"] is None and r["refit_s"] is None
    assert describe(r).endswith("workers 7.0 s (rollout:0: imports 1.0, plugin 0.5, backend "
                                "5.0), step 1 5.0 s")


def test_the_stamps_travel_in_ready_and_a_ready_without_them_still_decodes() -> None:
    codec = Codec(FromWorker)
    back = codec.decode(codec.encode(Ready(backend="bigram", startup=STAMPS)))
    assert back.startup == STAMPS
    assert codec.decode(codec.encode(Ready(backend="bigram"))).startup is None


def test_the_start_up_lanes_on_the_run_clock() -> None:
    r = STARTUP.record(first_eval=(7.5, 9.0), first_step=12.0, refit=(11.0, 11.5))
    got = [(s.lane, s.name, s.start, s.end) for s in spans([{"kind": "config"}, r])]
    assert got == [
        ("start-up", "launch", -3.0, 0.0),
        ("start-up", "workers", 0.0, 7.0),
        ("start-up", "first_eval", 7.0, 9.0),
        ("start-up", "first_step", 9.0, 12.0),
        ("start-up rollout:0", "imports", -2.0, -1.0),
        ("start-up rollout:0", "handshake", -1.0, 0.5),
        ("start-up rollout:0", "plugin", 0.5, 1.0),
        ("start-up rollout:0", "backend", 1.0, 6.0),
    ]
    # a trace starts at the launch: no negative times
    events = [e for e in chrome_trace(spans([r]))["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in events) == 0.0
    assert {e["name"]: e["ts"] for e in events}["workers"] == 3e6
