"""One run per run directory: a new run never appends to or prunes an earlier one (refuse,
--overwrite moves it aside, --checkpoint.resume continues it), checkpoints pruned by step
number, --resume-from PATH."""

import json
import logging

import pytest
import torch

from dflash_trainer.checkpoint import (
    CheckpointSnapshot,
    latest_checkpoint,
    list_checkpoints,
    write_checkpoint,
)
from dflash_trainer.config import ConfigError
from dflash_trainer.config_io import load_config
from dflash_trainer.errors import UserError
from dflash_trainer.run import rundir, train
from dflash_trainer.run.rundir import earlier_run, prepare
from test_bad_input import GOOD, _train, model_dir  # noqa: F401  (model_dir: a fixture)
from tiny import tiny_config, tiny_dataset, tiny_target


def _run(run_root, **over):
    cfg = tiny_config(run_root, **over)
    return train(cfg, target=tiny_target(), train_set=tiny_dataset())


def _losses(result):
    return {step: m["loss"] for step, m in result.history}


def _metric_steps(run_dir):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "step" in r]


def _snapshot(step):
    return CheckpointSnapshot(
        step=step, weights={"w": torch.zeros(2)}, blob={}, meta={"train_state": {"step": step}}
    )


def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_prune_by_step_number_not_name(tmp_path):
    """step-10000000 sorts before step-9999999 by name: it must be the one kept."""
    for step in (9999998, 9999999, 10000000):
        write_checkpoint(tmp_path, _snapshot(step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-9999999", "step-10000000"]
    (tmp_path / "checkpoints" / "latest").unlink()  # the fallback orders by step too
    assert latest_checkpoint(tmp_path).name == "step-10000000"


def test_fresh_run_into_a_run_dir_with_an_earlier_run_is_refused_and_touches_nothing(tmp_path):
    _run(tmp_path, **{"optim.max_steps": 4, "checkpoint.every_steps": 2})
    run_dir = tmp_path / "run"
    before = _tree(run_dir)
    assert "checkpoints at steps 2..4" in ", ".join(earlier_run(run_dir))
    with pytest.raises(UserError) as e:
        _run(tmp_path, **{"optim.max_steps": 2})
    msg = str(e.value)
    for hint in ("--checkpoint.resume=true", "--run_dir=", "--overwrite", "metrics.jsonl"):
        assert hint in msg, msg
    assert _tree(run_dir) == before  # not one byte appended or pruned


def test_overwrite_moves_the_earlier_run_aside_and_the_new_run_is_alone(tmp_path):
    first = _run(tmp_path, **{"optim.max_steps": 6, "checkpoint.every_steps": 2})
    run_dir = tmp_path / "run"
    before = _tree(run_dir)
    res = _run(tmp_path, **{"optim.max_steps": 2, "overwrite": True})
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1
    assert _tree(aside[0]) == before  # the earlier run, every file as it was
    # the new run's checkpoint is kept (an older step-0000006 would have pruned it by name)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-0000002"]
    assert latest_checkpoint(run_dir).name == "step-0000002"
    assert max(_metric_steps(run_dir)) == res.steps == 2 < first.steps
    ledger = (run_dir / "ledger.jsonl").read_text().splitlines()
    assert sum(len(json.loads(l)["samples"]) for l in ledger) < len(tiny_dataset()) * 2


def test_prepare_for_the_demo_reports_what_it_did(tmp_path):
    run_dir = tmp_path / "runs" / "demo"
    assert prepare(run_dir, "overwrite") == ""  # nothing there
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").write_text("a log alone is no run\n")
    assert prepare(run_dir, "new") == ""
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="--overwrite"):
        prepare(run_dir, "new")
    msg = prepare(run_dir, "overwrite")
    assert msg.startswith(f"moved the earlier run in {run_dir} (metrics.jsonl) aside to ")
    assert not run_dir.exists()
    (moved,) = (tmp_path / "runs").glob("demo.old-*")
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n' and moved.name in msg
    # a second move in the same second gets its own name
    run_dir.mkdir()
    (run_dir / "ledger.jsonl").write_text("{}\n")
    prepare(run_dir, "overwrite")
    assert len(list((tmp_path / "runs").glob("demo.old-*"))) == 2


def test_resume_without_a_checkpoint_moves_the_failed_attempt_aside(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 3, "drafter/loss": 9.0}\n')
    res = _run(tmp_path, **{"optim.max_steps": 2, "checkpoint.resume": True})
    assert res.steps == 2
    (moved,) = tmp_path.glob("run.old-*")
    assert (moved / "metrics.jsonl").read_text().startswith('{"step": 3')
    assert 3 not in _metric_steps(run_dir)


def test_resume_continues_the_same_run_dir(tmp_path):
    _run(tmp_path, **{"optim.max_steps": 2})
    res = _run(tmp_path, **{"optim.max_steps": 4, "checkpoint.resume": True})
    assert min(_losses(res)) == 3 and res.steps == 4
    assert not list(tmp_path.glob("run.old-*"))


def test_resume_from_a_checkpoint_elsewhere_matches_uninterrupted(tmp_path):
    full = _run(tmp_path / "full", **{"optim.epochs": 2})
    part = _run(tmp_path / "a", **{"optim.epochs": 2, "pipeline.fault": "drafter:5:sigterm"})
    assert part.reason == "signal"
    k = part.steps
    ck = part.checkpoint
    assert ck.name == f"step-{k:07d}"
    res = _run(tmp_path / "b", **{"optim.epochs": 2, "checkpoint.resume_from": str(ck)})
    lf, lr = _losses(full), _losses(res)
    assert min(lr) == k + 1 and max(lr) == full.steps
    for step in lr:
        assert lr[step] == pytest.approx(lf[step], rel=1e-5, abs=1e-6), step
    assert ck.is_dir()  # the source is kept
    # a run directory (or its checkpoints/) stands for its latest checkpoint
    res2 = _run(tmp_path / "c", **{"optim.epochs": 2, "checkpoint.resume_from": str(ck.parent)})
    assert min(_losses(res2)) == k + 1


def test_resume_from_into_another_run_is_refused_unless_overwrite(tmp_path):
    _run(tmp_path / "a", **{"optim.max_steps": 4, "checkpoint.every_steps": 2})
    ck2 = tmp_path / "a" / "run" / "checkpoints" / "step-0000002"
    # the older checkpoint of the same run dir: its later steps would mix with the new ones
    with pytest.raises(UserError, match="already holds another run"):
        _run(tmp_path / "a", **{"optim.max_steps": 4, "checkpoint.resume_from": str(ck2)})
    # with --overwrite the run moves aside and the checkpoint is read where it went
    res = _run(
        tmp_path / "a",
        **{"optim.max_steps": 4, "checkpoint.resume_from": str(ck2), "overwrite": True},
    )
    assert min(_losses(res)) == 3 and res.steps == 4
    (moved,) = (tmp_path / "a").glob("run.old-*")
    assert (moved / "checkpoints" / "step-0000002").is_dir()
    with pytest.raises(UserError, match="is not a checkpoint"):
        _run(tmp_path / "d", **{"checkpoint.resume_from": str(tmp_path / "nowhere")})


def test_claim_in_the_demos_overwrite_mode_keeps_a_resume_from_it_moves(tmp_path):
    """The demo claims with mode "overwrite" whatever cfg.overwrite says: the earlier run moves
    aside, and a --resume-from checkpoint inside it is read where it went."""
    _run(tmp_path, **{"optim.max_steps": 4, "checkpoint.every_steps": 2})
    ck2 = tmp_path / "run" / "checkpoints" / "step-0000002"
    cfg = tiny_config(tmp_path, **{"checkpoint.resume_from": str(ck2)})
    with pytest.raises(UserError, match="already holds another run"):
        rundir.claim(cfg)  # cfg's own mode: new
    claimed = rundir.claim(cfg, "overwrite")
    (moved,) = tmp_path.glob("run.old-*")
    assert claimed.message.startswith(f"moved the earlier run in {tmp_path / 'run'}")
    assert claimed.resume_from == moved / "checkpoints" / "step-0000002"
    assert claimed.resume_from.is_dir() and not (tmp_path / "run").exists()


def test_flags_overwrite_resume_from_and_their_conflict(tmp_path):
    cfg = load_config(None, None, ["--overwrite", "--resume-from", "x/step-1", "--run-dir=r"])
    assert cfg.overwrite is True and cfg.checkpoint.resume_from == "x/step-1"
    assert cfg.run_dir == "r"
    assert load_config(None, None, ["--overwrite", "false"]).overwrite is False
    assert load_config(None, None, ["--overwrite=true"]).overwrite is True
    with pytest.raises(ConfigError, match="choose one"):
        load_config(None, None, ["--overwrite", "--checkpoint.resume"])


def test_cli_second_train_refused_then_overwrite(
    model_dir,  # noqa: F811
    tmp_path,
    capsys,
    caplog,
    monkeypatch,
):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([json.dumps(GOOD)] * 8) + "\n")
    assert _train(model_dir, tmp_path, f"--data.sources={data}") == 0
    capsys.readouterr()
    log_before = (tmp_path / "run" / "train.log").read_text()
    assert _train(model_dir, tmp_path, f"--data.sources={data}") == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err
    assert "last-error.log" in err  # the earlier run's train.log gets nothing
    assert (tmp_path / "run" / "train.log").read_text() == log_before
    applied = []  # the run-dir policy, once per command (before the log opens there)
    monkeypatch.setattr(rundir, "prepare", lambda *a: applied.append(a) or prepare(*a))
    with caplog.at_level(logging.INFO, logger="dflash_trainer"):
        assert _train(model_dir, tmp_path, f"--data.sources={data}", "--overwrite") == 0
    assert [mode for _, mode in applied] == ["overwrite"]
    said = [r.getMessage() for r in caplog.records if "moved the earlier run in" in r.getMessage()]
    assert len(said) == 1 and "run.old-" in said[0]
    (moved,) = tmp_path.glob("run.old-*")
    assert (moved / "metrics.jsonl").is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()
