"""The multi-device and multi-process phases of bench/gpu_check.py, and what they share with it.

Every phase here trains the same small job: a random Qwen3-shaped target of 8 layers (hidden 64,
built on the CPU from a seed and then moved, so every process and every device holds the same
weights), a 1-layer drafter, 32 short rows (32-96 tokens) in 8 batches of 4 rows per epoch, 3
epochs = 24 optimizer steps. `objective.num_anchors` covers every position of the longest row, so
the loss does not depend on the anchor sampler and one process can be compared with another step
for step (tests/test_distributed.py's reasoning). Devices: DEV0 (the drafter's) and DEV1 (the
target's): cuda:0 and cuda:1 on a machine with two GPUs, cpu and cpu with `--multi-cpu`.

  reference      in-process, sequential schedule, target and drafter on DEV0: the losses every
                 other run here is compared with
  cross_device   in-process, pipelined, two target workers on DEV1 (target_devices=DEV1,DEV1),
                 the drafter on DEV0, the target's stream delayed before every forward so that the
                 drafter waits for features on every batch (an unsafe cross-device hand-off reads
                 unwritten memory: loss differences or skipped steps)
  sigterm_resume two subprocesses (this file run as a script) with the cross_device layout: the
                 first gets a real SIGTERM at drafter step 9 (pipeline.fault=drafter:9:sigterm,
                 os.kill of its own pid), stops gracefully and checkpoints; the second resumes
                 (checkpoint.resume=true). The resumed steps are the reference's, the ledger holds
                 every sample once per epoch (tests/test_ordering.py's check, on CUDA)
  split          `torchrun --nproc-per-node=2` with pipeline.split=1:1 (rank 0 drafter on DEV0,
                 rank 1 target on DEV1; NCCL on CUDA, gloo on CPU): finite losses equal to the
                 reference's (tests/test_split.py's layout)

The subprocesses rebuild the target from its seed instead of loading a saved one, and get the
rows as an in-memory dataset (the library entry point `train`, as gpu_check's own runs): the
product's CLI and data loading are not what these phases check.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

# Per-step losses of two runs of the same batches are equal within this relative tolerance. bf16
# keeps 8 significant bits (rounding steps of 2^-8 = 0.4% relative): another kernel, reduction
# order or stream interleaving flips roundings in the target's features and the drafter's
# gradients, and Adam updates carry them into every later step; over a 16-24 step run that is
# expected to stay at a few 1e-3. An unsafe hand-off (the drafter reading features the target has
# not written yet) trains on stale or uninitialised memory: differences of order 1, or non-finite
# losses (skipped steps). 2e-2 sits between the two. fp32 on a CPU differs by ~1e-6 at most.
LOSS_RTOL = 2e-2

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
TINY_DRAFTER = [
    "--drafter.num_layers=1",
    "--drafter.num_heads=4",
    "--drafter.num_kv_heads=2",
    "--drafter.head_dim=16",
    "--drafter.intermediate_size=128",
    "--objective.num_anchors=8",
    "--target.num_taps=2",
]
ROWS, MIN_LEN, MAX_LEN, EPOCHS = 32, 32, 96, 3
SIGTERM_STEP = 9
# time.time() by which gpu_check must print its table (set by it): a subprocess still running
# then is killed, its phase failing, instead of the whole check running into its timeout
DEADLINE: float | None = None


# --------------------------------------------------------------------------- shared helpers
def alloc_counters() -> tuple[int, int]:
    """(num_alloc_retries, num_ooms) of the CUDA caching allocator, summed over the visible
    devices, cumulative since the process started; (0, 0) without CUDA."""
    if not torch.cuda.is_available():
        return 0, 0
    retries = ooms = 0
    for i in range(torch.cuda.device_count()):
        s = torch.cuda.memory_stats(i)
        retries += int(s.get("num_alloc_retries", 0))
        ooms += int(s.get("num_ooms", 0))
    return retries, ooms


def summarize(r) -> dict:
    """What every phase reports of one TrainResult: steps, reason, tokens, per-step losses and
    skipped (non-finite) optimizer steps (the ring's per-step count and the last snapshot's)."""
    skipped = float((r.metrics or {}).get("drafter/skipped_total", 0.0))
    for _, m in r.history:
        skipped = max(skipped, float(m.get("skipped_total", 0.0)))
    return {
        "steps": r.steps,
        "reason": r.reason,
        "tokens": r.tokens,
        "wall_s": r.wall_s,
        "train_s": r.train_s,
        "losses": {int(step): float(m["loss"]) for step, m in r.history if "loss" in m},
        "skipped": skipped,
    }


def loss_gap(a: dict, b: dict) -> float:
    """Largest relative per-step difference of losses `a` against `b` over their common steps
    (keys may be ints or strings); inf when a loss is not finite, nan with no common step."""
    a = {int(k): v for k, v in a.items()}
    b = {int(k): v for k, v in b.items()}
    common = sorted(set(a) & set(b))
    if not common:
        return float("nan")
    gaps = []
    for k in common:
        if not (math.isfinite(a[k]) and math.isfinite(b[k])):
            return float("inf")
        gaps.append(abs(a[k] - b[k]) / max(abs(b[k]), 1e-9))
    return max(gaps)


def sleep_cycles_per_s(device: torch.device) -> float:
    """Clock cycles per second of torch.cuda._sleep on `device` (measured with CUDA events)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20_000_000
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        return n / (a.elapsed_time(b) / 1e3)


