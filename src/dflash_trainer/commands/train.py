"""`dflash-trainer train`: train a drafter online (target in the loop), in this process or, with
`--nproc N`, relaunched under torchrun (one process per cell)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from dflash_trainer.config import Config, split_of
from dflash_trainer.errors import UserError
from dflash_trainer.run import train
from dflash_trainer.run.build import require_sources
from dflash_trainer.run.distributed import train_distributed
from dflash_trainer.run.rundir import claim
from dflash_trainer.run.trainer import setup_run_logging

log = logging.getLogger(__name__)


def torchrun_argv(nproc: int, args) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m dflash_trainer train
    ...`: this command line as parsed (cli.main), less `--nproc`, so each rank runs it once."""
    common = [*(["--preset", args.preset] if args.preset else [])]
    common += ["--config", args.config_file] if args.config_file else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={int(nproc)}",
        "-m",
        "dflash_trainer",
        "train",
        *common,
        *args.overrides,
    ]


def launch_torchrun(nproc: int, args) -> int:
    cmd = torchrun_argv(nproc, args)
    log.info("launching: %s", " ".join(cmd))
    return subprocess.call(cmd)


def launch_count(cfg: Config, nproc: int) -> int:
    """Processes `train` launches: --nproc, or with pipeline.split T:D, T+D (a --nproc that
    differs is refused naming both)."""
    split = split_of(cfg.pipeline.split)
    if split is None:
        return nproc
    world = sum(split)
    if nproc > 1 and nproc != world:
        raise UserError(
            f"--nproc {nproc} does not match pipeline.split={cfg.pipeline.split} ({split[0]} "
            f"target + {split[1]} drafter ranks = {world} processes): pass --nproc {world}, or "
            "leave --nproc out (the split launches its ranks itself)."
        )
    return world


def run(cfg: Config, args) -> int:
    nproc = launch_count(cfg, args.nproc)
    require_sources(cfg)  # before any process or directory is touched
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        # Convenience: relaunch this very command under torchrun, one process per cell (or
        # per rank of a pipeline.split).
        return launch_torchrun(nproc, args)
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and cfg.overwrite and cfg.checkpoint.resume_from:
        if Path(cfg.checkpoint.resume_from).resolve().is_relative_to(Path(cfg.run_dir).resolve()):
            raise UserError(
                "under torchrun, --resume-from with --overwrite needs a checkpoint outside "
                "run_dir (rank 0 moves run_dir aside); copy it out first."
            )
    # One run per run_dir: refuse, resume or move aside before anything is written, the log
    # included (it would move aside with an earlier run). Rank 0 only; the others follow it.
    claimed = claim(cfg) if rank == 0 else None
    handler = setup_run_logging(Path(cfg.run_dir), rank)
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
            result = train_distributed(cfg, claimed=claimed)
        else:
            result = train(cfg, claimed=claimed)
    finally:
        logging.getLogger().removeHandler(handler)
    if rank != 0:
        return 0
    rate = f" at {result.steady_tok_s:.0f} tokens/s" if result.steady_tok_s else ""
    print(
        f"trained {result.steps} steps in {result.wall_s:.0f} s ({result.reason}){rate}; "
        f"export: {result.export_dir}; checkpoint: {result.checkpoint}"
    )
    if result.balance:
        print(result.balance)
    return 0
