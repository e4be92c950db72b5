"""Where metrics go: JSONL (always), TensorBoard, Weights & Biases, console.

Only the monitor thread calls a sink, and only with flat dicts of Python floats (never tensors:
every tracker converts tensors with `.item()`/`.cpu()`, i.e. a device sync; observability.md §8.1).
Every sink is best-effort: a failure (full disk, missing package, no network) is reported once,
counted, and the sink disables itself or keeps trying, but training never stops because of it.
`MultiSink` additionally isolates sinks from each other's exceptions.

W&B specifics (observability.md §1.2-1.3, embedded-default.md §4): offline by default; online
init gets a short `init_timeout` and falls back to offline; `finish()` runs in a daemon thread
joined with a timeout (its default waits for the full upload forever); the config is logged with
secrets redacted; W&B's own console capture is off (it would copy our stdout, secrets included,
into the run dir). W&B's `log` is not thread-safe, which is fine since one thread calls it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from dflash_trainer.config import MetricsConfig
from dflash_trainer.layout import RunLayout

log = logging.getLogger(__name__)

SECRET_MARKERS = ("key", "token", "secret", "password")
REDACTED = "***"
STEP_KEY = "train/step"


def redact(obj: Any) -> Any:
    """Deep copy of a config dict with values under secret-looking keys replaced."""
    if isinstance(obj, dict):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and any(m in k.lower() for m in SECRET_MARKERS)
                else redact(v)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


class Sink:
    """Interface: `log` a flat dict of floats at a step, record a one-off `event`, `close`."""

    name = "sink"

    @property
    def errors(self) -> int:
        warn = getattr(self, "_warn", None)
        return warn.errors if warn is not None else 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def event(self, record: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class _WarnOnce:
    def __init__(self, name: str):
        self.name = name
        self.errors = 0

    def __call__(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning(
                "metrics sink %s: %s failed (%s: %s); further errors are counted, "
                "training continues",
                self.name,
                what,
                type(exc).__name__,
                exc,
            )


class JsonlSink(Sink):
    """`{run_dir}/metrics.jsonl`: one JSON object per line, `kind` = "metrics" or "event"."""

    name = "jsonl"

    def __init__(self, run_dir: str | Path):
        self.path = RunLayout.of(run_dir).metrics
        self._warn = _WarnOnce(self.name)
        self._f = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # line buffered
        except OSError as e:
            self._warn("open", e)

    def _write(self, record: dict) -> None:
        if self._f is None:
            return
        try:
            # NaN/inf are written as JSON's NaN/Infinity extensions, which Python reads back.
            self._f.write(json.dumps(record, default=str) + "\n")
            self._f.flush()
        except (OSError, ValueError) as e:  # full disk, closed file
            self._warn("write", e)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._write({"kind": "metrics", "step": step, "wall": time.time(), **metrics})

    def event(self, record: dict[str, Any], step: int) -> None:
        self._write({"kind": "event", "step": step, "wall": time.time(), **record})

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as e:
                self._warn("close", e)
            self._f = None


class TensorBoardSink(Sink):
    """Event files in `{run_dir}/tb` via torch.utils.tensorboard (needs `tensorboard`)."""

    name = "tensorboard"

    def __init__(self, run_dir: str | Path):
        self._warn = _WarnOnce(self.name)
        self._w = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._w = SummaryWriter(log_dir=str(RunLayout.of(run_dir).tensorboard))
        except Exception as e:  # ModuleNotFoundError: No module named 'tensorboard'
            log.warning("TensorBoard disabled (%s); `pip install tensorboard` to enable it", e)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._w is None:
            return
        try:
            for k, v in metrics.items():
                self._w.add_scalar(k, v, global_step=step)
        except Exception as e:
            self._warn("log", e)

    def event(self, record: dict[str, Any], step: int) -> None:
        if self._w is None:
            return
        try:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._w.add_scalar(k, v, global_step=step)
        except Exception as e:
            self._warn("event", e)

    def close(self) -> None:
        if self._w is not None:
            try:
                self._w.close()
            except Exception as e:
                self._warn("close", e)
            self._w = None


def _run_with_timeout(fn, timeout_s: float, what: str) -> bool:
    """Run fn in a daemon thread; give up waiting after timeout_s (the thread is abandoned)."""
    err: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:  # reported below
            err.append(e)

    t = threading.Thread(target=target, name=f"metrics-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("%s did not finish within %.0f s; continuing without waiting", what, timeout_s)
        return False
    if err:
        raise err[0]
    return True


WANDB_ID_FILE = "wandb-run-id"  # in the run directory: a resumed run continues this W&B run
DEFAULT_PROJECT = "dflash-trainer"
# WANDB_MODE values (wandb's own spellings) -> our modes
_ENV_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline"}


def wandb_mode(configured: str) -> str:
    """The W&B mode of a run: WANDB_MODE=disabled always wins (off); an explicit
    metrics.wandb next; "auto" follows WANDB_MODE, else offline."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env == "disabled":
        return "off"
    if configured != "auto":
        return configured
    return _ENV_MODES.get(env, "offline")


