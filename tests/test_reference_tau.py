"""eval/reference.py: the reference loop's tau on an export equals ours (fp32, greedy)."""

import pytest
import torch

from dflash_trainer.eval.reference import reference_tau
from dflash_trainer.eval.specdecode import evaluate
from dflash_trainer.models.export import export_drafter
from test_specdecode import _trained_drafter, random_prompt, side, tiny_target


def test_reference_tau_equals_ours(tmp_path):
    pytest.importorskip("dflash.model")
    model = tiny_target("llama", seed=6)
    g = torch.Generator().manual_seed(12)
    prompts = [random_prompt(g) for _ in range(3)]
    drafter = _trained_drafter(model, prompts, steps=300)
    out = export_drafter(drafter, tmp_path / "export")
    t = side(model)
    ours = evaluate(t, drafter, prompts, 20, 8, stop_ids=(), baseline=False, warmup=False)
    ref = reference_tau(out, model, [p[0].tolist() for p in prompts], 20, 8)
    assert ref["num_prompts"] == 3
    assert ref["tau"] == pytest.approx(ours.tau, rel=1e-6)
    assert ours.tau > 1.2  # real acceptances were compared, not only rejections
