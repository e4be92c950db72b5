"""The Stage protocol on fakes: one end event per thread, failures as values, the loop head over
End / EpochEnd markers, and the step guard (fault hook, out-of-memory message)."""

import threading

import pytest
import torch

from dflash_trainer.pipeline.messages import End, EpochEnd, StageFailure
from dflash_trainer.pipeline.queues import BoundedQueue, Stopped
from dflash_trainer.pipeline.stage import BatchOutOfMemory, FaultInjector, InjectedFault, Stage


class FakeStage(Stage):
    role = "target"

    def __init__(self, body, **kw):
        self.got: list = []
        super().__init__("fake0", events=self.got.append, stop=threading.Event(), **kw)
        self.body = body

    def loop(self):
        self.body(self)


def _run(stage):
    stage.start()
    stage.join(timeout=10)
    assert not stage.is_alive()
    assert len(stage.got) == 1, stage.got  # exactly one event per thread
    return stage.got[0]


def test_normal_end_and_stop_report_end():
    assert _run(FakeStage(lambda s: None)) == End("fake0")

    def stopped(s):
        raise Stopped("q")

    assert _run(FakeStage(stopped)) == End("fake0")


def test_failure_is_reported_as_a_value_naming_the_stage():
    def boom(s):
        raise ValueError("bad batch")

    st = FakeStage(boom)
    ev = _run(st)
    assert isinstance(ev, StageFailure) and ev.stage == "fake0"
    assert isinstance(ev.exc, ValueError) and "bad batch" in ev.tb
    assert st.counters.errors == 1 and st.counters.role == "target"


def test_events_queue_gets_the_event_too():
    import queue

    events: queue.Queue = queue.Queue()
    st = FakeStage(lambda s: None)
    st.events = events
    st.start()
    st.join(timeout=10)
    assert events.get_nowait() == End("fake0") and events.empty()


def test_items_routes_markers_and_ends_after_every_producer():
    q = BoundedQueue("q", 16, poll_s=0.01)
    stop = threading.Event()
    for x in (1, EpochEnd(0, 1), End("a"), 2, End("b"), 3):
        q.put(x, stop)
    seen = {"end": [], "epoch": []}

    class Two(FakeStage):
        def on_end(self, item):
            seen["end"].append(item.producer)

        def on_epoch_end(self, item):
            seen["epoch"].append(item.epoch)

    out = []
    st = Two(lambda s: out.extend(s.items(q, ends=2)))
    assert _run(st) == End("fake0")
    assert out == [1, 2] and seen == {"end": ["a", "b"], "epoch": [0]}
    assert q.qsize() == 1  # the item after the last End is left alone


def test_guard_fires_the_fault_hook_at_its_step_and_names_ooms():
    st = FakeStage(lambda s: None, faults=FaultInjector("drafter:2"))
    with st.guard("drafter", (4, 16), step=1):
        pass
    with pytest.raises(InjectedFault, match="'drafter' at step 2"):
        with st.guard("drafter", (4, 16), step=2):
            pass
    with pytest.raises(BatchOutOfMemory, match="drafter step on a batch of 4 x 16 tokens"):
        with st.guard("drafter", (4, 16), step=3):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="other"):  # anything else passes through
        with st.guard("target", (4, 16), step=3):
            raise RuntimeError("other")
