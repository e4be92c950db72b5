"""Sinks: JSONL (always on, survives write errors), TensorBoard, W&B offline (fast, no network,
no secrets), console line, MultiSink isolation, build_sinks."""

from __future__ import annotations

import errno
import json
import logging
import sys
import time

import pytest

from dflash_trainer.config import MetricsConfig
from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.observe.monitor import Monitor
from dflash_trainer.observe.sinks import (
    ConsoleSink,
    JsonlSink,
    MultiSink,
    Sink,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    redact,
)


def test_redact_nested():
    cfg = {
        "target": {"hf_token": "t", "name": "m"},
        "API_KEY": "k",
        "list": [{"password": "p"}],
        "secret_path": "s",
        "keep": 1,
    }
    assert redact(cfg) == {
        "target": {"hf_token": "***", "name": "m"},
        "API_KEY": "***",
        "list": [{"password": "***"}],
        "secret_path": "***",
        "keep": 1,
    }
    assert cfg["API_KEY"] == "k"  # input untouched


def test_jsonl_roundtrip_and_events(tmp_path):
    s = JsonlSink(tmp_path)
    s.log({"drafter/loss": 1.5, "x": float("nan")}, 3)
    s.event({"eval/accept_len": 2.0, "what": "eval"}, 4)
    # Line-buffered + flushed: readable before close.
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "metrics" and lines[0]["step"] == 3
    assert lines[0]["drafter/loss"] == 1.5
    assert lines[0]["x"] != lines[0]["x"]  # NaN survives the round trip
    assert lines[1] == {**lines[1], "kind": "event", "step": 4, "what": "eval"}
    s.close()
    s2 = JsonlSink(tmp_path)  # appends (resume)
    s2.log({"a": 1.0}, 5)
    s2.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


class _FullDisk:
    def write(self, _):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def test_jsonl_write_error_reported_once_and_counted(tmp_path, caplog):
    s = JsonlSink(tmp_path)
    s._f = _FullDisk()
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            s.log({"a": 1.0}, i)  # never raises
    assert s.errors == 5
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    s.close()


class _Boom(Sink):
    name = "boom"

    def log(self, metrics, step):
        raise RuntimeError("boom")

    def close(self):
        raise RuntimeError("boom close")


class _Rec(Sink):
    def __init__(self):
        self.got, self.closed = [], False

    def log(self, metrics, step):
        self.got.append(step)

    def close(self):
        self.closed = True


def test_multisink_isolates_failures(caplog):
    rec = _Rec()
    ms = MultiSink([_Boom(), rec])
    with caplog.at_level(logging.WARNING):
        ms.log({"a": 1.0}, 1)
        ms.log({"a": 1.0}, 2)
        ms.close()
    assert rec.got == [1, 2] and rec.closed
    assert ms.errors == 3
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1


def test_tensorboard_sink_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    s = TensorBoardSink(tmp_path)
    for i in range(3):
        s.log({"drafter/loss": 1.0 / (i + 1)}, i)
    s.event({"eval/accept_len": 2.5, "what": "eval"}, 3)
    s.close()
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 100
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("drafter/loss")] == [0, 1, 2]
    assert acc.Scalars("eval/accept_len")[0].value == 2.5


