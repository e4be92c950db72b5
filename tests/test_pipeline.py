"""End to end on tiny random models: the pipeline trains, resumes exactly, fails loudly."""

import json
import time

import pytest
import torch

from dflash_trainer.pipeline.runtime import StageError
from dflash_trainer.precision import resolve_dtype, use_autocast
from dflash_trainer.run import train
from dflash_trainer.run.hooks import SteadyRate
from tiny import tiny_config, tiny_dataset, tiny_target


def _run(tmp_path, **over):
    cfg = tiny_config(tmp_path, **over)
    return train(cfg, target=tiny_target(), train_set=tiny_dataset())


def _losses(result):
    return {step: m["loss"] for step, m in result.history}


def _ledger(run_dir):
    rows = [json.loads(l) for l in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [(r["epoch"], s) for r in rows for s in r["samples"]]


def assert_resumed_exactly(full, res, first: int, epochs: int = 3) -> None:
    """The resumed run `res` trains the uninterrupted run's steps from `first` on, loss for
    loss, and its ledger holds every sample of every epoch exactly once."""
    lf, lr = _losses(full), _losses(res)
    assert min(lr) == first and max(lr) == full.steps
    for step in lr:
        assert lr[step] == pytest.approx(lf[step], rel=1e-5, abs=1e-6), step
    ledger = _ledger(res.run_dir)
    lines = (res.run_dir / "ledger.jsonl").read_text()  # shown whole when a check fails
    for epoch in range(epochs):
        got = sorted(s for e, s in ledger if e == epoch)
        assert got == list(range(len(tiny_dataset()))), (epoch, lines)


@pytest.mark.parametrize("schedule", ["pipelined", "sequential"])
def test_trains_and_loss_falls(tmp_path, schedule):
    res = _run(tmp_path, **{"pipeline.schedule": schedule, "optim.epochs": 6})
    losses = [m["loss"] for _, m in res.history]
    assert res.steps == len(losses) > 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first * 0.9, (first, last)
    assert (res.export_dir / "model.safetensors").is_file()
    # every sample exactly once per epoch
    ledger = _ledger(res.run_dir)
    for epoch in range(6):
        ids = sorted(s for e, s in ledger if e == epoch)
        assert ids == list(range(len(tiny_dataset()))), epoch


def test_schedules_give_identical_losses(tmp_path):
    a = _run(tmp_path / "a", **{"pipeline.schedule": "pipelined"})
    b = _run(tmp_path / "b", **{"pipeline.schedule": "sequential"})
    la, lb = _losses(a), _losses(b)
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k] == pytest.approx(lb[k], rel=1e-5, abs=1e-6)


def test_resume_after_sigterm_matches_uninterrupted(tmp_path):
    full = _run(tmp_path / "full", **{"optim.epochs": 3})
    part = _run(tmp_path / "run2", **{"optim.epochs": 3, "pipeline.fault": "drafter:9:sigterm"})
    assert part.reason == "signal"
    k = part.steps
    assert 9 <= k < full.steps
    cfg = tiny_config(tmp_path / "run2", **{"optim.epochs": 3, "checkpoint.resume": True})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    lf, lr = _losses(full), _losses(res)
    assert min(lr) == k + 1 and max(lr) == full.steps
    for step in lr:
        assert lr[step] == pytest.approx(lf[step], rel=1e-5, abs=1e-6), step
    ledger = _ledger(res.run_dir)
    for epoch in range(3):
        assert sorted(s for e, s in ledger if e == epoch) == list(range(len(tiny_dataset())))


def test_resume_from_background_checkpoint_after_a_crash_matches_uninterrupted(tmp_path):
    """Periodic checkpoints are written on a background thread from a host snapshot; a stage
    failure later leaves the last of them as `latest`. Resuming from it reproduces the
    uninterrupted losses, and the ledger holds every sample once per epoch."""
    full = _run(tmp_path / "full", **{"optim.epochs": 3})
    over = {"optim.epochs": 3, "checkpoint.every_steps": 4}
    with pytest.raises(StageError, match="injected fault in stage 'drafter' at step 10"):
        _run(tmp_path / "run2", **over, **{"pipeline.fault": "drafter:10"})
    from dflash_trainer.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "run2" / "run").name == "step-0000008"
    cfg = tiny_config(tmp_path / "run2", **over, **{"checkpoint.resume": True})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert_resumed_exactly(full, res, first=9)


