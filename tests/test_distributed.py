"""torchrun scale-out on CPU (gloo), 2 ranks, tiny models.

Each 2-rank job runs this file as a script, one process per rank: either under
`python -m torch.distributed.run --nproc-per-node 2` (the real launcher) or as two plain processes
with the torchrun environment variables set by hand (no agent that would kill the survivors, so
the failure test sees our own stop mechanism). Each rank writes `result.RANK.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":
    sys.path.insert(0, str(HERE))

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny import tiny_config, tiny_dataset, tiny_target  # noqa: E402

N = 24
STEPS = 6  # 2 epochs x 6 batches per rank / grad_accum 2
# Deterministic batches: one bucket sorted by length, pairs -> 12 global batches, 6 per rank.
# num_anchors >= any sequence length: every valid position is an anchor, so the loss does not
# depend on the anchor RNG and 2 ranks can be compared with 1 rank exactly.
BASE = {
    "objective.num_anchors": 80,
    "batching.max_batch_size": 2,
    "batching.num_buckets": 1,
    "batching.sort_window": 0,
    "batching.max_tokens": 256,
    "optim.epochs": 2,
    "optim.grad_accum": 2,
    "pipeline.collective_timeout_s": 60,
    "metrics.log_every_s": 0.3,
}


# ------------------------------------------------------------------------------ rank process
def _rank_main(spec: dict) -> None:
    import logging

    from dflash_trainer.pipeline import distributed as dmod

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s r{os.environ['RANK']} %(threadName)s %(message)s"
    )
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    checksums: list[float] = []
    synced_at: list[int] = []  # micro-steps (forwards so far) at each gradient bucket
    orig = dmod.DistContext.ddp_wrap

    def wrap(self, module):
        # Checksum of the replica's weights before every forward (micro-step).
        module.register_forward_pre_hook(
            lambda m, a: checksums.append(
                float(sum(p.detach().double().sum() for p in m.parameters()))
            )
        )
        ddp = orig(self, module)

        def counting_hook(state, bucket):
            synced_at.append(len(checksums))
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        return ddp

    dmod.DistContext.ddp_wrap = wrap
    cfg = tiny_config(Path(spec["base"]), **spec["over"])
    from dflash_trainer.run.distributed import train_distributed

    res = train_distributed(cfg, target=tiny_target(), train_set=tiny_dataset(N))
    rank = int(os.environ["RANK"])
    out = {
        "steps": res.steps,
        "reason": res.reason,
        "tokens": res.tokens,
        "losses": {str(s): m["loss"] for s, m in res.history},
        "checksums": checksums,
        "synced_at": synced_at,
        "metrics": {k: v for k, v in res.metrics.items() if k.startswith("dist/")},
    }
    (Path(spec["base"]) / f"result.{rank}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------------------ launch helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(base: Path, over: dict, timeout=120) -> subprocess.CompletedProcess:
    spec = json.dumps({"base": str(base), "over": over})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        str(HERE / "test_distributed.py"),
        spec,
    ]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def spawn_ranks(base: Path, over: dict) -> list[subprocess.Popen]:
    """Two plain processes with torchrun's environment (no agent supervising them)."""
    port, procs = _free_port(), []
    base.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"base": str(base), "over": over})
    for r in range(2):
        env = _env()
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        # Output to files, not pipes: a full pipe would block a rank that nobody reads yet.
        log = open(base / f"rank{r}.log", "w+")
        p = subprocess.Popen(
            [sys.executable, str(HERE / "test_distributed.py"), spec],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        p.log = log
        procs.append(p)
    return procs


def _wait_all(procs, timeout=120):
    outs = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        p.log.seek(0)
        outs.append((p.returncode, p.log.read()))
        p.log.close()
    return outs


def _results(base: Path) -> list[dict]:
    return [json.loads((base / f"result.{r}.json").read_text()) for r in range(2)]


def _ledger(run_dir: Path):
    rows = [json.loads(l) for l in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [(r["epoch"], s) for r in rows for s in r["samples"]]


def _weights(export_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(export_dir / "model.safetensors"))


# ------------------------------------------------------------------------------ 2 ranks vs 1
@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    t0 = time.monotonic()
    cp = torchrun(base, BASE)
    assert cp.returncode == 0, cp.stderr[-4000:]
    wall = time.monotonic() - t0
    print(f"2-rank torchrun job: {wall:.1f} s")
    return base, _results(base)


def test_two_ranks_match_one_rank_with_the_same_global_batch(two_rank, tmp_path):
    """2 ranks x 2 micro-batches of b (grad_accum 2, DDP mean of the two ranks' gradients) ==
    1 rank x 4 micro-batches of b (grad_accum 4): the same 4b samples per optimizer step, the
    same update. (The objective normalizes each micro-batch by its own token count, so a
    step is the mean over micro-batches, whether they sit on one rank or several.)"""
    base, (r0, r1) = two_rank
    ref_cfg = tiny_config(tmp_path, **dict(BASE, **{"optim.grad_accum": 4}))
    from dflash_trainer.run import train

    ref = train(ref_cfg, target=tiny_target(), train_set=tiny_dataset(N))
    assert r0["steps"] == r1["steps"] == ref.steps == STEPS
    ref_losses = {s: m["loss"] for s, m in ref.history}
    # The 1-rank run logs its step's last micro-batch, which is rank 1's batch of that step.
    assert sorted(map(int, r1["losses"])) == sorted(ref_losses) == list(range(1, STEPS + 1))
    for s, loss in r1["losses"].items():
        assert loss == pytest.approx(ref_losses[int(s)], rel=1e-4, abs=1e-5), s
    assert r0["losses"] != r1["losses"]  # the ranks did see different data
    a, b = _weights(base / "run" / "export"), _weights(ref.export_dir)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_drafter_replicas_identical_after_every_step(two_rank):
    _, (r0, r1) = two_rank
    assert len(r0["checksums"]) == len(r1["checksums"]) == 2 * STEPS  # before every micro-step
    assert r0["checksums"] == r1["checksums"]  # bitwise
    assert len(set(r0["checksums"])) == STEPS  # moved once per step


def test_gradient_accumulation_all_reduces_only_on_the_final_micro_step(two_rank):
    _, (r0, r1) = two_rank
    for r in (r0, r1):
        assert r["synced_at"], "no gradient all-reduce recorded"
        assert all(n % 2 == 0 for n in r["synced_at"]), r["synced_at"]  # never the 1st
        assert sorted(set(r["synced_at"])) == list(range(2, 2 * STEPS + 1, 2))


def test_merged_metrics_count_every_rank_tokens(two_rank):
    base, (r0, r1) = two_rank
    lengths = tiny_dataset(N).lengths
    trained = _ledger(base / "run")
    assert sorted(s for _, s in trained) == sorted(list(range(N)) * 2)  # 2 epochs, all
    expected = int(sum(lengths[s] for _, s in trained))
    assert r0["tokens"] + r1["tokens"] == expected
    assert r0["tokens"] != expected and r1["tokens"] != expected
    assert r0["metrics"]["dist/tokens_total"] == expected
    assert r0["metrics"]["dist/steps_total"] == 2 * STEPS
    assert r0["metrics"]["dist/ranks_reporting"] == 2
    assert r1["metrics"] == {}  # only rank 0 merges
    # rank 0's sinks got the merged figures too (and only rank 0 writes metrics.jsonl)
    rows = [json.loads(l) for l in (base / "run" / "metrics.jsonl").read_text().splitlines()]
    merged = [r for r in rows if "dist/tokens_total" in json.dumps(r)]
    assert merged, "no merged record in metrics.jsonl"
    last = json.dumps(merged[-1])
    assert f'"dist/tokens_total": {float(expected)}' in last
    assert '"dist/step_ms/max_rank"' in last


# ------------------------------------------------------------------------------ failure
def test_one_rank_failing_stops_the_other_naming_it(tmp_path):
    procs = spawn_ranks(
        tmp_path, dict(BASE, **{"optim.epochs": 50, "pipeline.fault": "drafter@1:3"})
    )
    t0 = time.monotonic()
    try:
        procs[1].wait(timeout=90)
        t1 = time.monotonic()
        procs[0].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (rc0, err0), (rc1, err1) = _wait_all(procs, timeout=10)
    lag = time.monotonic() - t1
    print(f"rank 1 failed after {t1 - t0:.1f} s; rank 0 exited {lag:.1f} s later")
    assert rc1 != 0 and "InjectedFault" in err1
    assert rc0 != 0, err0[-2000:]
    assert lag < 60
    line = [l for l in err0.splitlines() if l.startswith("dflash-trainer: rank 0: error")]
    assert line, err0[-3000:]
    assert "rank 1" in line[-1] and "InjectedFault" in line[-1], line[-1]


def test_the_store_host_waits_until_every_rank_has_the_failure_message():
    """Rank 0 hosts the store: leaving before a peer read the failure would leave that peer
    naming rank 0 instead of the rank that failed. A rank remembers the message once read."""
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_trainer.pipeline.distributed import DistContext

    port = _free_port()
    wait = timedelta(seconds=10)
    host = dist.TCPStore("127.0.0.1", port, 3, True, wait, wait_for_workers=False)
    ranks = [
        DistContext(r, 3, r, 3, "gloo", 10.0, store=dist.PrefixStore("dflash/", s))
        for r, s in enumerate(
            [host, *(dist.TCPStore("127.0.0.1", port, 3, False, wait) for _ in range(2))]
        )
    ]
    assert ranks[1].peer_failure() is None
    ranks[2].report_failure("InjectedFault: boom")
    assert ranks[0].peer_failure() == "rank 2: InjectedFault: boom"
    assert not ranks[0].await_failure_acks(0.2)  # rank 1 has not read it yet
    assert ranks[1].await_failure_acks(0.0)  # only the store host waits
    assert ranks[1].peer_failure() == "rank 2: InjectedFault: boom"
    assert ranks[0].await_failure_acks(5.0)
    ranks[1].store = None  # the store is gone: the message read before stays
    assert ranks[1].peer_failure() == "rank 2: InjectedFault: boom"
    assert ranks[2].peer_failure() is None  # its own failure


def test_a_rank_keeps_the_failure_even_when_its_acknowledgement_is_the_hosts_last():
    """The last acknowledgement lets the store host exit at once: the reply to it may never
    arrive. The rank already holds the message and names the rank that failed, not rank 0."""
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_trainer.pipeline.distributed import DistContext

    class HostLeavesAfterCounting:
        def __init__(self, store):
            self.store = store

        def check(self, keys):
            return self.store.check(keys)

        def get(self, key):
            return self.store.get(key)

        def add(self, key, n):
            value = self.store.add(key, n)
            if key == "failure_acks" and n:
                raise RuntimeError("Connection reset by peer")  # counted; the reply is lost
            return value

    port = _free_port()
    wait = timedelta(seconds=10)
    host = dist.TCPStore("127.0.0.1", port, 2, True, wait, wait_for_workers=False)
    failed = DistContext(1, 2, 1, 2, "gloo", 10.0, store=dist.PrefixStore("dflash/", host))
    failed.report_failure("InjectedFault: boom")
    peer = DistContext(
        0, 2, 0, 2, "gloo", 10.0, store=HostLeavesAfterCounting(dist.PrefixStore("dflash/", host))
    )
    assert peer.peer_failure() == "rank 1: InjectedFault: boom"
    assert dist.PrefixStore("dflash/", host).add("failure_acks", 0) == 2  # both counted
    assert peer.peer_failure() == "rank 1: InjectedFault: boom"  # remembered


# ------------------------------------------------------------------------------ resume
def test_resume_two_rank_checkpoint_on_one_and_two_ranks(tmp_path, two_rank):
    over = BASE
    part = tmp_path / "part"
    # SIGTERM reaches rank 1 only; the stop vote makes both ranks stop after the same step.
    outs = _wait_all(spawn_ranks(part, dict(over, **{"pipeline.fault": "drafter@1:1:sigterm"})))
    assert [rc for rc, _ in outs] == [0, 0], outs[1][1][-3000:]
    r0, r1 = _results(part)
    assert r0["reason"] == r1["reason"] == "signal"
    k = r0["steps"]
    assert r1["steps"] == k and 1 <= k < 3, k  # 3 steps per rank per epoch
    meta = json.loads((part / "run" / "checkpoints" / f"step-{k:07d}" / "state.json").read_text())
    assert meta["world_size"] == 2 and len(meta["ranks"]) == 2
    assert sorted(meta["ranks"][0]["consumed"]) == list(range(2 * k))

    # on 1 rank (this process, no torch.distributed)
    one = tmp_path / "one"
    shutil.copytree(part, one)
    from dflash_trainer.run import train

    cfg = tiny_config(one, **dict(over, **{"checkpoint.resume": True}))
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset(N))
    assert res.reason == "finished"
    # epoch 0: 8k samples done by the two ranks (k steps x 2 ranks x 2 micro-batches x 2 rows),
    # the other 24 - 8k in (24 - 8k) / 4 steps; epoch 1: 12 batches on one rank = 6 steps
    assert res.steps == k + (N - 8 * k) // 4 + 6
    # the LR schedule of the 2-rank run (STEPS) continues over the new total from step k
    final = json.loads(
        (one / "run" / "checkpoints" / f"step-{res.steps:07d}" / "state.json").read_text()
    )
    assert final["lr_segments"] == [[STEPS, 0], [res.steps, k]]
    # on 2 ranks again
    two = tmp_path / "two"
    shutil.copytree(part, two)
    for f in two.glob("result.*.json"):
        f.unlink()
    outs = _wait_all(spawn_ranks(two, dict(over, **{"checkpoint.resume": True})))
    assert [rc for rc, _ in outs] == [0, 0], outs[0][1][-3000:]
    resumed = _results(two)
    assert [r["steps"] for r in resumed] == [STEPS, STEPS]
    # Same world size: exact. Losses of steps k+1.. match the uninterrupted 2-rank run.
    for r in range(2):
        full = two_rank[1][r]["losses"]
        got = resumed[r]["losses"]
        assert sorted(map(int, got)) == list(range(k + 1, STEPS + 1))
        for s_, loss in got.items():
            assert loss == pytest.approx(full[s_], rel=1e-5, abs=1e-6), (r, s_)

    for run in (one / "run", two / "run"):
        ledger = _ledger(run)
        for epoch in range(2):
            ids = sorted(s for e, s in ledger if e == epoch)
            assert ids == list(range(N)), (run, epoch, ids)  # each sample exactly once


def test_cli_nproc_launches_torchrun_end_to_end(tmp_path):
    """`dflash-trainer train --nproc 2` -> torchrun -> 2 ranks loading a local HF target and a
    JSONL file through the normal CLI path (data prepared by rank 0 first)."""
    import random

    from conftest import CHATML_SPECIALS, CHATML_TEMPLATE, WORDS, word_tokenizer

    tiny_target().model.save_pretrained(tmp_path / "target")
    word_tokenizer(CHATML_SPECIALS, CHATML_TEMPLATE).save_pretrained(tmp_path / "target")
    rng = random.Random(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(40):
            say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": say(6)},
                            {"role": "assistant", "content": say(30)},
                        ]
                    }
                )
                + "\n"
            )
    run = tmp_path / "run"
    flags = {
        "run_dir": run,
        "target.model": tmp_path / "target",
        "target.taps": "[1,2]",
        "data.sources": f'["{tmp_path / "data.jsonl"}"]',
        "data.cache_dir": tmp_path / "c",
        "drafter.num_layers": 1,
        "drafter.num_heads": 4,
        "drafter.num_kv_heads": 2,
        "drafter.head_dim": 16,
        "drafter.intermediate_size": 64,
        "drafter.block_size": 4,
        "objective.num_anchors": 8,
        "batching.max_tokens": 512,
        "optim.epochs": 2,
        "metrics.wandb": "off",
        "metrics.tensorboard": "false",
        "metrics.console": "false",
        "pipeline.cpu_threads": 2,
    }
    cmd = [
        sys.executable,
        "-m",
        "dflash_trainer",
        "train",
        "--nproc",
        "2",
        *[f"--{k}={v}" for k, v in flags.items()],
    ]
    cp = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "trained" in cp.stdout and "(finished)" in cp.stdout, cp.stdout
    assert (run / "train.rank1.log").is_file() and (run / "export" / "model.safetensors").is_file()
    meta = json.loads(
        (run / "checkpoints" / "latest")
        .parent.joinpath((run / "checkpoints" / "latest").read_text().strip(), "state.json")
        .read_text()
    )
    assert meta["world_size"] == 2
    ledger = _ledger(run)
    n_train = len({s for _, s in ledger})
    assert sorted(s for e, s in ledger if e == 1) == sorted(s for e, s in ledger if e == 0)
    assert 30 <= n_train <= 36  # 40 minus held-out minus the dropped tail
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    totals = [r["dist/tokens_total"] for r in rows if "dist/tokens_total" in r]
    assert totals and totals[-1] == sum(r["tokens"] for r in meta["ranks"])


