"""bench/quality_run.py (`make quality`): the whole plumbing on a tiny model with tiny budgets:
embedded answers, synthesised prompts and their answers, training with periodic evaluation,
the per-source held-out evaluation (ours, reference loop, adaptive verify on code), summary."""

import importlib.util
import json
from pathlib import Path

import pytest

from test_generate import Prompt, char_tokenizer, tiny_model

HAS_DFLASH = importlib.util.find_spec("dflash") is not None  # the published reference loop

pytestmark = pytest.mark.usefixtures("one_thread")

QUALITY = Path(__file__).resolve().parents[1] / "bench" / "quality_run.py"


def load_script():
    spec = importlib.util.spec_from_file_location("quality_run", QUALITY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def embedded_stand_in():
    """Six MT-Bench-like and six HumanEval-like prompts: both sources get held-out prompts."""
    chat = [f"Tell me about topic {i} in a few words." for i in range(6)]
    code = [f"Write a Python function number {i} that adds two numbers." for i in range(6)]
    return [
        Prompt(f"mtbench-{i}", [{"role": "user", "content": t}]) for i, t in enumerate(chat)
    ] + [Prompt(f"humaneval-{i}", [{"role": "user", "content": t}]) for i, t in enumerate(code)]


@pytest.mark.skipif(not HAS_DFLASH, reason="the published dflash package is not installed")
@pytest.mark.parametrize("variant", ["synth-sampled"])
def test_quality_run_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, variant):
    from dflash_trainer.data import embedded

    monkeypatch.setattr(embedded, "embedded_prompts", embedded_stand_in)
    monkeypatch.setenv("DFLASH_TRAINER_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "tiny-model"
    tiny_model().save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    sets = {
        "target.model": str(d),
        "target.dtype": "float32",
        "target.num_taps": "1",
        "target.cache_dir": str(tmp_path / "cache"),
        "drafter.init": "random",
        "drafter.num_layers": "1",
        "drafter.block_size": "4",
        "objective.num_anchors": "4",
        "objective.loss_slots": "0",
        "optim.time_budget_s": "0",
        "optim.max_steps": "6",
        "optim.epochs": "3",
        "eval.every_steps": "3",
        "eval.periodic_prompts": "4",
        "eval.max_new_tokens": "6",
        "eval.validation_prompts": "2",
        "data.eval_fraction": "0.4",
        "synth.prompts": "4",
        "synth.min_chars": "1",
        "synth.max_tokens": "48",
        "synth.exclude": "[]",
        "generate.engine": "project",
        "generate.max_new_tokens": "8",
        "pipeline.feature_cache_gb": "0",
        "metrics.wandb": "off",
        "metrics.tensorboard": "false",
        "metrics.console": "false",
    }
    out = tmp_path / "summary.json"
    # the reference loop beside ours; vLLM's served comparison has tests of its own
    argv = ["--variant", variant, "--compare", "reference"]
    argv += ["--run-dir", str(tmp_path / "run"), "--json", str(out)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    assert load_script().main(argv) == 0
    s = json.loads(out.read_text())
    assert s["variant"] == variant and s["steps"] == 6
    assert list(s["phases_s"]) == [
        "target", "embedded", "synthesis", "answers", "data", "training", "evaluation", "report"
    ]  # fmt: skip
    for src in ("mt-bench", "humaneval"):
        row = s["heldout"][src]
        assert row["prompts"] >= 1 and row["tau"] >= 1.0
        assert row["tau_reference_loop"] == pytest.approx(row["tau"])  # fp32: the same tokens
        assert row["speedup"] > 0 and row["lossless"].startswith("identical")
    assert s["heldout"]["humaneval"]["speedup_adaptive"] > 0
    assert s["heldout"]["mt-bench"]["speedup_adaptive"] > 0  # the chat goal is stated with it
    # the numbers are the run's own end-of-run evaluation: metrics.jsonl has the same
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (ev,) = [r for r in rows if r.get("eval/set") == "heldout"]
    assert ev["eval/tau/humaneval"] == s["heldout"]["humaneval"]["tau"]
    assert ev["eval/speedup_adaptive/humaneval"] == s["heldout"]["humaneval"]["speedup_adaptive"]
    assert ev["eval/tau_sim"] == s["heldout"]["tau_sim"]["all"]
    assert s["heldout"]["tau_sim"]["all"] >= 1.0
    assert [c["step"] for c in s["curve"]] == [3, 6] and all(c["tau"] >= 1.0 for c in s["curve"])
    answers = list((tmp_path / "cache").rglob("*.answers.jsonl"))
    (ans,) = answers
    recs = [json.loads(x) for x in ans.read_text().splitlines()]
    assert len(recs) == 4 and all(r["provenance"]["temperature"] == 0.8 for r in recs)
    assert all(r["provenance"]["seed"] == 0 for r in recs)
    assert all(r["provenance"]["engine"] == "project" for r in recs)


def test_the_end_of_run_decode_follows_report_sources():
    """The sources decoded at the end and the summary's rows are data.report_sources (no second
    list in the script): the preset's two embedded sources, or with [] every held-out source,
    the synthesised prompts included."""
    from dflash_trainer.config_io import load_config

    mod = load_script()
    cfg = load_config(preset="smollm2-quality")
    mod.configure_final_eval(cfg, "reference")
    assert cfg.eval.at_end_sources == ["mt-bench", "humaneval"] == cfg.data.report_sources
    assert cfg.eval.compare == ["reference"]
    assert cfg.eval.at_end_adaptive == ["mt-bench", "humaneval"]
    cfg.data.report_sources = []
    mod.configure_final_eval(cfg, "reference")
    assert cfg.eval.at_end_sources == []  # [] = every reported source (run/evaluation.py)
    rec = {"eval/prompts": 5, "eval/tau_sim": 1.5, "eval/tau_sim/synth": 1.7}
    for src, n, tau in (("mt-bench", 2, 1.25), ("synth", 3, 1.5)):
        rec |= {f"eval/prompts/{src}": n, f"eval/tau/{src}": tau, f"eval/speedup/{src}": 0.9}
    rows = mod.heldout_checks(rec)
    assert set(rows) == {"mt-bench", "synth", "tau_sim"}
    assert rows["synth"]["prompts"] == 3 and rows["synth"]["tau"] == 1.5
    assert rows["tau_sim"] == {"all": 1.5, "synth": 1.7}
