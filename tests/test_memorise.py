"""End to end through `train()` with the embedded preset's settings: the drafter must memorise a
handful of conversations, and decoding those same prompts must then accept long drafts.

This is the one test that catches a silent bug in the real training path (token-budget batching,
the target's 4-D mask, the preset's precision, the objective, the optimizer): the parity tests run
on tiny models. The target answers the prompts itself (greedy, cached under the project cache,
so a rerun skips it), as DFlash training expects. float32 target and fp32 drafter: on CPUs
without native bf16 matmuls bf16 runs about 10x slower (the preset's `auto` picks fp32 there).

Sizing (2 cores): the 6 shortest embedded prompts, 24-token answers, one batch per epoch
(batching.num_buckets=1), 6 anchors per sequence (a step's cost is mostly the target's forward
and the drafter's 49k-way LM head; memorising needs optimizer steps, not anchors), 80 epochs =
80 steps. Measured with 150 epochs: the training loss fell below 0.4 at step 46 (accept_len 6.8)
and below 0.05 by step 55. With these settings (80 epochs): tau 11.5 of a possible 11.5 on the
six prompts, 442 s in all on 2 cores shared with other jobs (load ~6; 406 s of training). The
preset's time budget is off so the epochs decide.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from dflash_trainer.config_io import load_config
from dflash_trainer.data import embedded
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import generate_responses
from dflash_trainer.errors import UserError
from dflash_trainer.eval.specdecode import evaluate
from dflash_trainer.models.embedded import cache_root
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.run import train

N_CONV = int(os.environ.get("MEMORISE_CONVS", "6"))
EPOCHS = int(os.environ.get("MEMORISE_EPOCHS", "80"))
BUDGET_S = float(os.environ.get("MEMORISE_BUDGET_S", "0"))  # 0: the epochs decide
NEW_TOKENS = int(os.environ.get("MEMORISE_TOKENS", "24"))  # answer length (training, decoding)
ANCHORS = int(os.environ.get("MEMORISE_ANCHORS", "6"))


@pytest.mark.slow
def test_train_memorises_through_the_real_path(tmp_path):
    t0 = time.monotonic()
    flags = [
        "--target.dtype=float32",
        "--pipeline.precision=fp32",
        f"--run_dir={tmp_path / 'run'}",
        f"--data.cache_dir={tmp_path / 'tok'}",
        "--data.eval_fraction=0",
        f"--drafter.num_anchors={ANCHORS}",
        "--batching.num_buckets=1",  # one batch per epoch: every step sees every conversation
        f"--optim.epochs={EPOCHS}",
        f"--optim.time_budget_s={BUDGET_S}",
        "--eval.at_end=false",
        "--metrics.wandb=off",
        "--metrics.tensorboard=false",
        "--metrics.console=false",
        "--pipeline.cpu_threads=2",
    ]
    cfg = load_config("smollm2-cpu", None, flags)
    try:
        target = TargetModel.load(cfg.target, "cpu")
        prompts = embedded.embedded_prompts()
    except UserError as e:
        pytest.skip(f"embedded target or prompts unavailable: {e}")
    # the shortest prompts: short sequences keep the target's forward cheap on 2 cores
    tok = target.tokenizer
    prompts.sort(key=lambda c: (len(Rendering().prompt_ids(tok, c.messages)), c.id))
    picked = prompts[:N_CONV]
    data = cache_root(cfg.target.cache_dir) / "responses" / f"memorise-{N_CONV}-{NEW_TOKENS}.jsonl"
    generate_responses(
        target, picked, data, max_new_tokens=NEW_TOKENS, batch_size=N_CONV, progress=False
    )
    t_gen = time.monotonic() - t0
    cfg.data.sources = [str(data)]
    res = train(cfg, target=target)
    t_train = time.monotonic() - t0 - t_gen
    drafter = load_drafter(res.export_dir, "cpu")
    ids = [Rendering().prompt_ids(tok, c.messages) for c in picked]
    with torch.inference_mode():
        s = evaluate(target, drafter, ids, NEW_TOKENS, 16, baseline=False, warmup=False)
    print(
        f"memorise: {N_CONV} conversations x {EPOCHS} epochs = {res.steps} steps; tau {s.tau:.2f} "
        f"(token-weighted {s.tau_token_weighted:.2f}); generate {t_gen:.0f} s, train "
        f"{t_train:.0f} s, total {time.monotonic() - t0:.0f} s"
    )
    assert s.tau > 3.0, s.tau
