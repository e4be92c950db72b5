"""tests/test_memorise.py with drafter.variant=dflash2: the real training path memorises the same
conversations, and the project's loop, drafting by the selector walk (decode/draft.py ->
`DFlashDrafter.propose`), then accepts long drafts of the DFlash2 export.

Measured (6 prompts x 24 tokens, the preset's loss on slots 1..4, 80 epochs, the same harness
for both): DFlash tau 5.08 (tests/test_memorise.py; docs/guides/export.md); DFlash2 walk 9.58,
argmax drafting on the same weights 4.98, and 4.79 with selector_weight 0 (the convolutions
alone). The convolutions learn what DFlash learns. The selector, trained
teacher-forced on slots 1..4, carries the walk past the trained slots (docs/guides/dflash2.md,
"Memorisation").

Runtime: a second memorisation beside the DFlash one (the `memorised` fixture), at the same 80
epochs: 142 s of training on 2 cores at load ~2 (322 s on shared cores in phase 1). Fewer epochs
were tried: at 50 (the cosine compressed to 50 steps) the training loss was still 1.98 at the end
(walk_accept_len 2.7), not safely above the threshold, so the epochs stay at the DFlash test's.
"""

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
    assert drafter.config.variant == "dflash2"

    def tau(d) -> float:
        with torch.inference_mode():
            how = dict(baseline=False, warmup=False, progress=False)
            return evaluate(m.target, d, m.prompt_ids, NEW_TOKENS, BLOCK, **how).tau

    walk = tau(drafter)
    drafter.candidate_selector = None  # the same weights, drafting by argmax
    argmax = tau(drafter)
    print(
        f"memorise dflash2: {N_CONV} conversations, {m.steps} steps; tau {walk:.2f} "
        f"(argmax drafting {argmax:.2f}); train {m.t_train:.0f} s"
    )
    assert walk > 3.0, walk
    assert walk >= argmax, (walk, argmax)  # the trained selector does not cost acceptance