@contextlib.contextmanager
def slow_target_stream(target, delay_s: float):
    """Delay the target's work on its CUDA stream by `delay_s` before every tapped forward: the
    target's `features` is wrapped (on this instance only) to issue torch.cuda._sleep on the
    current stream of its device, which inside TargetStep is the target worker's own stream. The
    host returns at once, so the hand-off reaches the drafter while the features are still
    unwritten on the device; only the event wait keeps the drafter from reading them. Yields the
    cycles slept per forward (0: no delay, on a CPU)."""
    dev = torch.device(target.device)
    if dev.type != "cuda" or delay_s <= 0:
        yield 0
        return
    cycles = int(delay_s * sleep_cycles_per_s(dev))
    orig = target.features

    def features(*a, **kw):
        with torch.cuda.device(dev):
            torch.cuda._sleep(cycles)
        return orig(*a, **kw)

    target.features = features
    try:
        yield cycles
    finally:
        del target.features


# --------------------------------------------------------------------------- the small job
def tiny_target(device: str, seed: int = 0):
    """The small job's target on `device`: the same weights in every process (built on the CPU
    from `seed`, then moved; bf16 on CUDA)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_trainer.models.target import TargetModel, tap_layer_ids

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        **TINY, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False
    )
    model = Qwen3ForCausalLM(cfg)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model.to(device=device, dtype=dtype)
    taps = tap_layer_ids(TINY["num_hidden_layers"], 2)
    return TargetModel.from_hf(model, None, taps, name="random-Qwen3-8L-tiny")


def tiny_rows(seed: int = 0):
    """ROWS rows of MIN_LEN..MAX_LEN random tokens (ids >= 3), the last 70% supervised."""
    from dflash_trainer.data.chat import TokenizedDataset

    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for n in rng.integers(MIN_LEN, MAX_LEN + 1, ROWS):
        ids.append(rng.integers(3, TINY["vocab_size"], int(n)).astype(np.int32))
        m = np.zeros(int(n), np.uint8)
        m[max(4, int(n * 0.3)) :] = 1
        masks.append(m)
    return TokenizedDataset(ids, masks, [f"m{i}" for i in range(ROWS)])


def tiny_cfg(run_dir, targets: list[str], drafter: str, schedule: str = "pipelined", **over):
    from dflash_trainer.config_io import load_config

    flags = {
        "run_dir": str(run_dir),
        "pipeline.target_devices": ",".join(targets),
        "pipeline.drafter_device": drafter,
        "pipeline.schedule": schedule,
        "pipeline.memory_plan": "off",
        # the split form on CUDA too: FlexAttention would compile anew in every subprocess (tens
        # of seconds each); these phases check hand-offs, resume and ranks, not the attention
        "drafter.attention": "split",
        "pipeline.poll_s": 0.05,
        "pipeline.collective_timeout_s": 60,
        "optim.epochs": EPOCHS,
        "optim.warmup_ratio": 0.0,
        "data.max_length": 128,
        "batching.max_tokens": 512,
        "batching.max_batch_size": 4,
        "batching.num_buckets": 1,
        "batching.sort_window": 0,
        "checkpoint.keep_last": 2,
        "metrics.wandb": "off",
        "metrics.tensorboard": False,
        "metrics.console": False,
        "metrics.tick_s": 0.05,
        "metrics.log_every_s": 0.5,
    }
    flags.update(over)
    # every position of the longest row an anchor: losses independent of the anchor sampler
    drafter_flags = [f for f in TINY_DRAFTER if not f.startswith("--objective.num_anchors")]
    return load_config(
        "qwen3-8b",
        None,
        [*drafter_flags, f"--objective.num_anchors={MAX_LEN}"]
        + [f"--{k}={v}" for k, v in flags.items()],
    )


def ledger_exact(run_dir: Path) -> bool:
    """Every row trained exactly once in every epoch (the run's ledger.jsonl)."""
    path = Path(run_dir) / "ledger.jsonl"
    if not path.is_file():
        return False
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = [(r["epoch"], s) for r in rows for s in r["samples"]]
    return all(
        sorted(s for e, s in pairs if e == epoch) == list(range(ROWS)) for epoch in range(EPOCHS)
    )


# --------------------------------------------------------------------------- in the children
def _child(spec: dict) -> None:
    """One subprocess (or one torchrun rank): train the small job, write result[.RANK].json."""
    import logging

    rank = os.environ.get("RANK")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s r{rank or '-'} %(threadName)s %(levelname)s %(message)s",
    )
    base = Path(spec["base"])
    before = alloc_counters()
    if rank is not None:  # a split rank: one device each, cuda:LOCAL_RANK (or cpu)
        from dflash_trainer.run.distributed import train_distributed

        local = int(os.environ["LOCAL_RANK"])
        dev = f"cuda:{local}" if spec["drafter"].startswith("cuda") else "cpu"
        cfg = tiny_cfg(base / "run", [spec["drafter"]], spec["drafter"], **spec["over"])
        r = train_distributed(cfg, target=tiny_target(dev), train_set=tiny_rows())
        out_path = base / f"result.{rank}.json"
    else:
        from dflash_trainer.run import train

        cfg = tiny_cfg(base / "run", spec["targets"], spec["drafter"], **spec["over"])
        r = train(cfg, target=tiny_target(spec["targets"][0]), train_set=tiny_rows())
        out_path = base / "result.json"
    after = alloc_counters()
    row = summarize(r)
    row["alloc_retries"], row["ooms"] = after[0] - before[0], after[1] - before[1]
    out_path.write_text(json.dumps(row))


