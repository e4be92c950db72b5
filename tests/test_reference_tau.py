"""eval/reference.py: the reference loop's tau on an export equals ours (fp32, greedy)."""

import pytest
import torch

from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.reference import reference_tau
from dflash_trainer.models.export import export_drafter
from test_specdecode import _trained_drafter, random_prompt, side, tiny_target


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target, 4 prompts, a drafter overfit on them, its export): trained once per module."""
    pytest.importorskip("dflash.model")
    model = tiny_target("llama", seed=6)
    g = torch.Generator().manual_seed(12)
    prompts = [random_prompt(g) for _ in range(4)]
    drafter = _trained_drafter(model, prompts, steps=300)
    return model, prompts, drafter, export_drafter(drafter, tmp_path_factory.mktemp("export"))


@pytest.mark.filterwarnings("error::FutureWarning")  # the reference's past_key_values is muted
def test_reference_tau_equals_ours(trained):
    model, prompts, drafter, out = trained
    prompts = prompts[:3]
    t = side(model)
    ours = evaluate(t, drafter, prompts, 20, 8, stop_ids=(), baseline=False, warmup=False)
    ref = reference_tau(out, model, [p[0].tolist() for p in prompts], 20, 8)
    assert ref["num_prompts"] == 3
    assert ref["tau"] == pytest.approx(ours.tau, rel=1e-6)
    assert ours.tau > 1.2  # real acceptances were compared, not only rejections


def test_demo_decodes_mt_bench_and_simulates_every_reported_prompt(tmp_path, trained):
    """The demo's held-out check: ours, plain greedy and the reference loop on the MT-Bench
    prompts (tau equal across the loops, lossless), tau_sim per source on every reported
    prompt, equal to the measured tau where the held-out answers are the target's greedy
    output."""
    import threading

    from decoding import ar_generate
    from dflash_trainer.commands.demo import configure_final_eval, heldout_checks
    from dflash_trainer.data.prepare import REPORT
    from dflash_trainer.run.evaluation import HeldoutPrompt, PeriodicEval
    from tiny import tiny_config

    model, prompts, drafter, out_dir = trained
    report = []
    for i, p in enumerate(prompts):
        answer = ar_generate(model, p, 24, stop_ids=()).tokens
        src = "mt-bench" if i < 2 else "humaneval"
        report.append(
            HeldoutPrompt(f"{src}-{i}", src, REPORT, p[0].tolist(), p[0].tolist() + answer)
        )
    cfg = tiny_config(tmp_path, **{"eval.max_new_tokens": 20, "drafter.block_size": 8})
    t = side(model)
    t.eos_token_ids = []
    configure_final_eval(cfg, report)
    assert cfg.eval.compare == []  # the demo decodes no reference loop: its equality is checked
    cfg.eval.compare = ["reference"]  # here, through the demo's own evaluation path
    ev = PeriodicEval(cfg, t, drafter, None, tmp_path, threading.Lock())
    ev.report, ev.dtype = report, torch.float32  # the held-out side as the demo's run has it
    rec = ev.final(0, out_dir)
    out = heldout_checks(rec, cfg)
    assert out["source"] == "mt-bench" and out["prompts"] == 2 and out["tau_sim_prompts"] == 4
    ours = evaluate(t, drafter, prompts[:2], 20, 8, stop_ids=(), baseline=False, warmup=False)
    assert out["tau"] == pytest.approx(ours.tau, rel=1e-6)
    assert out["tau_reference_loop"] == pytest.approx(out["tau"], rel=1e-6)
    assert out["tau_sim"]["mt-bench"] == pytest.approx(out["tau"], rel=1e-6)
    assert set(out["tau_sim"]) == {"mt-bench", "humaneval", "all"}
    assert out["tau"] > 1.2 and "2 of 2" in out["lossless"]