def wandb_init_kwargs(metrics_cfg: MetricsConfig, run_dir: Path) -> dict:
    """What wandb.init gets besides mode/dir/config: only what the user configured, so that
    WANDB_PROJECT / WANDB_ENTITY / WANDB_RUN_GROUP / WANDB_TAGS apply otherwise (wandb reads
    them itself); our project default only when neither is set. The run id is kept in
    `run_dir/wandb-run-id` with resume="allow": a resumed run (same run_dir) continues the same
    W&B run. WANDB_RUN_ID, when set, is the user's choice and is left to wandb."""
    kw: dict[str, Any] = {}
    project = metrics_cfg.wandb_project
    if project:
        kw["project"] = project
    elif not os.environ.get("WANDB_PROJECT"):
        kw["project"] = DEFAULT_PROJECT
    for field, key in (("wandb_entity", "entity"), ("wandb_group", "group")):
        value = getattr(metrics_cfg, field)  # a field by name: MetricsConfig has both
        if value:
            kw[key] = value
    tags = list(metrics_cfg.wandb_tags)
    if tags:
        kw["tags"] = tags
    if not os.environ.get("WANDB_RUN_ID"):
        kw["id"] = run_id(run_dir)
        kw["resume"] = "allow"
    return kw


def run_id(run_dir: Path) -> str:
    """This run directory's W&B run id: read from `wandb-run-id`, or made and written there."""
    path = Path(run_dir) / WANDB_ID_FILE
    try:
        rid = path.read_text(encoding="utf-8").strip()
        if rid:
            return rid
    except OSError:
        pass
    import secrets

    rid = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rid + "\n", encoding="utf-8")
    return rid