def test_cell_layout_offsets_cuda_devices_and_splits_cpu_threads():
    from dflash_trainer.cli import build_parser, config_overrides
    from dflash_trainer.commands.train import torchrun_argv
    from dflash_trainer.pipeline.distributed import cell_layout

    assert cell_layout("cuda:0", ["cuda:1", "cuda:2", "cuda:3"], 0, 1, 2) == (
        "cuda:4",
        ["cuda:5", "cuda:6", "cuda:7"],
        max(1, (os.cpu_count() or 1) // 2),
    )
    assert cell_layout("cuda", ["cuda:1"], 0, 3, 4)[:2] == ("cuda:6", ["cuda:7"])
    assert cell_layout("cpu", ["cpu"], 8, 1, 2) == ("cpu", ["cpu"], 4)
    assert cell_layout("cpu", ["cpu"], 1, 1, 2)[2] == 1
    # the relaunched command line is the parsed one without --nproc (in either spelling)
    argv = ["train", "--nproc", "2", "--optim.lr=1e-3", "--nproc=2", "--preset", "smollm2-cpu"]
    args, rest = build_parser().parse_known_args(argv)
    args.overrides = config_overrides(args, rest)
    cmd = torchrun_argv(args.nproc, args)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert cmd[6:] == ["dflash_trainer", "train", "--preset", "smollm2-cpu", "--optim.lr=1e-3"]


def test_merge_snapshots_sums_counters_and_names_stragglers():
    from dflash_trainer.observe.ranks import merge_snapshots

    m = merge_snapshots(
        {
            0: {"tokens": 10, "steps": 3, "micro_steps": 3, "step_ms": 5.0},
            1: {"tokens": 7, "steps": 3, "micro_steps": 3, "step_ms": 9.0},
            2: {"tokens": 1, "steps": 2, "micro_steps": 2, "step_ms": 2.0},
        },
        3,
    )
    assert m["dist/tokens_total"] == 18 and m["dist/steps_total"] == 8
    assert m["dist/steps_spread"] == 1
    assert (m["dist/step_ms/max"], m["dist/step_ms/max_rank"]) == (9.0, 1)
    assert (m["dist/step_ms/min"], m["dist/step_ms/min_rank"]) == (2.0, 2)
    assert m["dist/step_ms/mean"] == pytest.approx(16 / 3)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
