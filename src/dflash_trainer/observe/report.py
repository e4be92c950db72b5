"""`dflash-trainer report RUN_DIR`: PNG plots + a self-contained report.html from metrics.jsonl.

Plots whatever series exist; a missing series is skipped with a note in the HTML, never a crash
(a run without GPUs has no memory plot, an early crash may have no loss yet).
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

from dflash_trainer.errors import UserError
from dflash_trainer.layout import RunLayout

log = logging.getLogger(__name__)

_ACC_RE = re.compile(r"^drafter/acc[_/]?(\d+)$")
# eval/tau, eval/tau/<source>, eval/tau_sim, eval/tau_sim/<source> (run/evaluation.py)
_TAU_RE = re.compile(r"^eval/(tau|tau_sim)(?:/([^/]+))?$")


def _acc_pos(key: str) -> int:
    """k of a drafter/acc_k key (one `_keys` matched with _ACC_RE)."""
    m = _ACC_RE.match(key)
    assert m is not None, key
    return int(m[1])


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(metrics records, event records); unreadable lines (a torn last line) are skipped."""
    rows: list[dict] = []
    events: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            (events if rec.get("kind") == "event" else rows).append(rec)
    return rows, events


def _series(rows: list[dict], key: str, x: str = "time/elapsed_s") -> tuple[list, list]:
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r.get(x, i))
            ys.append(v)
    return xs, ys


def tau_by_source(record: dict) -> dict[str, dict[str, float]]:
    """{"all" or source: {"tau": .., "tau_sim": ..}} from one evaluation record; "all" first,
    then the sources in order; non-numbers and non-finite values are left out."""
    out: dict[str, dict[str, float]] = {}
    for k, v in record.items():
        m = _TAU_RE.match(k)
        if m and isinstance(v, (int, float)) and math.isfinite(v):
            out.setdefault(m[2] or "all", {})[m[1]] = float(v)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "all", kv[0])))


def _keys(rows: list[dict], pattern: str) -> list[str]:
    rx = re.compile(pattern)
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            if rx.match(k):
                seen[k] = None
    return sorted(seen)


class _Report:
    def __init__(self, rows, events, out_dir: Path):
        try:
            import matplotlib
        except ImportError as e:
            raise UserError(
                "`dflash-trainer report` needs matplotlib: "
                "pip install 'dflash-trainer[metrics]' (or matplotlib)"
            ) from e
        matplotlib.use("Agg")  # no display; must precede pyplot import
        import matplotlib.pyplot as plt

        self.plt = plt
        self.rows, self.events, self.out = rows, events, out_dir
        self.sections: list[tuple[str, str | None, str]] = []  # (title, png name or None, note)

    def lines(
        self,
        fname: str,
        title: str,
        panels: list[tuple[str, list[str], str]],
        x: str = "time/elapsed_s",
        xlabel: str = "elapsed (s)",
        rows=None,
        note: str = "",
    ) -> None:
        """One figure, one subplot per panel (ylabel, keys, key prefix to strip from labels)."""
        rows = self.rows if rows is None else rows
        panels = [
            (yl, [k for k in keys if _series(rows, k, x)[1]], strip) for yl, keys, strip in panels
        ]
        panels = [p for p in panels if p[1]]
        if not panels:
            self.sections.append((title, None, "no data in metrics.jsonl for this plot"))
            return
        fig, axes = self.plt.subplots(
            len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False, sharex=True
        )
        for ax, (ylabel, keys, strip) in zip(axes[:, 0], panels):
            for k in keys:
                xs, ys = _series(rows, k, x)
                ax.plot(
                    xs,
                    ys,
                    label=k.replace(strip, "") if strip else k,
                    lw=1.4,
                    marker="o" if len(xs) < 30 else None,
                    ms=3,
                )
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
        axes[-1, 0].set_xlabel(xlabel)
        axes[0, 0].set_title(title)
        self._save(fig, fname, title, note)

    def _save(self, fig, fname: str, title: str, note: str = "") -> None:
        fig.tight_layout()
        fig.savefig(self.out / fname, dpi=90)
        self.plt.close(fig)
        self.sections.append((title, fname, note))

    def accuracy(self, fname: str, window: int) -> None:
        title = "Per-position accuracy (last window)"
        keys = sorted(_keys(self.rows, _ACC_RE.pattern), key=_acc_pos)
        last = [r for r in self.rows if any(k in r for k in keys)][-window:]
        if not keys or not last:
            self.sections.append((title, None, "no drafter/acc_{k} series in metrics.jsonl"))
            return
        pos, means = [], []
        for k in keys:
            vals = [
                r[k] for r in last if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
            ]
            if vals:
                pos.append(_acc_pos(k))
                means.append(sum(vals) / len(vals))
        fig, ax = self.plt.subplots(figsize=(9, 3.5))
        ax.bar(pos, means, color="tab:blue")
        ax.set_xlabel("position in block")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.set_xticks(pos)
        ax.grid(alpha=0.3, axis="y")
        ax.set_title(f"{title}: mean of the last {len(last)} log records")
        self._save(fig, fname, title)

    def grouped_bars(
        self, fname: str, title: str, groups: dict[str, dict[str, float]], ylabel: str, note=""
    ) -> None:
        """One bar chart: a group of bars per key of `groups`, one bar per series in it."""
        series = sorted({name for g in groups.values() for name in g})
        if not series:
            self.sections.append((title, None, "no data in metrics.jsonl for this plot"))
            return
        width = 0.8 / len(series)
        fig, ax = self.plt.subplots(figsize=(9, 3.5))
        for i, name in enumerate(series):
            xs = [j + i * width for j, g in enumerate(groups.values()) if name in g]
            ys = [g[name] for g in groups.values() if name in g]
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))])
        ax.set_xticklabels(list(groups))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="best")
        ax.set_title(title)
        self._save(fig, fname, title, note)

    def html(self, run_dir: Path) -> str:
        parts = [
            f"<!doctype html><html><head><meta charset='utf-8'><title>dflash-trainer report: "
            f"{html.escape(run_dir.name)}</title></head><body style='font-family:sans-serif'>",
            f"<h1>Run {html.escape(str(run_dir))}</h1>",
            f"<p>{len(self.rows)} metric records, {len(self.events)} events.</p>",
        ]
        for title, fname, note in self.sections:
            parts.append(f"<h2>{html.escape(title)}</h2>")
            if fname is None:
                parts.append(f"<p><i>skipped: {html.escape(note)}</i></p>")
                continue
            b64 = base64.b64encode((self.out / fname).read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(fname)}' src='data:image/png;base64,{b64}'>")
            if note:
                parts.append(f"<p>{html.escape(note)}</p>")
        if self.events:
            parts.append("<h2>Events</h2><ul>")
            for e in self.events[-200:]:
                body = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("kind", "wall"))
                parts.append(f"<li>{html.escape(body)}</li>")
            parts.append("</ul>")
        parts.append("</body></html>")
        return "\n".join(parts)


