"""Scale-out with torchrun: the process group and its collectives (one process per cell, DDP
over the drafter replicas). A rank's training cell is run/distributed.py; the per-rank metrics
merge is observe/ranks.py; the `--nproc` relaunch is commands/train.py.

A *cell* is one process: one drafter device plus k target devices, running the usual threaded
pipeline (runtime.py). Cells talk to each other through three channels, each chosen so that no
rank can wait on another forever:

| channel                         | used for                                   | from which thread      |
|---------------------------------|--------------------------------------------|------------------------|
| default group (NCCL / gloo)     | DDP gradient all-reduce (final micro-step) | drafter thread          |
| `ctrl` group (always gloo, CPU) | stop vote per optimizer step; checkpoint    | drafter thread; main    |
|                                 | gather (states, RNG, ledger) to rank 0      | thread after it ends    |
| the rendezvous TCPStore         | metric snapshots (set by every rank, read   | main thread (monitor    |
|                                 | by rank 0), first failure, never blocking   | tick), non-blocking     |

Why the monitor does not use a collective: monitor ticks are time-based, so a collective issued
from them cannot be matched across ranks (rank 0's 7th tick is not rank 1's 7th tick). Each rank
instead `set`s a JSON snapshot under its own key and rank 0 reads whatever is there (`check` +
`get`); a slow rank shows up as a stale snapshot, never as a hang.

Stop agreement: a SIGTERM reaches ranks at different times, and DDP needs every rank to run the
same number of optimizer steps. After every optimizer step each rank contributes its local
"please stop" flag (signal received) to a MAX all-reduce of one CPU int on the gloo `ctrl` group
(host only: no device sync). All ranks see the same result after the same step and stop there.

Failure: the first rank that fails writes "rank R: <error>" to the store (first writer wins, by
`store.add`). Every rank's supervisor checks that key once per tick and stops naming that rank;
a rank whose own collective broke (its peer exited) reports the peer's message if one is there.
Each rank counts itself once under `failure_acks` when it has the message (read or written), and
rank 0, which hosts the store, waits for that count before it exits (`await_failure_acks`,
bounded): otherwise a rank that had not read the message yet would find the store gone and
could only name rank 0. A rank keeps the message before it counts itself: its count can be the
last one, and the host may be gone before the reply to it arrives.
Collectives have `pipeline.collective_timeout_s`, so a hung peer ends the wait; torchrun also
tears the other ranks down when one exits non-zero. A failed rank leaves with `os._exit(1)` so
that a thread still inside a collective cannot keep the process alive.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dflash_trainer.config import Config, PipelineConfig
from dflash_trainer.errors import UserError
from dflash_trainer.pipeline.cores import usable_cpus
from dflash_trainer.pipeline.messages import StageFailure
from dflash_trainer.pipeline.runtime import StageError

log = logging.getLogger(__name__)

_FAILURE_KEY = "failure"
_FAILURE_COUNT = "failure_count"
_FAILURE_ACKS = "failure_acks"


class PeerFailure(RuntimeError):
    """Another rank failed first; the message names it."""


# ------------------------------------------------------------------------------- device layout
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def cell_layout(
    drafter_device: str,
    target_devices: list[str],
    cpu_threads: int,
    local_rank: int,
    local_world_size: int,
) -> tuple[str, list[str], int]:
    """This local rank's (drafter device, target devices, cpu threads).

    CUDA rule: the config names the devices of cell 0; cell size = highest CUDA index named + 1;
    local rank r adds r x cell size to every CUDA index. E.g. drafter cuda:0, targets cuda:1..3
    (cell size 4): rank 0 uses cuda:0..3, rank 1 cuda:4..7. CPU devices are shared by all cells,
    and the CPU thread budget (`pipeline.cpu_threads`, 0 = all cores) is split evenly among the
    local ranks so that cells do not oversubscribe the cores.
    """
    named = [drafter_device, *target_devices]
    idx = []
    for d in named:
        m = _CUDA.match(d)
        if m:
            idx.append(int(m.group(1) or 0))
    cell = max(idx) + 1 if idx else 0

    def shift(d: str) -> str:
        m = _CUDA.match(d)
        return f"cuda:{int(m.group(1) or 0) + local_rank * cell}" if m else d

    total = cpu_threads or usable_cpus()
    threads = max(1, total // max(1, local_world_size))
    return shift(drafter_device), [shift(d) for d in target_devices], threads


def localize_config(cfg: Config, local_rank: int, local_world_size: int):
    """A copy of `cfg` with this cell's devices and thread budget (see `cell_layout`)."""
    out = copy.deepcopy(cfg)
    p = out.pipeline
    d, t, threads = cell_layout(
        p.drafter_device, list(p.target_devices), p.cpu_threads, local_rank, local_world_size
    )
    cuda_needed = [x for x in [d, *t] if x.startswith("cuda")]
    if cuda_needed:
        have = torch.cuda.device_count()
        worst = max(int(x.split(":")[1]) for x in cuda_needed)
        if worst >= have:
            raise UserError(
                f"local rank {local_rank} needs {worst + 1} CUDA devices (cell of "
                f"pipeline.drafter_device={p.drafter_device!r} + pipeline.target_devices="
                f"{list(p.target_devices)} offset by local_rank x cell size) but {have} are "
                "visible; lower --nproc-per-node or name fewer devices per cell."
            )
    p.drafter_device, p.target_devices, p.cpu_threads = d, t, threads
    return out


