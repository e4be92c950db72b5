"""`pipeline.split = "T:D"`: T target ranks feed D drafter ranks under torchrun.

The co-located layout (pipeline/distributed.py) ties targets to one drafter: a rank is a cell of
one drafter device plus its own target devices. A split job instead gives every rank one device
and one job, so that any ratio of target to drafter devices can be run, e.g. one target GPU
feeding three drafter GPUs (chat data, where the drafter costs several times the target per
token):

| global rank        | role    | runs                                                          |
|--------------------|---------|---------------------------------------------------------------|
| 0 .. D-1           | drafter | prefetcher (its share of the plan), feed receiver, drafter    |
|                    |         | worker: training, DDP among the drafter ranks, checkpoints    |
| D .. D+T-1         | target  | prefetcher (its share of the plan), target worker, feed sender |

Drafter ranks come first, so global rank 0 is drafter rank 0: it writes the checkpoints, the
ledger, the metrics and the export as in every other run, and drafter rank d is global rank d.

Which batch goes where: the epoch's global plan (the single-process one) is cut to a multiple
of D, as the co-located cells cut it; batch g of it is trained by drafter rank g mod D (the
plan drafter d would have as rank d of D cells: `plan_epoch(..., d, D)`) and computed by target
rank g mod T (global rank D + g mod T). So D drafter ranks with `optim.grad_accum` a train what
one process with grad_accum D x a trains, step for step, whatever T is; and a checkpoint is that
of D cells: it resumes on the same D (any T), or on D co-located cells, exactly.

Device: every rank runs one device, cuda:LOCAL_RANK when the config names CUDA, else cpu; the
CPU thread budget is split among the local ranks as for cells.

Groups (every rank creates them, in this order):

| group                      | members        | used for                                        |
|----------------------------|----------------|-------------------------------------------------|
| default (NCCL / gloo)      | every rank     | the features, point to point (pipeline/feed.py) |
| drafters (NCCL / gloo)     | drafter ranks  | DDP's gradient all-reduce                       |
| drafters' ctrl (gloo)      | drafter ranks  | stop vote, checkpoint gather                    |
| the rendezvous TCPStore    | every rank     | feed requests, failures, metrics (never blocks) |

Stop: drafter ranks vote as cells do, and a signal that reaches a target rank joins their vote
through the store (`SIGNAL_KEY`); target ranks stop when the drafters they feed stop asking
for batches (pipeline/feed.py).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_trainer.config import Config, PipelineConfig, split_of
from dflash_trainer.errors import UserError
from dflash_trainer.pipeline.cores import usable_cpus
from dflash_trainer.pipeline.distributed import DistContext

log = logging.getLogger(__name__)

SIGNAL_KEY = "feed/signal"  # a target rank received SIGINT/SIGTERM: the drafters' vote stops
BALANCE_KEY = "feed/balance/{rank}"  # a target rank's target figures (observe/balance.py)


@dataclass(frozen=True)
class Split:
    """T target ranks, D drafter ranks; drafter ranks are global ranks 0..D-1."""

    targets: int
    drafters: int

    @classmethod
    def of(cls, spec: str) -> Split | None:
        """`pipeline.split` parsed (None: co-located cells)."""
        td = split_of(spec)
        return None if td is None else cls(*td)

    @property
    def world_size(self) -> int:
        return self.targets + self.drafters

    @property
    def spec(self) -> str:
        return f"{self.targets}:{self.drafters}"

    def is_drafter(self, rank: int) -> bool:
        return rank < self.drafters

    def drafter_of(self, g: int) -> int:
        """Global rank of the drafter rank that trains batch g of an epoch's global plan."""
        return g % self.drafters

    def target_of(self, g: int) -> int:
        """Global rank of the target rank that computes batch g."""
        return self.drafters + g % self.targets

    def fed_by(self, target_rank: int) -> list[int]:
        """The drafter ranks that target rank `target_rank` sends to: d with d = g mod D for
        some g = t mod T, i.e. d = t mod gcd(T, D)."""
        t, k = target_rank - self.drafters, math.gcd(self.targets, self.drafters)
        return [d for d in range(self.drafters) if (d - t) % k == 0]

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise UserError(
                f"pipeline.split={self.spec} runs {self.world_size} ranks ({self.targets} target "
                f"+ {self.drafters} drafter), but this job has {world_size} (WORLD_SIZE"
                f"{'' if world_size > 1 else ': no torchrun'}): launch it with torchrun "
                f"--nproc-per-node={self.world_size} (over all nodes: --nnodes x --nproc-per-node "
                f"= {self.world_size}), or dflash-trainer train --nproc {self.world_size}; or "
                "change pipeline.split."
            )


