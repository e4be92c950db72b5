"""End to end through `train()` with the embedded preset's settings: the drafter must memorise a
handful of conversations, and decoding those same prompts must then accept long drafts.

This is the one test that catches a silent bug in the real training path (token-budget batching,
the target's 4-D mask, the preset's precision, the objective, the optimizer): the parity tests run
on tiny models. The target answers the prompts itself (greedy, cached under the project cache,
so a rerun skips it), as DFlash training expects. The training and its sizing are in
tests/memorised.py (the `memorised` fixture, shared with tests/test_vllm_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.models.export import load_drafter
from memorised import BLOCK, EPOCHS, N_CONV, NEW_TOKENS


@pytest.mark.slow
def test_train_memorises_through_the_real_path(memorised):
    m = memorised
    drafter = load_drafter(m.export_dir, "cpu", torch.float32)  # stored bf16, decoded in fp32
    with torch.inference_mode():
        s = evaluate(
            m.target, drafter, m.prompt_ids, NEW_TOKENS, BLOCK, baseline=False, warmup=False
        )
    print(
        f"memorise: {N_CONV} conversations x {EPOCHS} epochs = {m.steps} steps; tau {s.tau:.2f} "
        f"(token-weighted {s.tau_token_weighted:.2f}); generate {m.t_gen:.0f} s, train "
        f"{m.t_train:.0f} s"
    )
    assert s.tau > 3.0, s.tau