# --------------------------------------------------------------------------- in gpu_check
def _env(cpu: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cmd: list[str], log: Path, timeout: float, cpu: bool) -> float:
    """Run `cmd` in its own session (its output to `log`); past `timeout` (or the DEADLINE), or
    when this process is stopped meanwhile, its whole process group (the launcher and the ranks
    it started) is killed. Returns its wall time; raises with the log's tail when it fails."""
    if DEADLINE is not None:
        timeout = max(5.0, min(timeout, DEADLINE - time.time()))
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=_env(cpu), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # timed out, or this process is being stopped: none of its children outlive it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        tail = log.read_text()[-4000:]
        what = "timed out" if rc is None else f"exited {rc}"
        raise RuntimeError(f"{' '.join(cmd[:4])} ... {what} after {timeout:.0f} s:\n{tail}")
    return time.monotonic() - t0


def child_run(base: Path, spec: dict, timeout: float = 150) -> dict:
    """This file as a script in a subprocess: one single-process run of the small job."""
    base.mkdir(parents=True, exist_ok=True)
    spec = {"base": str(base), **spec}
    cmd = [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)]
    wall = _launch(cmd, base / "child.log", timeout, spec["drafter"] == "cpu")
    row = json.loads((base / "result.json").read_text())
    row["process_wall_s"] = wall
    (base / "result.json").unlink()
    return row


def torchrun(base: Path, spec: dict, nproc: int = 2, timeout: float = 180) -> list[dict]:
    """`python -m torch.distributed.run --nproc-per-node=NPROC` over this file: one rank each."""
    base.mkdir(parents=True, exist_ok=True)
    spec = {"base": str(base), **spec}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={_free_port()}",
        str(Path(__file__).resolve()),
        json.dumps(spec),
    ]
    wall = _launch(cmd, base / "torchrun.log", timeout, spec["drafter"] == "cpu")
    rows = [json.loads((base / f"result.{r}.json").read_text()) for r in range(nproc)]
    for r in rows:
        r["process_wall_s"] = wall
    return rows