# ------------------------------------------------------------------------------- context
@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    timeout_s: float
    store: Any = None  # PrefixStore over the rendezvous store
    ctrl: Any = None  # gloo ProcessGroup: votes, gathers
    _seq: int = 0
    _hb: dict = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- DDP
    def ddp_wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """DDP over the drafter replicas. Construction broadcasts rank 0's parameters, so every
        replica starts identical even if seeding differed. Buffers (RoPE tables) are derived
        from the config, identical everywhere: no per-forward broadcast."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = next(module.parameters()).device
        return DDP(
            module,
            device_ids=[dev] if dev.type == "cuda" else None,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
        )

    # ---- collectives on the gloo control group (CPU tensors only: never a device sync)
    def agree_stop(self, local_stop: bool) -> bool:
        flag = torch.tensor([1 if local_stop else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctrl)
        return bool(flag[0])

    def gather_to_main(self, obj):
        """Every rank's `obj` (picklable) as a list on rank 0; None elsewhere."""
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.ctrl)
        return out

    # ---- failures (store: first writer wins)
    def report_failure(self, message: str) -> None:
        try:
            if self.store.add(_FAILURE_COUNT, 1) == 1:
                self.store.set(_FAILURE_KEY, f"rank {self.rank}: {message}")
            self._ack_failure()
        except Exception as e:  # the store host may be gone already
            log.warning("could not publish the failure to the other ranks: %s", e)

    def _ack_failure(self) -> None:
        """Count this rank, once, among those that have the failure message. The count may be
        the last one the store host waits for: it can exit as soon as the store has counted it,
        before the reply reaches this rank, so a failed acknowledgement is not an error (the
        message is in hand either way)."""
        if self._hb.get("acked"):
            return
        self._hb["acked"] = True
        try:
            self.store.add(_FAILURE_ACKS, 1)
        except Exception as e:
            log.debug("failure acknowledgement not confirmed (the store host left): %s", e)

    def peer_failure(self) -> str | None:
        """The first failure any rank reported, unless it was this rank's. Once read, it is
        remembered (before it is acknowledged): the store may be gone by the next call."""
        seen = self._hb.get("peer_failure")
        if seen is not None:
            return seen
        try:
            if not self.store.check([_FAILURE_KEY]):
                return None
            msg = self.store.get(_FAILURE_KEY).decode()
        except Exception as e:  # the store lives in rank 0 (or the torchrun agent)
            return f"rank 0 (rendezvous store host): unreachable ({type(e).__name__}: {e})"
        if not msg.startswith(f"rank {self.rank}:"):
            self._hb["peer_failure"] = msg
        self._ack_failure()
        return self._hb.get("peer_failure")

    def await_failure_acks(self, timeout_s: float) -> bool:
        """Rank 0 on its way out after a failure: wait (polling, at most `timeout_s`) until
        every rank has the failure message, so that none finds the store gone before it could
        read it. True when all have it; other ranks return at once."""
        if not self.is_main:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.store.add(_FAILURE_ACKS, 0) >= self.world_size:
                    return True
            except Exception:  # the store is gone (torchrun's agent tore it down)
                return False
            if time.monotonic() >= deadline:
                log.warning(
                    "not every rank read the failure within %.0f s; exiting anyway", timeout_s
                )
                return False
            time.sleep(0.05)

    def explain_failure(self, err: BaseException) -> BaseException:
        """Called when this rank failed: if another rank failed first (e.g. this rank's
        collective broke because that peer exited), an error naming that rank; else `err`,
        after publishing it to the other ranks. Idempotent."""
        if getattr(err, "_dflash_explained", False):
            return err
        out: BaseException
        if isinstance(err, StageError) and isinstance(err.__cause__, PeerFailure):
            out = err  # raised by check_peers: names the rank
        else:
            peer = self.peer_failure()
            if peer is not None:
                out = StageError(
                    peer.split(":", 1)[0].replace(" ", ""),
                    f"{peer} (rank {self.rank} stopped because of it: {err})",
                )
                out.__cause__ = err
            else:
                self.report_failure(str(err))
                out = err
        try:
            out._dflash_explained = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return out

    def check_peers(self, events) -> None:
        """Main thread, once per tick: a peer failure becomes a StageFailure on `events`, so the
        supervisor stops this rank through its ordinary failure path."""
        peer = self.peer_failure()
        if peer is not None and not self._hb.get("reported"):
            self._hb["reported"] = True
            who = peer.split(":", 1)[0].replace(" ", "")
            events.put(StageFailure.capture(who, PeerFailure(peer)))

    # ---- metrics (store, non-blocking)
    def publish(self, snapshot: dict) -> None:
        self._seq += 1
        snapshot = dict(snapshot, rank=self.rank, seq=self._seq)
        try:
            self.store.set(f"metrics/{self.rank}", json.dumps(snapshot))
        except Exception as e:
            if not self._hb.get("publish_warned"):
                self._hb["publish_warned"] = True
                log.warning("metrics snapshot not published (%s); later failures not reported", e)

    def snapshots(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world_size):
            key = f"metrics/{r}"
            try:
                if self.store.check([key]):
                    out[r] = json.loads(self.store.get(key).decode())
            except Exception:  # best effort, like every collector
                continue
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_from_env(pipeline_cfg: PipelineConfig) -> DistContext | None:
    """Join the torchrun job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).
    None when WORLD_SIZE is unset or 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout_s = float(pipeline_cfg.collective_timeout_s)
    timeout = timedelta(seconds=timeout_s)
    drafter_dev, _, _ = cell_layout(
        pipeline_cfg.drafter_device,
        list(pipeline_cfg.target_devices),
        pipeline_cfg.cpu_threads,
        local_rank,
        local_world,
    )
    backend = "nccl" if drafter_dev.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(drafter_dev))
    # Our own rendezvous (same as init_method="env://") so that we keep the store for metrics.
    store, rank, world = next(
        dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    # A group of its own even on CPU: votes and gathers never queue behind DDP's buckets.
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    ctx = DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        backend=backend,
        timeout_s=timeout_s,
        store=dist.PrefixStore("dflash/", store),
        ctrl=ctrl,
    )
    log.info(
        "rank %d/%d (local %d/%d): %s, drafter on %s",
        rank,
        world,
        local_rank,
        local_world,
        backend,
        drafter_dev,
    )
    return ctx