def test_tensorboard_missing_package_disables(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    with caplog.at_level(logging.WARNING):
        s = TensorBoardSink(tmp_path)
        s.log({"a": 1.0}, 0)
        s.close()
    assert any("TensorBoard disabled" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "tb").exists()


def test_console_sink_line(caplog):
    s = ConsoleSink()
    with caplog.at_level(logging.INFO, logger="dflash_trainer.metrics"):
        s.log(
            {
                "drafter/loss": 1.23456,
                "drafter/accept_len": 3.5,
                "tput/target_tok_s": 12345.6,
                "tput/drafter_tok_s": 6000.0,
                "queue/features/depth": 3.0,
                "queue/work/depth": 0.0,
            },
            42,
        )
    msg = caplog.records[-1].getMessage()
    assert msg == (
        "step 42 | loss 1.2346 | accept_len 3.50 | target 12346 tok/s | drafter 6000 "
        "tok/s | queues features=3 work=0"
    )


@pytest.fixture
def offline_wandb_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run dir holds it (see the test below)
    monkeypatch.setenv("WANDB_API_KEY", "secret123")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Anything that tried the network would hit a closed local port instead of the internet.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    return tmp_path


def _grep_tree(root, needles):
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            hits += [(str(p), n) for n in needles if n.encode() in data]
    return hits


def test_fake_run_offline_wandb_no_secrets(offline_wandb_env):
    """A fake run through Monitor + build_sinks (jsonl, TensorBoard, W&B offline, console): the
    W&B offline run dir is produced quickly, and no secret appears anywhere in the run dir."""
    run_dir = offline_wandb_env / "run"
    config = {
        "run_dir": str(run_dir),
        "target": {"model": "m", "hf_token": "hf_tok_XYZ789"},
        "metrics": {"wandb": "offline", "wandb_api_key": "secret123"},
    }
    cfg = MetricsConfig(log_every_s=1.0, wandb="offline", tensorboard=True, console=True)
    t0 = time.perf_counter()
    w = WorkerCounters("drafter0", "drafter")
    mon = Monitor(cfg, run_dir, config_dict=config, workers=[w])
    for i in range(1, 4):
        w.steps, w.tokens = 10 * i, 1000 * i
        mon.tick(now=mon._t_start + i)
    mon.log_event({"eval/accept_len": 3.0, "kind_of": "eval"}, step=30)
    mon.close(now=mon._t_start + 4)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed  # ~3-5 s on this machine
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 500
    assert b"drafter0" in runs[0].read_bytes()  # the metrics reached the W&B log
    assert (run_dir / "metrics.jsonl").stat().st_size > 0
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert _grep_tree(offline_wandb_env, ["secret123", "hf_tok_XYZ789"]) == []


def test_wandb_dir_env_is_honoured(offline_wandb_env, monkeypatch):
    """WANDB_DIR, wandb's own convention, puts the W&B files there instead of the run dir."""
    elsewhere = offline_wandb_env / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    run_dir = offline_wandb_env / "run"
    ms = build_sinks(MetricsConfig(wandb="offline", tensorboard=False, console=False), run_dir)
    ms.close()
    assert len(list((elsewhere / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert not (run_dir / "wandb").exists()


def test_wandb_missing_package_disables(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with caplog.at_level(logging.WARNING):
        s = WandbSink(tmp_path, mode="offline")
        s.log({"a": 1.0}, 1)
        s.close()
    assert any("W&B disabled" in r.getMessage() for r in caplog.records)


class _FakeRun:
    def __init__(self, finish_s=0.0):
        self.finish_s, self.logged, self.dir = finish_s, [], "x"

    def define_metric(self, *a, **k):
        pass

    def log(self, d):
        self.logged.append(d)

    def finish(self):
        time.sleep(self.finish_s)


class _FakeWandb:
    """wandb stand-in: online init fails (no network), offline works."""

    def __init__(self, finish_s=0.0):
        self.modes, self.finish_s = [], finish_s

    class Settings:
        def __init__(self, **kw):
            self.kw = kw

    def teardown(self):
        self.torn_down = True

    def init(self, mode, settings, **kw):
        self.modes.append((mode, settings.kw["init_timeout"]))
        if mode == "online":
            raise TimeoutError("Timed out while retrying")
        self.run = _FakeRun(self.finish_s)
        return self.run


def test_wandb_online_falls_back_and_finish_times_out(tmp_path, monkeypatch):
    fake = _FakeWandb(finish_s=5.0)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    s = WandbSink(tmp_path, mode="online", init_timeout_s=7.0, finish_timeout_s=0.2)
    assert fake.modes == [("online", 7.0), ("offline", 7.0)] and s.mode == "offline"
    s.log({"a": 1.0}, 12)
    assert fake.run.logged == [{"a": 1.0, "train/step": 12}]
    t0 = time.perf_counter()
    s.close()  # finish hangs 5 s: we wait 0.2 s
    assert time.perf_counter() - t0 < 2.0


def test_build_sinks_respects_config(tmp_path):
    cfg = MetricsConfig(wandb="off", tensorboard=False, console=False)
    ms = build_sinks(cfg, tmp_path)
    assert [type(s) for s in ms.sinks] == [JsonlSink]
    ms.close()
    cfg = MetricsConfig(wandb="off", tensorboard=False, console=True)
    assert [type(s) for s in build_sinks(cfg, tmp_path).sinks] == [JsonlSink, ConsoleSink]