def reference(base: Path, dev0: str) -> dict:
    """The small job in this process, sequential, target and drafter on `dev0`."""
    from dflash_trainer.run import train

    before = alloc_counters()
    cfg = tiny_cfg(base / "reference", [dev0], dev0, schedule="sequential")
    row = summarize(train(cfg, target=tiny_target(dev0), train_set=tiny_rows()))
    after = alloc_counters()
    row["alloc_retries"], row["ooms"] = after[0] - before[0], after[1] - before[1]
    return row


def cross_device(base: Path, dev0: str, dev1: str, ref: dict | None) -> dict:
    """Two target workers on `dev1`, the drafter on `dev0`, pipelined, the target's stream
    delayed before every forward by twice the reference's time per step (at least 20 ms): the
    drafter waits for the target on every batch."""
    from dflash_trainer.run import train

    per_step = (ref or {}).get("train_s", 0.0) / max(1, (ref or {}).get("steps", 1))
    delay = max(0.02, min(0.5, 2 * per_step)) if dev1.startswith("cuda") else 0.0
    target = tiny_target(dev1)
    before = alloc_counters()
    cfg = tiny_cfg(base / "cross", [dev1, dev1], dev0)
    with slow_target_stream(target, delay) as cycles:
        r = train(cfg, target=target, train_set=tiny_rows())
    after = alloc_counters()
    row = summarize(r)
    row["alloc_retries"], row["ooms"] = after[0] - before[0], after[1] - before[1]
    row["delay_ms"], row["sleep_cycles"] = delay * 1e3, cycles
    row["loss_gap"] = loss_gap(row["losses"], ref["losses"]) if ref else float("nan")
    return row


def sigterm_resume(base: Path, dev0: str, dev1: str, ref: dict | None) -> dict:
    """SIGTERM at drafter step SIGTERM_STEP in one subprocess, resume in another."""
    root = base / "resume"
    layout = {"targets": [dev1, dev1], "drafter": dev0}
    part = child_run(
        root, {**layout, "over": {"pipeline.fault": f"drafter:{SIGTERM_STEP}:sigterm"}}
    )
    rest = child_run(root, {**layout, "over": {"checkpoint.resume": True}})
    k = part["steps"]
    total = ref["steps"] if ref else None
    resumed = sorted(int(s) for s in rest["losses"])
    out = {
        "interrupted": part,
        "resumed": rest,
        "stopped_by_signal": part["reason"] == "signal",
        "stopped_at": k,
        "resumed_steps_ok": bool(resumed)
        and resumed[0] == k + 1
        and resumed == list(range(k + 1, resumed[-1] + 1))
        and (total is None or rest["steps"] == total),
        "ledger_exact": ledger_exact(root / "run"),
        "skipped": max(part["skipped"], rest["skipped"]),
        "alloc_retries": part["alloc_retries"] + rest["alloc_retries"],
        "ooms": part["ooms"] + rest["ooms"],
    }
    if ref:
        both = {**part["losses"], **rest["losses"]}
        out["loss_gap"] = loss_gap(both, ref["losses"])
        out["loss_gap_resumed"] = loss_gap(rest["losses"], ref["losses"])
    else:
        out["loss_gap"] = out["loss_gap_resumed"] = float("nan")
    return out


def split(base: Path, dev0: str, ref: dict | None) -> dict:
    """torchrun, 2 ranks, pipeline.split=1:1 (rank 0 drafter, rank 1 target)."""
    d, t = torchrun(base / "split", {"drafter": dev0, "over": {"pipeline.split": "1:1"}})
    losses = d["losses"]
    return {
        "drafter_rank": d,
        "target_rank": {k: v for k, v in t.items() if k != "losses"},
        "backend": "nccl" if dev0.startswith("cuda") else "gloo",
        "finite": bool(losses) and all(math.isfinite(v) for v in losses.values()),
        "loss_gap": loss_gap(losses, ref["losses"]) if ref else float("nan"),
        "skipped": d["skipped"],
        "alloc_retries": d["alloc_retries"] + t["alloc_retries"],
        "ooms": d["ooms"] + t["ooms"],
    }


if __name__ == "__main__":
    sys.path.insert(0, str(SRC))
    _child(json.loads(sys.argv[1]))
