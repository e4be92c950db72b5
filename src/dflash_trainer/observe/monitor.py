"""The monitor: turns counters the workers already keep into one flat dict of floats per interval.

Runs on the MAIN thread; workers never call it. Every `tick()` (every `tick_s`) is O(workers +
queues + ring samples) of pure-Python work with no locks on the worker side, no tensor ops and no
blocking call: it samples queue depths (for occupancy) and drains the scalar rings. Every
`log_every_s` it also computes window deltas/rates, reads NVML and the CUDA allocator, and hands one
dict to the sinks (the only place sinks are called). Every collector is best-effort: an exception
is counted in `monitor/collector_errors`, reported once, never raised (observability.md §8.9).

Worker roles come from the counters (`WorkerCounters.role`): `target` workers feed
`tput/target_*`, `drafter` and `sequential` workers (drafter training) `tput/drafter_*`. Keys
follow the catalogue of docs/design/observability.md §7.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import MetricsConfig
from dflash_trainer.observe.counters import TRAINING_ROLES
from dflash_trainer.observe.flops import FlopsModel, peak_tflops
from dflash_trainer.observe.gpu import AllocatorCollector, NvmlCollector
from dflash_trainer.observe.sinks import MultiSink, Sink, build_sinks

log = logging.getLogger(__name__)

_WORKER_FIELDS = (
    "steps",
    "items",
    "tokens",
    "padded_tokens",
    "query_tokens",
    "errors",
    "busy_ns",
    "wait_in_ns",
    "wait_out_ns",
)
_QUEUE_FIELDS = ("puts", "gets", "put_wait_ns", "get_wait_ns", "age_ns_sum")


def _snap(obj, fields) -> dict[str, int]:
    return {f: getattr(obj, f, 0) for f in fields}


def _p99(values: list[int]) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(math.ceil(0.99 * len(s))) - 1)])


class Monitor:
    def __init__(
        self,
        cfg: MetricsConfig,
        run_dir: str | Path,
        config_dict: dict | None = None,
        workers=(),
        queues=(),
        composition: Callable[[], dict] | None = None,
        rings: dict | None = None,
        devices=(),
        flops: FlopsModel | None = None,
        rank: int = 0,
        sinks: Sink | None = None,
        nvml: Any = None,
        allocator: Any = None,
        clock: Callable[[], float] = time.monotonic,
        step_clock_ns: Callable[[], int] = time.perf_counter_ns,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.workers = list(workers)
        self.queues = list(queues)
        self.composition = composition
        self.rings = dict(rings or {})
        self.devices = list(devices)
        self.flops = flops
        self.rank = rank
        self._clock = clock
        self._step_clock_ns = step_clock_ns  # the workers' clock for begin_busy/end_busy
        # Only rank 0 writes (one W&B run, one metrics.jsonl); other ranks still compute latest()
        # and the stall detector.
        if sinks is None:
            sinks = build_sinks(cfg, run_dir, config_dict) if rank == 0 else MultiSink([])
        self.sinks = sinks
        self.nvml = nvml if nvml is not None else NvmlCollector(self.devices)
        self.allocator = allocator if allocator is not None else AllocatorCollector(self.devices)
        self.peak = (
            peak_tflops(self.devices[0], cfg.peak_tflops)
            if self.devices
            else float(cfg.peak_tflops)
        )

        now = clock()
        self._t_start = now
        self._last_log_t = now
        self._w_prev = {w.name: _snap(w, _WORKER_FIELDS) for w in self.workers}
        self._w_phase_prev = {w.name: dict(w.phase_ns) for w in self.workers}
        self._q_prev = {q.name: _snap(q.counters, _QUEUE_FIELDS) for q in self.queues}
        self._reset_window()
        self._gpu_prev: dict[str, tuple[float, int]] = {}
        self._ring_last: dict[str, float] = {}
        self._step = 0
        self._n_logs = 0
        self.collector_errors = 0
        self._reported: set[str] = set()
        self._latest: dict[str, float] = {}
        self._log_ms = 0.0
        self._closed = False

    # ------------------------------------------------------------------ per tick (cheap)
    def _reset_window(self) -> None:
        self._ticks = 0
        self._tick_s_sum = 0.0
        self._depth_sum = {q.name: 0 for q in self.queues}
        self._nonempty = {q.name: 0 for q in self.queues}
        self._last_depth = {q.name: 0 for q in self.queues}
        self._ring_sum: dict[str, float] = {}
        self._ring_n: dict[str, int] = {}
        self._ring_per: dict[str, dict[str, list[float]]] = {}  # ring -> name -> [sum, n]
        self._ring_nonfinite = 0

    def _guard(self, what: str, fn: Callable, default=None):
        try:
            return fn()
        except Exception as e:  # collectors are best-effort (observability.md §8.9)
            self.collector_errors += 1
            if what not in self._reported:
                self._reported.add(what)
                log.warning(
                    "monitor collector %s failed (%s: %s); reported once, counted in "
                    "monitor/collector_errors",
                    what,
                    type(e).__name__,
                    e,
                )
            return default

    def _drain_rings(self) -> None:
        for rname, ring in self.rings.items():
            samples = self._guard(f"ring:{rname}", ring.drain, ())
            per = self._ring_per.setdefault(rname, {})
            for step, values in samples:
                if step > self._step:
                    self._step = step
                for k, v in values.items():
                    self._ring_last[k] = v
                    if not math.isfinite(v):  # skipped (non-finite) steps: counted, not averaged
                        self._ring_nonfinite += 1
                        continue
                    self._ring_sum[k] = self._ring_sum.get(k, 0.0) + v
                    self._ring_n[k] = self._ring_n.get(k, 0) + 1
                    acc = per.setdefault(k, [0.0, 0])
                    acc[0] += v
                    acc[1] += 1

    def tick(self, now: float | None = None) -> None:
        """Sample queues, drain rings; every `log_every_s` compute and log. Never blocks."""
        t0 = time.perf_counter()
        now = self._clock() if now is None else now
        for q in self.queues:
            d = self._guard(f"qsize:{q.name}", q.qsize, 0)
            self._depth_sum[q.name] += d
            self._nonempty[q.name] += d > 0
            self._last_depth[q.name] = d
        self._ticks += 1
        self._drain_rings()
        for k, v in self._ring_last.items():  # progress bar sees fresh values between logs
            self._latest[f"drafter/{k}_last"] = v
        self._latest["drafter/step"] = float(self._step)
        for w in self.workers:  # GPU step times: resolve finished event pairs, never wait
            timer = getattr(w, "gpu_timer", None)
            if timer is not None:
                self._guard(f"gpu_timer:{w.name}", timer.resolve)
        self._tick_s_sum += time.perf_counter() - t0
        if now - self._last_log_t >= self.cfg.log_every_s:
            self._log(now)

    # ------------------------------------------------------------------ per log interval
    def _worker_metrics(self, m: dict, dt: float, now: float) -> dict[str, dict[str, float]]:
        """Per-worker rates; returns the deltas per worker (for throughput by role)."""
        deltas: dict[str, dict[str, float]] = {}
        for w in self.workers:
            cur = _snap(w, _WORKER_FIELDS)
            cur["busy_ns"] = w.busy_ns_at(self._step_clock_ns())  # the running step's part too
            prev = self._w_prev[w.name]
            d: dict[str, float] = {f: cur[f] - prev[f] for f in _WORKER_FIELDS}
            self._w_prev[w.name] = cur
            deltas[w.name] = d
            p = f"worker/{w.name}/"
            win_ns = dt * 1e9
            m[p + "steps_total"] = float(cur["steps"])
            m[p + "steps_per_s"] = d["steps"] / dt
            m[p + "items_per_s"] = d["items"] / dt
            m[p + "tokens_per_s"] = d["tokens"] / dt
            m[p + "heartbeat_age_s"] = max(0.0, now - w.last_progress)
            m[p + "busy_frac"] = d["busy_ns"] / win_ns
            m[p + "wait_in_frac"] = d["wait_in_ns"] / win_ns
            m[p + "wait_out_frac"] = d["wait_out_ns"] / win_ns
            m[p + "errors_total"] = float(cur["errors"])
            if d["padded_tokens"] > 0:
                m[p + "padding_eff"] = d["tokens"] / d["padded_tokens"]
            q = f"prof/{w.name}/"
            if d["steps"] > 0:
                n = d["steps"] * 1e6
                m[q + "host_step_ms"] = d["busy_ns"] / n
                m[q + "wait_in_ms"] = d["wait_in_ns"] / n
                m[q + "wait_out_ms"] = d["wait_out_ns"] / n
                phases = dict(w.phase_ns)  # C-level copy: safe against a concurrent insert
                prev_ph = self._w_phase_prev[w.name]
                for ph, ns in phases.items():
                    m[f"{q}{ph}_ms"] = (ns - prev_ph.get(ph, 0)) / n
                self._w_phase_prev[w.name] = phases
            timer = getattr(w, "gpu_timer", None)
            if timer is not None:
                prev_ms, prev_n = self._gpu_prev.get(w.name, (0.0, 0))
                d_ms, d_n = timer.total_ms - prev_ms, timer.count - prev_n
                self._gpu_prev[w.name] = (timer.total_ms, timer.count)
                if d_n > 0:
                    m[q + "gpu_step_ms"] = d_ms / d_n
                    m[q + "gpu_busy_frac"] = d_ms / 1e3 / dt
            for k, v in dict(getattr(w, "gauges", None) or {}).items():
                m[p + k] = float(v)
                if w.role in TRAINING_ROLES:
                    m[f"drafter/{k}"] = float(v)
        return deltas

    def _queue_metrics(self, m: dict, dt: float) -> None:
        for q in self.queues:
            c = q.counters
            cur = _snap(c, _QUEUE_FIELDS)
            prev = self._q_prev[q.name]
            d = {f: cur[f] - prev[f] for f in _QUEUE_FIELDS}
            self._q_prev[q.name] = cur
            p = f"queue/{q.name}/"
            ticks = max(1, self._ticks)
            win_ns = dt * 1e9
            m[p + "depth"] = float(self._last_depth[q.name])
            m[p + "depth_mean"] = self._depth_sum[q.name] / ticks
            m[p + "capacity"] = float(c.capacity)
            m[p + "occupancy"] = self._nonempty[q.name] / ticks
            m[p + "items_per_s"] = d["gets"] / dt
            # A wait is added when the blocking call returns, so a producer blocked across the
            # whole window shows up in the next one.
            producers, consumers = q.producers, q.consumers
            m[p + "producer_blocked_frac"] = d["put_wait_ns"] / (win_ns * producers)
            m[p + "consumer_starved_frac"] = d["get_wait_ns"] / (win_ns * consumers)
            if d["gets"] > 0:
                m[p + "item_age_ms"] = d["age_ns_sum"] / d["gets"] / 1e6
                waits = list(c.get_waits_ns)[-d["gets"] :]  # this window's waits (<= maxlen)
                if waits:
                    m[p + "get_wait_p99_ms"] = _p99(waits) / 1e6

    def _ring_metrics(self, m: dict) -> None:
        for k, s in self._ring_sum.items():
            m[f"drafter/{k}"] = s / self._ring_n[k]
        if len(self.rings) > 1:
            for rname, per in self._ring_per.items():
                for k, (s, n) in per.items():
                    m[f"drafter/{rname}/{k}"] = s / n
        for rname, ring in self.rings.items():
            m[f"worker/{rname}/dropped_metrics_total"] = float(ring.dropped)
        if self.rings:
            m["drafter/step"] = float(self._step)
            m["drafter/nonfinite_values"] = float(self._ring_nonfinite)

    def _throughput(self, m: dict, deltas: dict, dt: float) -> None:
        targets = [w for w in self.workers if w.role == "target"]
        drafters = [w for w in self.workers if w.role in TRAINING_ROLES]

        def total(workers, field):
            return sum(deltas[w.name][field] for w in workers if w.name in deltas)

        n_target, n_drafter = len(targets), len(drafters)
        if n_target:
            m["tput/target_tok_s"] = total(targets, "tokens") / dt
        if n_drafter:
            m["tput/drafter_tok_s"] = total(drafters, "tokens") / dt
            m["tput/drafter_steps_s"] = total(drafters, "steps") / dt
            m["tput/drafter_query_tok_s"] = total(drafters, "query_tokens") / dt
        if m.get("tput/drafter_tok_s"):
            m["tput/balance"] = m.get("tput/target_tok_s", 0.0) / m["tput/drafter_tok_s"]
        if self.flops is None:
            return
        seq = m.get("batch/len_mean")  # attention term uses the observed mean length if known
        if n_target:
            tfl = m["tput/target_tok_s"] * self.flops.target_flops_per_token(seq) / 1e12
            m["tput/target_tflops"] = tfl
            if self.peak > 0:
                m["tput/mfu_target"] = 100.0 * tfl / (n_target * self.peak)
        # Drafter FLOPs need query-token counts; omitted when the worker does not report them.
        if n_drafter and sum(w.query_tokens for w in drafters):
            tfl = (
                m["tput/drafter_query_tok_s"] * self.flops.drafter_flops_per_query(seq)
                + m["tput/drafter_tok_s"] * self.flops.drafter_flops_per_context_token()
            ) / 1e12
            m["tput/drafter_tflops"] = tfl
            if self.peak > 0:
                m["tput/mfu_drafter"] = 100.0 * tfl / (n_drafter * self.peak)

    def _composition(self, m: dict) -> None:
        comp = self._guard("composition", self.composition, None) if self.composition else None
        for k, v in (comp or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                m[k if k.startswith("batch/") else f"batch/{k}"] = float(v)

    def _log(self, now: float) -> None:
        t0 = time.perf_counter()
        dt = max(now - self._last_log_t, 1e-9)
        m: dict[str, float] = {"time/elapsed_s": now - self._t_start}
        deltas = self._guard("workers", lambda: self._worker_metrics(m, dt, now), {})
        self._guard("queues", lambda: self._queue_metrics(m, dt))
        self._composition(m)
        self._ring_metrics(m)
        self._guard("throughput", lambda: self._throughput(m, deltas, dt))
        t1 = time.perf_counter()
        gpu = self._guard("nvml", lambda: self.nvml.collect(now), {}) or {}
        m.update(gpu)
        m.update(self._guard("allocator", lambda: self.allocator.collect(now, gpu), {}) or {})
        t2 = time.perf_counter()
        m["prof/monitor/tick_ms"] = 1e3 * self._tick_s_sum / max(1, self._ticks)
        m["prof/monitor/nvml_ms"] = 1e3 * (t2 - t1)
        m["prof/monitor/log_ms"] = self._log_ms  # previous log call (this one is not done)
        m["monitor/collector_errors"] = float(self.collector_errors)
        m["monitor/sink_errors"] = float(getattr(self.sinks, "errors", 0))

        # Step = latest drafter optimizer step seen in a ring; else finished drafter steps; else
        # the log count (pipelines without a drafter).
        drafters = [w for w in self.workers if w.role in TRAINING_ROLES]
        if not self.rings and drafters:
            self._step = max(self._step, sum(w.steps for w in drafters))
        step = self._step if (self.rings or drafters) else self._n_logs
        self.sinks.log(m, step)
        self._n_logs += 1
        self._latest.update(m)
        self._last_log_t = now
        self._reset_window()
        self._log_ms = 1e3 * (time.perf_counter() - t0)

    # ------------------------------------------------------------------ public helpers
    def latest(self) -> dict[str, float]:
        return dict(self._latest)

    def stalled(self, timeout_s: float, now: float | None = None) -> list[str]:
        """Workers whose last heartbeat is older than timeout_s (the supervisor aborts on it)."""
        now = self._clock() if now is None else now
        return [w.name for w in self.workers if now - w.last_progress > timeout_s]

    def log_event(self, record: dict[str, Any], step: int | None = None) -> None:
        """One-off record (eval results, checkpoint saved): Python numbers/strings only."""
        for k, v in record.items():
            if isinstance(v, torch.Tensor):
                raise TypeError(
                    f"log_event({k}=<tensor>): convert to a Python number where it is "
                    "produced; a tensor here would sync the device"
                )
        step = self._step if step is None else step
        self.sinks.event(dict(record), step)

    def close(self, now: float | None = None) -> None:
        """Flush the last partial window, finish sinks (each with its own timeout)."""
        if self._closed:
            return
        self._closed = True
        now = self._clock() if now is None else now
        try:
            if now > self._last_log_t:
                self._drain_rings()
                self._log(now)
        finally:
            self.sinks.close()
            self._guard("nvml-close", getattr(self.nvml, "close", lambda: None))
