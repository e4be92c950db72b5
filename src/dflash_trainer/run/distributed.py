"""One rank of a torchrun job: data prepared rank 0 first, then this rank's cell trained.

The process group and the collectives are pipeline/distributed.py; this module only runs a
training cell over them."""

from __future__ import annotations

import copy
import logging
import os
import sys
import time

from dflash_trainer.config import Config
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.target import TargetModel
from dflash_trainer.pipeline.distributed import (
    DistContext,
    PeerFailure,
    init_from_env,
    localize_config,
)
from dflash_trainer.pipeline.runtime import StageError
from dflash_trainer.pipeline.split import Split, init_split, localize_split
from dflash_trainer.run.split import run_target_rank
from dflash_trainer.run.trainer import train

log = logging.getLogger(__name__)

# The longest rank 0 keeps the store up after a failure for ranks still to read it (they read it
# within a monitor tick unless hung or killed).
FAILURE_ACK_WAIT_S = 20.0


def _prepare_data_rank0_first(cfg: Config, ctx: DistContext, target) -> dict:
    """Rank 0 reads, regenerates (embedded source) and tokenizes into the shared caches first;
    the other ranks then hit the caches. They write their copy of heldout.jsonl under
    run_dir/ranks/R so that no two processes write one file. Waits through the store (polling
    for a peer failure), not a collective: data preparation may take longer than any
    collective timeout."""

    if target is None:
        target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    if ctx.is_main:
        train_set, heldout = prepare_data(cfg, target.tokenizer, target)
        ctx.store.set("data_ready", "1")
    else:
        while not ctx.store.check(["data_ready"]):
            peer = ctx.peer_failure()
            if peer is not None:
                raise PeerFailure(peer)
            time.sleep(0.5)
        local = copy.deepcopy(cfg)
        local.run_dir = str(RunLayout.of(cfg.run_dir).rank(ctx.rank))
        train_set, heldout = prepare_data(local, target.tokenizer, target)
    return {"target": target, "train_set": train_set, "heldout": heldout}


def train_distributed(cfg: Config, **train_kwargs):
    """Run this rank's cell of a torchrun job (or, with pipeline.split, its target or drafter
    rank): init, localize devices, train, tear down.
    A failure is printed naming the rank that failed first, then the process exits at once."""

    split = Split.of(cfg.pipeline.split)  # pipeline/split.py: T target + D drafter ranks
    ctx = init_split(cfg.pipeline, split) if split is not None else init_from_env(cfg.pipeline)
    if ctx is None:
        return train(cfg, **train_kwargs)
    try:
        if split is not None:
            cfg = localize_split(cfg, ctx.local_rank, ctx.local_world_size)
        else:
            cfg = localize_config(cfg, ctx.local_rank, ctx.local_world_size)
        if train_kwargs.get("train_set") is None:
            train_kwargs.update(_prepare_data_rank0_first(cfg, ctx, train_kwargs.get("target")))
        if split is not None and not split.is_drafter(ctx.rank):
            result = run_target_rank(cfg, ctx, split, **train_kwargs)
        else:
            result = train(cfg, dist=ctx, **train_kwargs)
    except BaseException as e:  # any failure ends this rank, loudly and fast
        err = ctx.explain_failure(e)
        log.error("rank %d: %s", ctx.rank, err, exc_info=not isinstance(err, StageError))
        print(f"dflash-trainer: rank {ctx.rank}: error: {err}", file=sys.stderr, flush=True)
        ctx.await_failure_acks(min(ctx.timeout_s, FAILURE_ACK_WAIT_S))
        logging.shutdown()
        os._exit(1)
    ctx.close()
    return result
