"""The memory plan (run/memory_plan.py) against the memory a real drafter step takes.

The reference is the CPU allocator itself: torch.profiler with profile_memory records every
allocation and free of the step run for real (forward and backward, real tensors), and the
largest sum of live bytes is the step's measured peak. The plan runs the same step on fake tensors
(no storage) and must land within 20% of it (it is exact where the shapes are the ones measured;
the plan extends one and two rows to the batch's rows). Shapes: tiny (the tests' sizes) and
medium (hidden 256, 4 rows x 512 tokens, 128 anchors: ~0.5 GiB). fp32 and bf16 autocast, so a
CPU with native bf16 and one without are both covered (autocast on a CPU without it still
allocates bf16 copies: the tensors' sizes do not depend on the kernels)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dflash_trainer.config import Config
from dflash_trainer.errors import UserError
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.packed_linear import FrozenMatmuls
from dflash_trainer.run.build import build_objective
from dflash_trainer.run.memory_plan import GiB, MemoryPlan, plan_memory
from tiny import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(hidden: int, anchors: int, rows: int, tokens: int):
    cfg = Config()
    cfg.objective.num_anchors = anchors
    cfg.drafter.num_layers = 2
    cfg.batching.max_batch_size = rows
    cfg.batching.max_tokens = rows * tokens
    cfg.data.max_length = tokens
    target = tiny_target(hidden=hidden, vocab=2048, layers=6)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig.from_configs(cfg.drafter, target))
    return cfg, target, drafter, build_objective(cfg, drafter)


def _measured_peak(cfg, target, drafter, objective, autocast: bool) -> int:
    """Gradients + activations + temporaries of one real step at the plan's batch: the CPU
    allocator's largest live bytes during it, above what was allocated before it."""
    rows, tokens = cfg.batching.max_batch_size, cfg.data.max_length
    V, H = target.vocab_size, target.hidden_size
    dtype = torch.bfloat16 if autocast else torch.float32
    embed = torch.randn(V, H, dtype=dtype)
    head = torch.nn.Linear(H, V, bias=False, dtype=dtype).requires_grad_(False)
    feats = torch.randn(rows, tokens, len(target.layer_ids) * H, dtype=dtype)
    ids = torch.randint(0, V, (rows, tokens))
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = objective(drafter, embed, head, feats, ids, mask, gen, None)
        out.loss.backward()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(
    "shape",
    [(64, 32, 2, 128), (256, 128, 4, 512)],
    ids=["tiny", "medium"],
)
def test_the_plan_is_within_20_percent_of_the_measured_peak(shape, autocast):
    cfg, target, drafter, objective = _setup(*shape)
    dtype = torch.bfloat16 if autocast else torch.float32
    # the features and the frozen heads in the dtype _measured_peak gives them
    plan = plan_memory(
        cfg, drafter, objective, target.vocab_size, torch.device("cpu"), autocast, dtype, dtype
    )
    measured = _measured_peak(cfg, target, drafter, objective, autocast)
    assert plan.step_peak == pytest.approx(measured, rel=0.2), (plan.step_peak, measured)
    # the exact parts: what AdamW keeps is two fp32 moments per trainable parameter
    n = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert 8 * n <= plan.optimizer <= 8 * n + 4 * len(list(drafter.parameters()))
    assert plan.per_block > 0 and plan.rows * plan.anchors * plan.per_block < plan.step_peak
    assert plan.total > plan.step_peak + plan.parameters + plan.optimizer
    # the embedding and LM head, and in fp32 on a CPU the LM head's two packed copies
    head = target.vocab_size * target.hidden_size * dtype.itemsize
    packed = (
        2 * head
        if not autocast and FrozenMatmuls.packs(dtype, torch.device("cpu"), head, False)
        else 0
    )
    assert plan.frozen == 2 * head + packed


def test_a_plan_over_the_device_is_refused_naming_the_knobs(caplog):
    plan = MemoryPlan(
        device="cuda:0",
        rows=8,
        tokens=2048,
        anchors=512,
        parameters=4 * GiB,
        frozen=2 * GiB,
        optimizer=8 * GiB,
        step_peak=91 * GiB,
        per_block=21 << 20,
        features=4 * GiB,
        target=0,
        feature_cache=0,
        capacity=80 * GiB,
    )
    with pytest.raises(UserError) as e:
        plan.check("refuse")
    msg = str(e.value)
    assert "109.0 GiB on cuda:0" in msg and "objective.num_anchors (now 512" in msg
    assert "batching.max_batch_size (now 8 rows)" in msg and "pipeline.hs_queue_size" in msg
    plan.check("warn")  # warns, runs
    assert "109.0 GiB" in caplog.text
    fits = dataclasses.replace(plan, step_peak=40 * GiB)
    fits.check("refuse")  # 58 GiB of 80: no error
    assert fits.record()["mem/plan_gib"] == pytest.approx(58.0)


def test_a_run_logs_its_plan_and_stops_before_any_step_when_it_cannot_fit(tmp_path, monkeypatch):
    """train(): the plan is one metrics event at the start; a plan over the device stops the run
    at start-up, before a checkpoint or a step exists."""
    import json

    from dflash_trainer.run import memory_plan, train
    from tiny import tiny_config, tiny_dataset

    ds = tiny_dataset(n=16)
    cfg = tiny_config(tmp_path, **{"optim.max_steps": 2})
    res = train(cfg, target=tiny_target(), train_set=ds.subset(range(12)))
    events = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    plans = [e for e in events if "mem/plan_gib" in e]
    assert len(plans) == 1 and 0 < plans[0]["mem/plan_gib"] < plans[0]["mem/capacity_gib"]

    monkeypatch.setattr(memory_plan, "device_capacity", lambda device: 1 << 20)  # 1 MiB
    cfg = tiny_config(tmp_path / "small", **{"optim.max_steps": 2})
    with pytest.raises(UserError, match="more than 92% of its 0.0 GiB"):
        train(cfg, target=tiny_target(), train_set=ds.subset(range(12)))
    assert not (tmp_path / "small" / "run" / "checkpoints").exists()


def test_the_feature_cache_counts_no_more_than_the_data_it_can_hold():
    """A CPU run's feature cache takes at most its budget and at most every training token's
    features once: a large budget over a small data set is not planned as full."""
    cfg, target, drafter, objective = _setup(64, 32, 2, 128)
    cfg.pipeline.feature_cache_gb = 6.0
    width = len(target.layer_ids) * target.hidden_size
    cpu, fp32 = torch.device("cpu"), torch.float32
    args = (cfg, drafter, objective, target.vocab_size, cpu, False, fp32, fp32)
    assert plan_memory(*args).feature_cache == 6 * GiB
    assert plan_memory(*args, data_tokens=10_000).feature_cache == 10_000 * width * 4
