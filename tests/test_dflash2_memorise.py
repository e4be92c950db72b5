"""tests/test_memorise.py with drafter.variant=dflash2: the real training path memorises the same
conversations and the project's loop then accepts long drafts of the DFlash2 export.

The loop drafts by argmax of the LM head (eval/ does not call the selector walk yet:
`DFlashDrafter.propose` is the seam it will use), so this checks the convolutions, the selector
loss beside the block loss, export and load through the whole path, not the walk's own tau."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.models.export import load_drafter
from memorised import BLOCK, N_CONV, NEW_TOKENS, memorise


@pytest.mark.slow
def test_dflash2_memorises_through_the_real_path(tmp_path):
    m = memorise(tmp_path, ("--drafter.variant=dflash2",))
    drafter = load_drafter(m.export_dir, "cpu", torch.float32)
    assert drafter.config.is_dflash2
    with torch.inference_mode():
        s = evaluate(
            m.target, drafter, m.prompt_ids, NEW_TOKENS, BLOCK, baseline=False, warmup=False
        )
    print(f"memorise dflash2: {N_CONV} conversations, {m.steps} steps; tau {s.tau:.2f}")
    assert s.tau > 3.0, s.tau
