"""Monitor: window rates from counters, queue health, ring aggregation, throughput/MFU,
best-effort collectors, stall detection, events, close; plus its per-tick cost."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import types

import pytest
import torch

from dflash_trainer.config import MetricsConfig
from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.observe.flops import FlopsModel
from dflash_trainer.observe.monitor import Monitor
from dflash_trainer.observe.scalars import ScalarRing
from dflash_trainer.observe.sinks import Sink
from dflash_trainer.pipeline.queues import BoundedQueue


class RecordingSink(Sink):
    def __init__(self):
        self.logs, self.events, self.closed = [], [], 0

    def log(self, metrics, step):
        self.logs.append((step, dict(metrics)))

    def event(self, record, step):
        self.events.append((step, dict(record)))

    def close(self):
        self.closed += 1


class FakeCollector:
    def __init__(self, out=None, exc=None):
        self.out, self.exc, self.calls = out or {}, exc, 0

    def collect(self, now=None, nvml_metrics=None):
        self.calls += 1
        if self.exc:
            raise self.exc
        return dict(self.out)

    def close(self):
        pass


def cfg(**kw):
    base = dict(log_every_s=1.0, tick_s=0.25, wandb="off", tensorboard=False, console=False)
    base.update(kw)
    return MetricsConfig(**base)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def build(clock, **kw):
    target = WorkerCounters("target0", "target", last_progress=clock.t)
    drafter = WorkerCounters("drafter0", "drafter", last_progress=clock.t)
    q = BoundedQueue("features", capacity=4, poll_s=0.01)
    ring = ScalarRing(["loss", "acc_0", "accept_len"], capacity=16)
    sink = RecordingSink()
    args = dict(
        workers=[target, drafter],
        queues=[q],
        rings={"drafter0": ring},
        sinks=sink,
        nvml=FakeCollector({"gpu/0/util": 50.0, "gpu/0/mem_used_gib": 10.0}),
        allocator=FakeCollector({"mem/0/reserved_gib": 8.0}),
        clock=clock,
    )
    args.update(kw)
    mon = Monitor(cfg(peak_tflops=100.0), "unused", **args)
    return mon, target, drafter, q, ring, sink


def test_window_metrics_exact():
    clock = Clock()
    flops = FlopsModel(
        target_params_matmul=1e9,
        target_layers=10,
        target_attn_dim=1024,
        drafter_params_matmul=1e8,
        drafter_layers=1,
        drafter_attn_dim=1024,
        drafter_context_params=1e7,
        lm_head_params=5e7,
        block_size=16,
        seq_len=512,
    )
    comp = lambda: {"padding_eff": 0.8, "batch/len_mean": 256, "note": "x"}  # noqa: E731
    mon, target, drafter, q, ring, sink = build(clock, flops=flops, composition=comp)
    mon.cfg.log_every_s = 2.0
    stop = threading.Event()

    # Window of 2 s, ticks at +0.5 .. +2.0. Worker activity:
    target.steps, target.items, target.tokens, target.padded_tokens = 4, 16, 4000, 5000
    target.busy_ns, target.wait_in_ns, target.wait_out_ns = int(1.0e9), int(0.2e9), int(0.4e9)
    target.add_phase("forward", int(0.8e9))
    drafter.steps, drafter.tokens, drafter.query_tokens = 2, 2000, 1024
    drafter.gauges["lr"] = 3e-4
    q.put(types.SimpleNamespace(enqueued_ns=time.perf_counter_ns()), stop)
    clock.t += 0.5
    mon.tick()  # depth 1
    q.put(types.SimpleNamespace(enqueued_ns=time.perf_counter_ns()), stop)
    clock.t += 0.5
    mon.tick()  # depth 2
    q.get(stop)
    q.get(stop)
    clock.t += 0.5
    mon.tick()  # depth 0
    for s, loss in [(1, 2.0), (2, 4.0), (3, float("nan"))]:
        ring.push(s, torch.tensor([loss, 0.5, 3.0]))
    target.last_progress = clock.t - 0.25
    clock.t += 0.5
    mon.tick()  # depth 0, logs (2.0 s >= 1.0 s)
    assert len(sink.logs) == 1
    step, m = sink.logs[0]
    assert step == 3
    assert all(isinstance(v, float) for v in m.values()), [
        k for k, v in m.items() if not isinstance(v, float)
    ]
    assert m["time/elapsed_s"] == 2.0
    w = "worker/target0/"
    assert m[w + "steps_per_s"] == 2.0 and m[w + "items_per_s"] == 8.0
    assert m[w + "tokens_per_s"] == 2000.0 and m[w + "steps_total"] == 4.0
    assert m[w + "busy_frac"] == pytest.approx(0.5)
    assert m[w + "wait_in_frac"] == pytest.approx(0.1)
    assert m[w + "wait_out_frac"] == pytest.approx(0.2)
    assert m[w + "heartbeat_age_s"] == pytest.approx(0.75)
    assert m[w + "padding_eff"] == pytest.approx(0.8)
    assert m["prof/target0/host_step_ms"] == pytest.approx(250.0)
    assert m["prof/target0/forward_ms"] == pytest.approx(200.0)
    assert m["prof/target0/wait_in_ms"] == pytest.approx(50.0)
    assert m["worker/drafter0/lr"] == 3e-4 and m["drafter/lr"] == 3e-4
    qk = "queue/features/"
    assert m[qk + "depth"] == 0.0 and m[qk + "capacity"] == 4.0
    assert m[qk + "depth_mean"] == pytest.approx(3 / 4)
    assert m[qk + "occupancy"] == pytest.approx(0.5)
    assert m[qk + "items_per_s"] == pytest.approx(1.0)
    assert 0.0 <= m[qk + "consumer_starved_frac"] < 0.1
    assert 0.0 <= m[qk + "producer_blocked_frac"] < 0.1
    assert m[qk + "get_wait_p99_ms"] >= 0.0 and m[qk + "item_age_ms"] >= 0.0
    assert m["batch/padding_eff"] == 0.8 and m["batch/len_mean"] == 256.0
    assert "batch/note" not in m
    # Ring: the NaN loss is excluded from the mean and counted.
    assert m["drafter/loss"] == pytest.approx(3.0)
    assert m["drafter/accept_len"] == pytest.approx(3.0)
    assert m["drafter/nonfinite_values"] == 1.0 and m["drafter/step"] == 3.0
    # Throughput and FLOPs (attention term uses the observed batch/len_mean = 256).
    assert m["tput/target_tok_s"] == 2000.0 and m["tput/drafter_tok_s"] == 1000.0
    assert m["tput/drafter_steps_s"] == 1.0 and m["tput/balance"] == 2.0
    t_tfl = 2000.0 * (2 * 1e9 + 2 * 10 * 1024 * 256) / 1e12
    assert m["tput/target_tflops"] == pytest.approx(t_tfl)
    assert m["tput/mfu_target"] == pytest.approx(100 * t_tfl / 100.0)
    d_tfl = (512.0 * (6 * 1e8 + 12 * 1024 * (128 + 16) + 4 * 5e7) + 1000.0 * 6 * 1e7) / 1e12
    assert m["tput/drafter_tflops"] == pytest.approx(d_tfl)
    assert m["tput/mfu_drafter"] == pytest.approx(d_tfl)
    # Collectors and self-overhead.
    assert m["gpu/0/util"] == 50.0 and m["mem/0/reserved_gib"] == 8.0
    for k in (
        "prof/monitor/tick_ms",
        "prof/monitor/nvml_ms",
        "prof/monitor/log_ms",
        "monitor/collector_errors",
    ):
        assert k in m
    assert mon.latest()["drafter/loss"] == pytest.approx(3.0)
    assert math.isnan(mon.latest()["drafter/loss_last"])

    # Second window: rates are deltas, not totals.
    target.steps += 1
    clock.t += 2.0
    mon.tick()
    m2 = sink.logs[1][1]
    assert m2["worker/target0/steps_per_s"] == 0.5 and m2["worker/target0/steps_total"] == 5.0
    assert "drafter/loss" not in m2  # no new ring samples in this window
    assert m2["prof/monitor/log_ms"] > 0.0


def test_busy_counts_a_step_in_every_window_it_spans():
    """A 3.5 s step in 2 s windows: busy 0.5 of the window it starts in, 1.0, then 0.25 of the
    one it ends in; never the whole step in the window it ends in (1.2 s GPU steps read busy
    1.3 then 0.6 that way)."""
    clock = Clock()
    mon, target, drafter, q, ring, sink = build(clock, step_clock_ns=lambda: int(clock.t * 1e9))
    mon.cfg.log_every_s = 2.0
    start = int((clock.t + 1.0) * 1e9)  # begins 1 s into the first window
    drafter.begin_busy(start)
    clock.t += 2.0
    mon.tick()
    busy = [sink.logs[-1][1]["worker/drafter0/busy_frac"]]
    clock.t += 2.0
    mon.tick()
    busy.append(sink.logs[-1][1]["worker/drafter0/busy_frac"])
    assert drafter.end_busy(start + int(3.5e9)) == int(3.5e9) and drafter.busy_ns == int(3.5e9)
    clock.t += 2.0
    mon.tick()
    busy.append(sink.logs[-1][1]["worker/drafter0/busy_frac"])
    assert busy == pytest.approx([0.5, 1.0, 0.25])  # nothing lost, nothing counted twice


def test_busy_mark_is_one_consistent_pair():
    c = WorkerCounters("t", "target")
    assert c.busy_ns_at(10**12) == 0
    c.begin_busy(100)
    assert c.busy_ns_at(150) == 50 and c.busy_ns == 0
    assert c.end_busy(200) == 100 and c.busy_ns_at(10**12) == 100
    c.begin_busy(300)
    assert c.busy_ns_at(350) == 150
    c.busy_ns = 7  # a counter set directly (no step running) reads as itself
    c.busy_mark = (0, 0)
    assert c.busy_ns_at(10**12) == 7


def test_no_log_before_interval_and_latest_fresh():
    clock = Clock()
    mon, target, drafter, q, ring, sink = build(clock)
    ring.push(7, torch.tensor([1.0, 0.5, 2.0]))
    clock.t += 0.5
    mon.tick()
    assert sink.logs == []
    assert mon.latest()["drafter/loss_last"] == 1.0 and mon.latest()["drafter/step"] == 7.0


def test_collector_errors_counted_reported_once(caplog):
    clock = Clock()
    bad = FakeCollector(exc=RuntimeError("NVML exploded"))

    def comp():
        raise KeyError("composition broke")

    mon, *_, sink = build(clock, nvml=bad, composition=comp)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            clock.t += 1.0
            mon.tick()
    assert len(sink.logs) == 3 and bad.calls == 3
    assert sink.logs[-1][1]["monitor/collector_errors"] == 6.0
    assert mon.collector_errors == 6
    assert sum("NVML exploded" in r.getMessage() for r in caplog.records) == 1
    assert sum("composition broke" in r.getMessage() for r in caplog.records) == 1


def test_stalled_detector():
    clock = Clock()
    mon, target, drafter, *_ = build(clock)
    target.last_progress = clock.t - 100.0
    drafter.last_progress = clock.t - 1.0
    assert mon.stalled(30.0) == ["target0"]
    assert mon.stalled(0.5) == ["target0", "drafter0"]
    assert mon.stalled(1000.0) == []


def test_log_event_and_close():
    clock = Clock()
    mon, target, drafter, q, ring, sink = build(clock)
    mon.log_event({"eval/accept_len": 3.25, "checkpoint": "step_100"}, step=100)
    assert sink.events == [(100, {"eval/accept_len": 3.25, "checkpoint": "step_100"})]
    with pytest.raises(TypeError, match="tensor"):
        mon.log_event({"loss": torch.tensor(1.0)})
    ring.push(5, torch.tensor([1.0, 1.0, 1.0]))
    clock.t += 0.3
    mon.close()  # flushes the partial window
    assert len(sink.logs) == 1 and sink.logs[0][1]["drafter/loss"] == 1.0
    assert sink.closed == 1
    mon.close()
    assert sink.closed == 1


def test_queue_fractions_with_k_producers_stay_within_one():
    """k target workers put into one hidden-state queue: their put waits add up to k x the
    window when all are blocked throughout, so the monitor divides by the queue's producers
    (and get waits by its consumers): the fractions stay within [0, 1]."""
    clock = Clock()
    q = BoundedQueue("hidden", capacity=1, poll_s=0.01, producers=3, consumers=2)
    sink = RecordingSink()
    mon = Monitor(
        cfg(),
        "unused",
        queues=[q],
        sinks=sink,
        nvml=FakeCollector(),
        allocator=FakeCollector(),
        clock=clock,
    )
    q.counters.put_wait_ns = 3 * 10**9  # each of 3 producers blocked for the whole 1 s window
    q.counters.get_wait_ns = 10**9  # each of 2 consumers starved half of it
    clock.t += 1.0
    mon.tick()
    m = sink.logs[-1][1]
    assert m["queue/hidden/producer_blocked_frac"] == pytest.approx(1.0)
    assert m["queue/hidden/consumer_starved_frac"] == pytest.approx(0.5)


def test_puts_from_several_threads_are_all_counted():
    """Queue counters have several writers (k target workers): no update is lost."""
    q = BoundedQueue("hidden", capacity=10**6, poll_s=0.01, producers=4)
    stop = threading.Event()

    def produce():
        for _ in range(5000):
            q.put(None, stop)

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert q.counters.puts == 20000 and q.qsize() == 20000


def test_monitor_with_real_sinks_writes_jsonl(tmp_path):
    w = WorkerCounters("target0", "target")
    mon = Monitor(cfg(), tmp_path, workers=[w])  # builds jsonl only (wandb/tb/console off)
    w.steps, w.tokens = 3, 300
    mon.tick(now=mon._t_start + 1.5)
    mon.close(now=mon._t_start + 2.0)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["kind"] == "metrics"
    assert lines[0]["worker/target0/tokens_per_s"] == pytest.approx(200.0)
    assert lines[0]["tput/target_tok_s"] == pytest.approx(200.0)


def test_tick_overhead_small():
    """8 workers, 4 queues, a 20-scalar ring: measure the per-tick and per-log cost."""
    clock = Clock()
    workers = [WorkerCounters(f"target{i}", "target") for i in range(4)] + [
        WorkerCounters(f"drafter{i}", "drafter") for i in range(4)
    ]
    queues = [BoundedQueue(f"q{i}", 8) for i in range(4)]
    ring = ScalarRing([f"m{i}" for i in range(20)], capacity=64)
    sink = RecordingSink()
    mon = Monitor(
        cfg(log_every_s=1e9),
        "unused",
        workers=workers,
        queues=queues,
        rings={"drafter0": ring},
        sinks=sink,
        nvml=FakeCollector(),
        allocator=FakeCollector(),
        clock=clock,
    )
    vals = torch.zeros(20)
    n = 500
    t0 = time.perf_counter()
    for s in range(n):
        ring.push(s, vals)
        clock.t += 0.01
        mon.tick()
    tick_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(50):
        mon._log(clock.t)
    log_us = (time.perf_counter() - t0) / 50 * 1e6
    print(
        f"\nmonitor tick (incl. one push): {tick_us:.1f} us; log build: {log_us:.1f} us; "
        f"keys/log: {len(sink.logs[-1][1])}"
    )
    assert tick_us < 2000 and log_us < 20000


# ---------------------------------------------------------------- FLOPs model
def test_flops_target_matches_flop_counter():
    """2*N + attention per token vs torch's FlopCounterMode on a tiny HF Llama body (no lm_head).
    The counter charges full (non-causal) S x S attention; our model charges the causal half."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaModel

    from dflash_trainer.observe.flops import layer_matmul_params

    torch.manual_seed(0)
    hf = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="eager",
    )  # explicit matmuls: counted
    model = LlamaModel(hf).eval()
    n_linear = sum(
        m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    assert layer_matmul_params(hf) * 2 == n_linear
    S = 32
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randint(0, 128, (1, S)))
    counted = fc.get_total_flops()
    fm = FlopsModel.from_configs(
        hf,
        target_layers_run=2,
        drafter_config=types.SimpleNamespace(
            hidden_size=64,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            block_size=4,
            target_layer_ids=[0, 1],
        ),
        seq_len=S,
    )
    ours = S * fm.target_flops_per_token()
    full_attention_extra = 2 * 2 * 64 * S * S  # L * (QK + PV) * d * S^2 / 2
    assert ours + full_attention_extra == counted


