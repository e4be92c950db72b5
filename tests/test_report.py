"""report: PNGs + report.html from a synthetic metrics.jsonl; missing series are skipped."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from dflash_trainer.commands import report as report_command
from dflash_trainer.errors import UserError
from dflash_trainer.observe.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = [
    "throughput.png",
    "queues.png",
    "loss.png",
    "accuracy.png",
    "accept_len.png",
    "padding.png",
    "memory.png",
]


def synthetic_run(run_dir, n=60, seed=0):
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i in range(n):
            t = 5.0 * (i + 1)
            step = 20 * (i + 1)
            rec = {
                "kind": "metrics",
                "step": step,
                "time/elapsed_s": t,
                "worker/target0/tokens_per_s": 9000 + 500 * math.sin(i / 5),
                "worker/drafter0/tokens_per_s": 4500 + rng.uniform(-200, 200),
                "tput/target_tok_s": 9000.0,
                "tput/drafter_tok_s": 4500.0,
                "queue/features/depth_mean": 3.5 if i > 10 else 0.5,
                "queue/features/consumer_starved_frac": 0.02 if i > 10 else 0.6,
                "queue/features/producer_blocked_frac": 0.4 if i > 10 else 0.0,
                "drafter/loss": 3.0 * math.exp(-i / 20) + 0.5,
                "drafter/accept_len": 1.0 + 3.0 * (1 - math.exp(-i / 15)),
                "batch/padding_eff": 0.9 + 0.05 * rng.random(),
                "mem/0/allocated_gib": 20 + i * 0.05,
                "mem/0/reserved_gib": 24.0,
                "gpu/0/mem_used_gib": 25.5,
            }
            for k in range(8):  # accuracy decays with position in the block
                rec[f"drafter/acc_{k}"] = 0.9 * (0.8**k) * (1 - math.exp(-(i + 1) / 10))
            f.write(json.dumps(rec) + "\n")
        # as PeriodicEval logs it (trainer.py)
        f.write(
            json.dumps(
                {
                    "kind": "event",
                    "step": 600,
                    "eval/tau": 3.7,
                    "eval/tau_sim": 3.5,
                    "eval/step": 600,
                }
            )
            + "\n"
        )
        f.write('{"kind": "metrics", "step": 999, "torn')  # a torn last line is skipped


def test_full_report(tmp_path):
    run = tmp_path / "run"
    synthetic_run(run)
    assert report_command.run(None, argparse.Namespace(report_run_dir=str(run))) == 0
    out = run / "report"
    for name in ALL_PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 8000, name
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(ALL_PLOTS)
    assert "skipped" not in html and "eval/tau=3.7" in html


def test_acceptance_chart_holds_training_estimate_and_heldout_tau(tmp_path, monkeypatch):
    """The train-vs-serving check: eval/tau (an event) is drawn beside drafter/accept_len."""
    from dflash_trainer.observe import report as R

    drawn = {}
    real_save = R._Report._save

    def spy(self, fig, fname, title, note=""):
        drawn[fname] = sorted(l.get_label() for ax in fig.axes for l in ax.get_lines())
        return real_save(self, fig, fname, title, note)

    monkeypatch.setattr(R._Report, "_save", spy)
    run = tmp_path / "run"
    synthetic_run(run)
    R.write_report(run)
    assert drawn["accept_len.png"] == ["drafter/accept_len", "eval/tau", "eval/tau_sim"]


def test_missing_series_skipped_with_note(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for i in range(5):
            f.write(
                json.dumps(
                    {
                        "kind": "metrics",
                        "step": i,
                        "time/elapsed_s": float(i),
                        "drafter/loss": 2.0 - 0.1 * i,
                    }
                )
                + "\n"
            )
    html_path = write_report(run)
    html = html_path.read_text()
    assert (run / "report" / "loss.png").read_bytes().startswith(PNG_MAGIC)
    assert not (run / "report" / "memory.png").exists()
    assert html.count("data:image/png;base64,") == 1
    assert html.count("skipped:") == len(ALL_PLOTS) - 1


def test_missing_or_empty_file_is_user_error(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no metric records"):
        write_report(tmp_path)