def test_resume_after_a_kill_before_the_ledger_append_holds_every_sample(tmp_path, monkeypatch):
    """The process dies after `latest` names step 8 and before the writer appends step 8's
    ledger entries: the resume restores them from the checkpoint, and the ledger holds every
    sample once per epoch."""
    from dflash_trainer import checkpoint as C

    full = _run(tmp_path / "full", **{"optim.epochs": 3})
    over = {"optim.epochs": 3, "checkpoint.every_steps": 4}
    append = C.append_ledger

    def killed_at_8(run_dir, entries, step):
        if step != 8:
            append(run_dir, entries, step)

    monkeypatch.setattr(C, "append_ledger", killed_at_8)
    with pytest.raises(StageError, match="injected fault in stage 'drafter' at step 10"):
        _run(tmp_path / "run2", **over, **{"pipeline.fault": "drafter:10"})
    monkeypatch.undo()
    rows = _ledger(tmp_path / "run2" / "run")
    assert C.latest_checkpoint(tmp_path / "run2" / "run").name == "step-0000008"
    cfg = tiny_config(tmp_path / "run2", **over, **{"checkpoint.resume": True})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert len(_ledger(res.run_dir)) > len(rows)
    assert_resumed_exactly(full, res, first=9)


@pytest.mark.parametrize(
    "schedule,stage",
    [
        ("pipelined", "prefetch"),
        ("pipelined", "target"),
        ("pipelined", "drafter"),
        ("sequential", "target"),
    ],
)
def test_fault_in_a_stage_stops_the_run_naming_it(tmp_path, schedule, stage):
    t0 = time.monotonic()
    worker = "sequential0" if schedule == "sequential" else stage
    with pytest.raises(
        StageError,
        match=rf"stage '{worker}\w*' failed: InjectedFault: "
        rf"injected fault in stage '{stage}",
    ):
        _run(tmp_path, **{"pipeline.schedule": schedule, "pipeline.fault": f"{stage}:3"})
    assert time.monotonic() - t0 < 30


