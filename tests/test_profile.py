import pytest
import torch

from dflash_trainer.observe.profile import StepTimer


def test_cpu_timer_is_a_noop():
    t = StepTimer("cpu")
    tok = t.start()
    t.stop(tok)
    t.resolve()
    assert tok is None and t.count == 0 and t.total_ms == 0.0


class _FakeEvent:
    def __init__(self, clock):
        self.clock, self.t, self.done = clock, None, False

    def record(self, stream=None):
        self.t = self.clock[0]

    def query(self):
        return self.done

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time on an unfinished event would block"
        return end.t - self.t


def test_resolve_reads_only_finished_pairs_and_recycles(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent(clock))
    t = StepTimer("cpu", capacity=2)
    t.enabled = True
    a = t.start()
    clock[0] = 5.0
    t.stop(a)
    b = t.start()
    clock[0] = 12.0
    t.stop(b)
    assert t.start() is None and t.dropped == 1  # pool exhausted: skip, never wait
    t.resolve()
    assert t.count == 0  # nothing finished yet
    for e in a:
        e.done = True
    t.resolve()
    assert t.count == 1 and t.total_ms == pytest.approx(5.0)
    for e in b:
        e.done = True
    t.resolve()
    assert t.count == 2 and t.total_ms == pytest.approx(12.0)
    assert t.start() is not None  # recycled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timer_measures_a_kernel():
    t = StepTimer("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    tok = t.start()
    x @ x
    t.stop(tok)
    torch.cuda.synchronize()
    t.resolve()
    assert t.count == 1 and t.total_ms > 0