def _stage_charts(r: _Report, k: Callable[[str], list[str]]) -> None:
    """Throughput per stage; queue depth and starvation."""
    r.lines(
        "throughput.png",
        "Throughput per stage",
        [
            ("tokens/s", k(r"^worker/[^/]+/tokens_per_s$"), "worker/"),
            ("pipeline tok/s", k(r"^tput/(target|drafter)_tok_s$"), "tput/"),
            ("TFLOP/s", k(r"^tput/\w+_tflops$"), "tput/"),
        ],
    )
    r.lines(
        "queues.png",
        "Queue depth and starvation",
        [
            (
                "depth (items)",
                k(r"^queue/[^/]+/depth_mean$") or k(r"^queue/[^/]+/depth$"),
                "queue/",
            ),
            ("consumer starved", k(r"^queue/[^/]+/consumer_starved_frac$"), "queue/"),
            ("producer blocked", k(r"^queue/[^/]+/producer_blocked_frac$"), "queue/"),
        ],
    )


def _training_charts(r: _Report, k: Callable[[str], list[str]], num_rows: int) -> None:
    """Loss, optimizer, per-position accuracy."""
    r.lines(
        "loss.png",
        "Drafter loss",
        [("loss", k(r"^drafter/loss$"), "")],
        x="step",
        xlabel="drafter step",
    )
    r.lines(
        "optimizer.png",
        "Optimizer: learning rate, gradient norm, non-finite steps",
        [
            ("learning rate", k(r"^drafter/lr$"), "drafter/"),
            ("grad norm", k(r"^drafter/grad_norm$"), "drafter/"),
            ("non-finite steps", k(r"^drafter/(skipped_total|consecutive_skips)$"), "drafter/"),
        ],
        x="step",
        xlabel="drafter step",
        note="lr: the learning rate when the record was logged. grad_norm: the gradient norm "
        "before clipping (optim.grad_clip), mean of the finite ones over the log window. "
        "Non-finite steps: optimizer steps whose loss or gradient was not finite, their "
        "update dropped on device; the total so far and the current run of them "
        "(optim.max_consecutive_skips stops training).",
    )
    window = max(1, num_rows // 10)
    r.accuracy("accuracy.png", window)


def _eval_charts(
    r: _Report, k: Callable[[str], list[str]], rows: list[dict], events: list[dict]
) -> None:
    """Acceptance length (training estimate vs decoding), held-out tau during and after training."""
    # Eval results arrive as events (monitor.log_event) and share the step axis. Training's
    # simulated acceptance and the measured tau of real decoding on held-out prompts on one
    # chart: the train-vs-serving check (a wide gap = a train/inference mismatch or overfitting).
    r.lines(
        "accept_len.png",
        "Acceptance length: training estimate vs held-out decoding",
        [
            (
                "tokens",
                k(r"^drafter/accept_len$") + _keys(events, r"^eval/(tau|tau_sim|best_tau)$"),
                "",
            )
        ],
        x="step",
        xlabel="drafter step",
        rows=rows + events,
        note="drafter/accept_len: expected accepted length per block on training batches "
        "(correct-prefix length + 1, computed on device). eval/tau: tokens per target "
        "forward when the drafter actually decodes held-out prompts (validation prompts "
        "during training, every reported held-out prompt at the end). eval/tau_sim: the "
        "draft-verify loop replayed on the held-out responses, aggregated like tau; it "
        "should sit on eval/tau. A training estimate far above tau means the drafter does "
        "not generalise or training and inference disagree.",
    )
    # Held-out tau per source: periodic evaluation on the validation prompts over training, and
    # the end-of-run evaluation on every reported prompt (eval/set = heldout).
    evals = [e for e in events if "eval/tau" in e]
    periodic = [e for e in evals if e.get("eval/set") != "heldout"]
    r.lines(
        "heldout_tau.png",
        "Held-out tau during training (validation prompts)",
        [
            ("tau", _keys(periodic, r"^eval/tau(/[^/]+)?$"), "eval/"),
            ("tau_sim", _keys(periodic, r"^eval/tau_sim(/[^/]+)?$"), "eval/"),
        ],
        x="step",
        xlabel="drafter step",
        rows=periodic,
        note="Periodic evaluation (eval.every_steps) on a fixed subset of the validation "
        "prompts, overall and per source: measured tau (tokens per target forward) and "
        "tau_sim (the loop replayed on the held-out responses). best/ is the drafter with "
        "the highest tau here.",
    )
    final = [e for e in evals if e.get("eval/set") == "heldout"]
    last = final[-1] if final else {}
    r.grouped_bars(
        "final_tau.png",
        "Held-out tau at the end of the run, per source",
        tau_by_source(last),
        "tokens per target forward",
        note=f"Every reported held-out prompt ({last.get('eval/prompts', '?')}), decoded in "
        f"{last.get('eval/dtype', '?')} at step {last.get('eval/step', last.get('step', '?'))}; "
        "these prompts never select anything."
        if last
        else "",
    )


def _resource_charts(r: _Report, k: Callable[[str], list[str]]) -> None:
    """Padding efficiency; memory over time."""
    r.lines(
        "padding.png",
        "Padding efficiency",
        [("real / padded", k(r"^batch/padding_eff$") + k(r"^worker/[^/]+/padding_eff$"), "")],
    )
    r.lines(
        "memory.png",
        "Memory over time",
        [
            ("allocator GiB", k(r"^mem/\d+/(allocated|reserved)_gib$"), "mem/"),
            ("device GiB (NVML)", k(r"^gpu/\d+/mem_used_gib$"), "gpu/"),
        ],
    )


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Plots of RUN_DIR/metrics.jsonl as PNGs and report.html in `out_dir` (default
    RUN_DIR/report); returns the HTML's path."""
    run_dir = Path(run_dir)
    path = RunLayout(run_dir).metrics
    if not path.is_file():
        raise UserError(
            f"{path}: no metrics file; pass a run directory written by "
            "`dflash-trainer train` (it contains metrics.jsonl)"
        )
    rows, events = read_metrics(path)
    if not rows:
        raise UserError(f"{path}: contains no metric records yet; run training longer")
    out = Path(out_dir) if out_dir else RunLayout(run_dir).report
    out.mkdir(parents=True, exist_ok=True)
    r = _Report(rows, events, out)
    k = lambda pat: _keys(rows, pat)  # noqa: E731
    _stage_charts(r, k)
    _training_charts(r, k, len(rows))
    _eval_charts(r, k, rows, events)
    _resource_charts(r, k)
    html_path = out / "report.html"
    html_path.write_text(r.html(run_dir), encoding="utf-8")
    return html_path