def test_hung_stage_is_detected_by_the_stall_detector(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(StageError, match=r"stage 'target0' failed: no progress"):
        _run(
            tmp_path,
            **{
                "pipeline.fault": "target:2:hang",
                "pipeline.stall_timeout_s": 2,
                "pipeline.shutdown_deadline_s": 2,
            },
        )
    assert time.monotonic() - t0 < 30


class _NanTarget:
    """Wraps a target so that its features are NaN: every step is non-finite."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def features(self, ids, attn, final=False):
        if final:
            feats, last = self.inner.features(ids, attn, final=True)
            return feats * float("nan"), last
        return self.inner.features(ids, attn) * float("nan")


def test_nonfinite_steps_are_skipped_then_abort(tmp_path):
    # NaN from the first batch would be refused by the startup tap check (tested in
    # test_target); this test is about NaN that appears mid-run, so the check is off here.
    cfg = tiny_config(
        tmp_path,
        **{"optim.max_consecutive_skips": 4, "optim.epochs": 6, "target.check_taps": False},
    )
    target = tiny_target()
    with pytest.raises(StageError, match="consecutive optimizer steps had a non-finite"):
        train(cfg, target=_NanTarget(target), train_set=tiny_dataset())


def test_periodic_eval_keeps_the_best_drafter(tmp_path):
    ds = tiny_dataset(n=28)
    train_set, heldout = ds.subset(range(24)), ds.subset(range(24, 28))
    cfg = tiny_config(
        tmp_path,
        **{
            "eval.every_steps": 10,
            "eval.periodic_prompts": 2,
            "eval.max_new_tokens": 8,
            "optim.epochs": 3,
        },
    )
    res = train(cfg, target=tiny_target(), train_set=train_set, heldout=heldout)
    # the training rate's time excludes start-up, the final checkpoint, evaluation and export
    assert 0 < res.train_s < res.wall_s
    assert res.steady_tok_s > 0
    rows = [json.loads(l) for l in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    taus = [r for r in rows if any("eval/tau" in str(k) for k in r)]
    assert len(taus) >= 2
    best = json.loads((res.run_dir / "best" / "eval.json").read_text())
    assert best["tau"] >= 1.0
    from dflash_trainer.models.export import load_drafter

    load_drafter(res.run_dir / "best", "cpu")


def test_steady_rate_counts_from_the_first_step_to_the_last():
    r = SteadyRate()
    assert r.rate() == 0.0
    r.mark(10.0, 100)  # the first step's tokens and the time before it (pipeline fill) are out
    assert r.rate() == 0.0
    r.mark(11.0, 150)
    r.mark(12.0, 300)
    assert r.rate() == 100.0


@pytest.mark.parametrize(
    "stage,knob",
    # the drafter's step grows with rows x anchors: for short rows the row cap shrinks a batch
    [("target", r"batching\.max_tokens"), ("drafter", r"batching\.max_batch_size \(rows")],
)
def test_out_of_memory_names_batch_shape_and_setting(tmp_path, stage, knob):
    with pytest.raises(
        StageError,
        match=rf"out of memory in the {stage} step on a batch of \d+ x \d+ tokens; lower {knob}",
    ):
        _run(tmp_path, **{"pipeline.fault": f"{stage}:2:oom"})


def test_bf16_target_with_fp32_drafter_on_cpu(tmp_path):
    target = tiny_target()
    target.model.to(torch.bfloat16)
    target.dtype = torch.bfloat16
    target.embed_weight = target.model.get_input_embeddings().weight
    cfg = tiny_config(tmp_path, **{"optim.epochs": 1})
    res = train(cfg, target=target, train_set=tiny_dataset())
    assert res.steps > 0 and all(m["loss"] == m["loss"] for _, m in res.history)


def test_auto_dtypes_follow_the_cpu_and_train(tmp_path, cpu_native_bf16):
    """What `auto` picks on each kind of CPU, end to end: a target in the dtype target.dtype=auto
    resolves to, and the drafter under pipeline.precision=auto (bf16 autocast where bf16 is
    native, fp32 elsewhere), trains with finite losses on both kinds."""
    dtype = resolve_dtype("auto", "cpu")
    assert dtype == (torch.bfloat16 if cpu_native_bf16 else torch.float32)
    assert use_autocast("auto", "cpu") == cpu_native_bf16
    target = tiny_target()
    target.model.to(dtype)
    target.dtype = dtype
    target.embed_weight = target.model.get_input_embeddings().weight
    cfg = tiny_config(tmp_path, **{"optim.epochs": 1, "pipeline.precision": "auto"})
    res = train(cfg, target=target, train_set=tiny_dataset())
    losses = [m["loss"] for _, m in res.history]
    assert res.steps > 0 and losses and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("schedule", ["pipelined", "sequential"])
def test_wrong_features_stop_the_run_before_any_step(tmp_path, schedule):
    """The startup tap check runs through the training capture path, on both schedules."""
    from dflash_trainer.errors import UserError

    target = tiny_target(layers=6)
    target.layer_ids = list(reversed(target.layer_ids))  # hooks no longer match the ids
    cfg = tiny_config(tmp_path, **{"pipeline.schedule": schedule})
    with pytest.raises(UserError, match="differ from output_hidden_states"):
        train(cfg, target=target, train_set=tiny_dataset())
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    # ... and with the check off, the same run trains (the check is what stopped it)
    cfg = tiny_config(
        tmp_path / "off",
        **{"pipeline.schedule": schedule, "target.check_taps": False, "optim.max_steps": 2},
    )
    assert train(cfg, target=target, train_set=tiny_dataset()).steps == 2


def test_trainer_leaves_no_reference_cycle(tmp_path):
    """The step loop, checkpoint writer and supervisor call back through hooks objects that
    never hold the Trainer (run/hooks.py), so with the garbage collector off the Trainer (and
    with it the drafter, optimizer and head copies) is freed as soon as the last reference goes
    (a soak calling train() repeatedly saw ~230 MB per call while such a cycle existed)."""
    import gc
    import weakref

    from dflash_trainer.run.build import build_run
    from dflash_trainer.run.trainer import Trainer

    cfg = tiny_config(tmp_path, **{"checkpoint.every_steps": 2, "eval.every_steps": 0})
    gc.collect()
    gc.disable()
    try:
        trainer = Trainer(build_run(cfg, target=tiny_target(), train_set=tiny_dataset()))
        ref, drafter = weakref.ref(trainer), weakref.ref(trainer.parts.drafter)
        assert trainer.run().steps > 0
        del trainer
        assert ref() is None and drafter() is None
    finally:
        gc.enable()


def test_the_target_step_keeps_one_causal_mask_whatever_the_lengths():
    """Long contexts: one mask of the longest length seen, shorter lengths slice it; each slice
    is the causal mask of its length and the taps through it equal the unmasked causal ones."""
    from dflash_trainer.pipeline.steps import TargetStep

    target = tiny_target()
    step = TargetStep(target, torch.device("cpu"), torch.float32)
    assert target.takes_4d_mask
    g = torch.Generator().manual_seed(0)
    for n in (5, 130, 9, 64, 33, 131):
        mask = step._causal_mask(n)
        want = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
        torch.testing.assert_close(mask[0, 0], want, rtol=0, atol=0)
        ids = torch.randint(1, 100, (2, n), generator=g)
        torch.testing.assert_close(target.features(ids, mask), target.features(ids, None))
    assert step._mask is not None and step._mask.shape[-1] == 192  # 131 rounded up to 64


def test_the_causal_mask_memory_stays_one_mask_at_8k_tokens():
    """At 8K tokens and many lengths under it (a long-context data set), the target step holds
    one 8K x 8K mask (256 MiB in fp32), never one per length (a mask per padded length reached
    tens of GiB)."""
    from dflash_trainer.pipeline.steps import TargetStep

    step = TargetStep(tiny_target(), torch.device("cpu"), torch.float32)
    first = step._causal_mask(8192)
    storage = first.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(0)
    for n in torch.randint(1, 8193, (200,), generator=g).tolist():
        m = step._causal_mask(n)
        assert m.shape[-1] == n and m.untyped_storage().data_ptr() == storage
    assert step._mask is not None and step._mask.untyped_storage().nbytes() == 8192 * 8192 * 4
    assert step._mask[0, 0, 8190, 8191] < -1e30 and step._mask[0, 0, 8191, 8190] == 0
