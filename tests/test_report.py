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
    "optimizer.png",
    "accept_len.png",
    "heldout_tau.png",
    "final_tau.png",
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
                "drafter/lr": 3e-4 * min(1.0, (i + 1) / 10),
                "drafter/grad_norm": 2.0 * math.exp(-i / 30) + rng.uniform(0, 0.1),
                "drafter/skipped_total": float(i >= 30),  # one non-finite step
                "drafter/consecutive_skips": float(i == 30),
                "batch/padding_eff": 0.9 + 0.05 * rng.random(),
                "mem/0/allocated_gib": 20 + i * 0.05,
                "mem/0/reserved_gib": 24.0,
                "gpu/0/mem_used_gib": 25.5,
            }
            for k in range(8):  # accuracy decays with position in the block
                rec[f"drafter/acc_{k}"] = 0.9 * (0.8**k) * (1 - math.exp(-(i + 1) / 10))
            f.write(json.dumps(rec) + "\n")
        # as PeriodicEval logs it (run/evaluation.py): periodic on validation prompts, then
        # every reported prompt at the end
        for step, tau, which in [(300, 3.1, "validation"), (600, 3.7, "validation")] + [
            (1200, 3.9, "heldout")
        ]:
            rec = {"kind": "event", "step": step, "eval/tau": tau, "eval/tau_sim": tau - 0.2}
            rec.update({"eval/tau/chat": tau - 0.3, "eval/tau/code": tau + 0.3})
            rec.update({"eval/tau_sim/chat": tau - 0.4, "eval/tau_sim/code": tau + 0.1})
            rec.update({"eval/set": which, "eval/step": step, "eval/prompts": 6})
            f.write(json.dumps(rec) + "\n")
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


def _spy_on_figures(monkeypatch) -> dict:
    """fname -> the figure as drawn: per axes its y label, line labels, bar heights, x ticks."""
    from dflash_trainer.observe import report as R

    drawn = {}
    real_save = R._Report._save

    def spy(self, fig, fname, title, note=""):
        drawn[fname] = [
            {
                "ylabel": ax.get_ylabel(),
                "lines": sorted(l.get_label() for l in ax.get_lines()),
                "bars": [round(p.get_height(), 6) for p in ax.patches],
                "xticks": [t.get_text() for t in ax.get_xticklabels()],
            }
            for ax in fig.axes
        ]
        return real_save(self, fig, fname, title, note)

    monkeypatch.setattr(R._Report, "_save", spy)
    return drawn


def test_optimizer_and_heldout_tau_panels(tmp_path, monkeypatch):
    drawn = _spy_on_figures(monkeypatch)
    run = tmp_path / "run"
    synthetic_run(run)
    write_report(run)
    opt = drawn["optimizer.png"]
    assert [a["ylabel"] for a in opt] == ["learning rate", "grad norm", "non-finite steps"]
    assert opt[2]["lines"] == ["consecutive_skips", "skipped_total"]
    during = drawn["heldout_tau.png"]  # the periodic evaluations only, per source
    assert [a["ylabel"] for a in during] == ["tau", "tau_sim"]
    assert during[0]["lines"] == ["tau", "tau/chat", "tau/code"]
    assert during[1]["lines"] == ["tau_sim", "tau_sim/chat", "tau_sim/code"]
    (end,) = drawn["final_tau.png"]  # the end-of-run evaluation: bars per source
    assert end["xticks"] == ["all", "chat", "code"]
    assert end["bars"] == [3.9, 3.6, 4.2, 3.7, 3.5, 4.0]  # tau per group, then tau_sim


def test_missing_keys_skip_their_panel(tmp_path, monkeypatch):
    """A run without lr or skip counters, evaluated only periodically and without tau_sim:
    those panels are left out, not drawn empty; no end-of-run chart."""
    drawn = _spy_on_figures(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for i in range(5):
            rec = {"kind": "metrics", "step": i, "time/elapsed_s": float(i)}
            rec["drafter/grad_norm"] = 1.0 / (i + 1)
            f.write(json.dumps(rec) + "\n")
        rec = {"kind": "event", "step": 4, "eval/tau": 2.0, "eval/tau/chat": 2.1}
        f.write(json.dumps({**rec, "eval/set": "validation"}) + "\n")
    html = write_report(run).read_text()
    assert [a["ylabel"] for a in drawn["optimizer.png"]] == ["grad norm"]
    assert [a["ylabel"] for a in drawn["heldout_tau.png"]] == ["tau"]
    assert "final_tau.png" not in drawn and not (run / "report" / "final_tau.png").exists()
    assert "Held-out tau at the end of the run, per source</h2>\n<p><i>skipped:" in html


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