def test_flops_drafter_terms_and_peaks():
    from dflash_trainer.observe.flops import peak_tflops, peak_tflops_for_name

    t = types.SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
    )
    d = types.SimpleNamespace(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        block_size=4,
        target_layer_ids=[0, 1, 2],
    )
    fm = FlopsModel.from_configs(t, 3, d, seq_len=20)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert fm.drafter_params_matmul == per_layer
    assert fm.drafter_flops_per_query() == 6 * per_layer + 12 * 64 * (10 + 4) + 4 * 64 * 100
    assert fm.drafter_flops_per_context_token() == 6 * (3 * 64 * 64 + 2 * 64 * 32)
    # 1 of 4 slots through the LM head, 2 of 4 read from the (only) layer: its block K/V for all
    # 4 slots, its query, output and MLP for 2 (DFlashObjective.read_slots).
    part = FlopsModel.from_configs(t, 3, d, seq_len=20, loss_slots=1, read_slots=2)
    kv = 2 * 64 * 32
    assert part.drafter_params_matmul == kv + (per_layer - kv) / 2
    assert part.drafter_flops_per_query() == (
        6 * (kv + (per_layer - kv) / 2) + 12 * 0.5 * 64 * (10 + 4) + 4 * 64 * 100 / 4
    )
    assert peak_tflops_for_name("NVIDIA H200") == 989.0
    assert peak_tflops_for_name("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for_name("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_for_name("NVIDIA B200") == 2250.0
    assert peak_tflops_for_name("NVIDIA L40S") == 362.0
    assert peak_tflops_for_name("Tesla T4") == 0.0
    assert peak_tflops(torch.device("cpu")) == 0.0
    assert peak_tflops(torch.device("cpu"), configured=123.0) == 123.0