class WandbSink(Sink):
    """Weights & Biases run in `{run_dir}/wandb` (`$WANDB_DIR/wandb` when that is set); mode
    "offline" (default) or "online". `init_kwargs` go to wandb.init as they are (build_sinks:
    wandb_init_kwargs)."""

    name = "wandb"

    def __init__(
        self,
        run_dir: str | Path,
        mode: str = "offline",
        project: str | None = DEFAULT_PROJECT,
        config: dict | None = None,
        run_name: str | None = None,
        init_timeout_s: float = 30.0,
        finish_timeout_s: float = 30.0,
        init_kwargs: dict | None = None,
    ):
        self._warn = _WarnOnce(self.name)
        self._run = None
        self.mode = mode
        self.finish_timeout_s = finish_timeout_s
        try:
            import wandb
        except Exception as e:
            log.warning("W&B disabled (%s); `pip install wandb` to enable it", e)
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        kwargs = dict(
            # WANDB_DIR, when set, is the user's choice (wandb reads it when `dir` is not given)
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            name=run_name or os.environ.get("WANDB_NAME") or run_dir.name,
            config=redact(config or {}),
        )
        if project:
            kwargs["project"] = project
        kwargs.update(init_kwargs or {})
        modes = [mode] if mode != "online" else ["online", "offline"]
        for m in modes:
            try:
                settings = wandb.Settings(init_timeout=init_timeout_s, console="off")
                self._run = wandb.init(
                    mode=m,  # type: ignore[arg-type]  # a str of wandb's Literal (config choices)
                    settings=settings,
                    reinit="create_new",
                    **kwargs,
                )
                self.mode = m
                break
            except Exception as e:
                log.warning(
                    "W&B init (mode=%s) failed: %s%s",
                    m,
                    e,
                    "; falling back to offline (upload later with `wandb sync`)"
                    if m == "online"
                    else "; W&B disabled",
                )
        if self._run is not None:
            try:
                # One row per monitor log; charts use the drafter step as their x-axis. We never
                # pass `step=` to run.log, so a smaller step can never make W&B drop a row.
                self._run.define_metric(STEP_KEY)
                self._run.define_metric("*", step_metric=STEP_KEY)
            except Exception as e:
                self._warn("define_metric", e)

    @property
    def run_dir(self) -> str | None:
        return None if self._run is None else self._run.dir

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._run is None:
            return
        try:
            self._run.log({**metrics, STEP_KEY: step})
        except Exception as e:
            self._warn("log", e)

    def event(self, record: dict[str, Any], step: int) -> None:
        if self._run is None:
            return
        nums = {
            k: v
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if nums:
            self.log(nums, step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return

        def finish():
            run.finish()
            # wandb 0.31 offline: finish() can return before wandb-core has written the last
            # records to run-<id>.wandb (seen: a 7-byte file right after finish). teardown()
            # shuts the service down after flushing. Only the monitor uses W&B in this process.
            import wandb

            wandb.teardown()

        try:
            _run_with_timeout(finish, self.finish_timeout_s, "wandb finish")
        except Exception as e:
            self._warn("finish", e)


def _fmt(v: float | None, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


class ConsoleSink(Sink):
    """One summary line per log: step, loss, acceptance length, tok/s, queue depths."""

    name = "console"

    def __init__(self, logger: logging.Logger | None = None):
        self._log = logger or logging.getLogger("dflash_trainer.metrics")

    def log(self, metrics: dict[str, float], step: int) -> None:
        g = metrics.get
        depths = " ".join(
            f"{k[6:-6]}={int(v)}"
            for k, v in metrics.items()
            if k.startswith("queue/") and k.endswith("/depth")
        )
        self._log.info(
            "step %d | loss %s | accept_len %s | target %s tok/s | drafter %s tok/s | queues %s",
            step,
            _fmt(g("drafter/loss"), ".4f"),
            _fmt(g("drafter/accept_len"), ".2f"),
            _fmt(g("tput/target_tok_s"), ".0f"),
            _fmt(g("tput/drafter_tok_s"), ".0f"),
            depths or "-",
        )

    def event(self, record: dict[str, Any], step: int) -> None:
        items = " ".join(
            f"{k}={_fmt(v, '.4g') if isinstance(v, float) else v}" for k, v in record.items()
        )
        self._log.info("step %d | %s", step, items)


class MultiSink(Sink):
    """Fan-out that isolates failures: one sink raising never affects the others."""

    name = "multi"

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)
        self._warns = {id(s): _WarnOnce(getattr(s, "name", type(s).__name__)) for s in self.sinks}

    @property
    def errors(self) -> int:
        return sum(w.errors for w in self._warns.values()) + sum(
            getattr(s, "errors", 0) for s in self.sinks
        )

    def _each(self, what: str, *args) -> None:
        for s in self.sinks:
            try:
                getattr(s, what)(*args)
            except Exception as e:
                self._warns[id(s)](what, e)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._each("log", metrics, step)

    def event(self, record: dict[str, Any], step: int) -> None:
        self._each("event", record, step)

    def close(self) -> None:
        self._each("close")


def build_sinks(
    metrics_cfg: MetricsConfig, run_dir: str | Path, config_dict: dict | None = None
) -> MultiSink:
    """JSONL always; TensorBoard / W&B / console per `MetricsConfig`."""
    sinks: list[Sink] = [JsonlSink(run_dir)]
    if metrics_cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    mode = wandb_mode(metrics_cfg.wandb)
    if mode != "off":
        sinks.append(
            WandbSink(
                run_dir,
                mode=mode,
                project=None,
                init_kwargs=wandb_init_kwargs(metrics_cfg, Path(run_dir)),
                config=config_dict,
                init_timeout_s=metrics_cfg.wandb_init_timeout_s,
                finish_timeout_s=metrics_cfg.wandb_finish_timeout_s,
            )
        )
    if metrics_cfg.console:
        sinks.append(ConsoleSink())
    return MultiSink(sinks)


def append_to_run(
    metrics_cfg: MetricsConfig, run_dir: str | Path, record: dict[str, Any], step: int
) -> str:
    """One event `record` into the sinks of the run in `run_dir` (metrics.jsonl, TensorBoard,
    W&B as configured; not the console) at `step`, when that run has metrics; else nowhere.
    Returns where it went."""
    layout = RunLayout(Path(run_dir))
    if not layout.metrics.is_file():
        return "eval.json only (no RUN_DIR/metrics.jsonl)"
    sinks = build_sinks(dataclasses.replace(metrics_cfg, console=False), run_dir)
    try:
        sinks.event(record, step)
    finally:
        sinks.close()
    return str(layout.metrics)