def rank_device(p: PipelineConfig, local_rank: int) -> str:
    """This rank's one device: cuda:LOCAL_RANK when the config names CUDA, else cpu."""
    if not p.drafter_device.startswith("cuda"):
        return "cpu"
    have = torch.cuda.device_count()
    if local_rank >= have:
        raise UserError(
            f"pipeline.split: local rank {local_rank} runs on cuda:{local_rank}, but {have} CUDA "
            "devices are visible: run at most one rank per GPU (--nproc-per-node)."
        )
    return f"cuda:{local_rank}"


def localize_split(cfg: Config, local_rank: int, local_world_size: int) -> Config:
    """A copy of `cfg` with this rank's device (drafter and target alike) and thread budget."""
    out = copy.deepcopy(cfg)
    p = out.pipeline
    dev = rank_device(p, local_rank)
    total = p.cpu_threads or usable_cpus()
    p.drafter_device, p.target_devices = dev, [dev]
    p.cpu_threads = max(1, total // max(1, local_world_size))
    return out


# ------------------------------------------------------------------------------- contexts
@dataclass
class DrafterContext(DistContext):
    """A drafter rank: `rank` is its global rank (= its drafter index) and `world_size` is D, so
    the data plan, the checkpoint and the stop vote are those of D cells. `group`: the drafter
    ranks' group for DDP; `ctrl`: theirs for votes and gathers."""

    split: Split | None = None
    group: object = None

    def ddp_wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.world_size == 1:  # one drafter rank: nothing to all-reduce
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = next(module.parameters()).device
        return DDP(
            module,
            device_ids=[dev] if dev.type == "cuda" else None,
            process_group=self.group,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
        )

    def target_figures(self) -> list[dict]:
        """The latest figures each target rank published of its target worker (balance.py
        `remote_target`); best effort: ranks that published none are left out."""
        assert self.split is not None
        out = []
        for r in range(self.split.drafters, self.split.world_size):
            key = BALANCE_KEY.format(rank=r)
            try:
                if self.store.check([key]):
                    out.append(json.loads(self.store.get(key).decode()))
            except Exception:  # like every collector: never fails the run
                continue
        return out

    def agree_stop(self, local_stop: bool) -> bool:
        """A target rank's signal joins the vote (one store check per optimizer step)."""
        try:
            signalled = self.store.check([SIGNAL_KEY])
        except Exception:  # the store host is gone: the vote itself will fail, naming it
            signalled = False
        return super().agree_stop(local_stop or signalled)


@dataclass
class TargetContext(DistContext):
    """A target rank: global rank, world size T+D; no collectives besides the features."""

    split: Split | None = None

    def snapshots(self) -> dict[int, dict]:
        return {}


def init_split(p: PipelineConfig, split: Split) -> DistContext:
    """Join the torchrun job as a split's drafter or target rank (see the module docstring)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    split.check_world(world)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout_s = float(p.collective_timeout_s)
    timeout = timedelta(seconds=timeout_s)
    device = rank_device(p, local_rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    store, rank, world = next(
        dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    drafters = list(range(split.drafters))
    group = dist.new_group(drafters, backend=backend, timeout=timeout)
    ctrl = dist.new_group(drafters, backend="gloo", timeout=timeout)
    common = dict(
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world,
        backend=backend,
        timeout_s=timeout_s,
        store=dist.PrefixStore("dflash/", store),
        split=split,
    )
    ctx: DistContext
    if split.is_drafter(rank):
        ctx = DrafterContext(world_size=split.drafters, ctrl=ctrl, group=group, **common)
    else:
        ctx = TargetContext(world_size=world, **common)
    role = "drafter" if split.is_drafter(rank) else "target"
    log.info(
        "rank %d/%d (local %d/%d): %s rank of split %s, %s on %s",
        rank,
        world,
        local_rank,
        local_world,
        role,
        split.spec,
        backend,
        device,
    )
    return ctx
