"""eval/served.py without an engine: vLLM's counters as our metrics, and the parity gate's
messages (tests/test_vllm_parity.py runs the real engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dflash_trainer.decode.loop import GenResult
from dflash_trainer.errors import UserError
from dflash_trainer.eval.metrics import summarize
from dflash_trainer.eval.parity import check_parity, parity_problems
from dflash_trainer.eval.served import ServedEval, served_result


def test_counters_become_cycles_and_our_clipped_tau():
    # 3 cycles accepting 2, 0 and 5 drafts (block 8); the output stops after 1 + 3 + 1 + 4 tokens
    # (the last cycle clipped from 6 to 4 by the token limit)
    r = {"tokens": list(range(9)), "drafts": 3, "accepted": 7, "per_pos": [2, 2, 1, 1, 1, 0, 0]}
    g = served_result(r, 8)
    assert sorted(g.accepted_drafts) == [0, 2, 5]
    assert sorted(g.acceptance_lengths) == [1, 3, 4] and sum(g.acceptance_lengths) == 8
    assert g.tau == pytest.approx(8 / 3)  # (tokens - 1) / cycles: our convention
    assert served_result({"tokens": [1, 2]}, 1).acceptance_lengths == []  # plain decoding


def _gen(tokens, lengths):
    return GenResult(tokens, lengths, [n - 1 for n in lengths], [4] * len(lengths))


def _served(spec, plain, block=4):
    s = summarize(spec, plain, block)
    return ServedEval(s, s.tau, [r.tau for r in spec], "test", 0.0, 0.0)


def test_parity_gate_names_what_diverged():
    cfg = SimpleNamespace(block_size=4, target_layer_ids=[1, 3], rope_theta=1e4, mask_token_id=0)
    ours = summarize([_gen([5, 6, 7, 8, 9], [4]), _gen([1, 2, 3, 4, 5], [4])], None, 4)
    same = _served([_gen([5, 6, 7, 8, 9], [4]), _gen([1, 2, 3, 4, 5], [4])], ours.spec_results)
    assert parity_problems(ours, same, cfg, "T") == []
    check_parity(ours, same, cfg, "T")
    low = _served(
        [_gen([5, 6, 7, 8, 9], [1, 1, 1, 1]), _gen([1, 2, 3, 4, 5], [2, 2])], ours.spec_results
    )
    (p,) = parity_problems(ours, low, cfg, "T")
    assert "tau: vLLM 1.500 vs ours 4.000" in p and "draft slot 1" in p
    assert "num_speculative_tokens=3" in p and "target_layer_ids [1, 3]" in p
    other = _served(
        [_gen([5, 6, 0, 0, 0], [4]), _gen([1, 2, 3, 4, 5], [4])],
        [_gen([5, 6, 0, 0, 0], [4]), _gen([1, 2, 3, 4, 5], [4])],
    )
    with pytest.raises(UserError, match="target: vLLM's plain greedy output differs from ours"):
        check_parity(ours, other, cfg, "T")
    # a divergence at a near-tie of the two engines' kernels is rounding, not a mismatch
    assert parity_problems(ours, other, cfg, "T", gap=lambda i, a, b: 0.01) == []
    (p,) = parity_problems(ours, other, cfg, "T", gap=lambda i, a, b: 3.0)
    assert "differs from ours on 1 of 2" in p and "logit gap at a first divergence 3" in p


def test_generate_engine_choice(tmp_path, monkeypatch):
    from dflash_trainer.config import Config
    from dflash_trainer.data import generate as gen

    cfg = Config()
    assert gen.choose_engine(cfg, "project", 10**9) == ("project", None)
    small_job = gen.AUTO_VLLM_MIN_BUDGET - 1
    assert gen.choose_engine(cfg, "auto", small_job) == ("project", None)
    cfg.target.dtype = "float32"
    assert gen.choose_engine(cfg, "auto", 10**9) == ("project", None)  # float32: the two run alike
    cfg.target.dtype = "bfloat16"
    cfg.eval.vllm_python = str(tmp_path / "nowhere" / "python")
    with pytest.raises(UserError, match="does not exist"):
        gen.choose_engine(cfg, "vllm", 10**6)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    (tmp_path / "venv" / ".unavailable").write_text("no wheel for this platform")
    cfg.eval.vllm_python = str(tmp_path / "venv" / "bin" / "python")
    # auto, vLLM not installed: the loop
    assert gen.choose_engine(cfg, "auto", 10**6) == ("project", None)
    with pytest.raises(UserError, match="no wheel for this platform"):
        gen.choose_engine(cfg, "vllm", 10**6)


def test_the_parity_gate_runs_after_the_export_and_stops_the_run(tmp_path, monkeypatch):
    """eval.parity=on: train() serves the written export on the pinned held-out sample (the
    engine is replaced here: tests/test_vllm_parity.py runs the real one) and a divergence stops
    the run with the gate's error, the checkpoint and export already on disk."""
    from dflash_trainer.run import train, trainer
    from tiny import tiny_config, tiny_dataset, tiny_target

    seen = {}

    def gate(cfg, target, drafter, export_dir, prompts, dtype, run):
        seen.update(
            export=export_dir,
            prompts=prompts,
            dtype=dtype,
            block=drafter.config.block_size,
            run=run,
        )
        raise UserError("train/serve parity failed: tau: vLLM 1.000 vs ours 2.000")

    monkeypatch.setattr(trainer, "parity_gate", gate)
    ds = tiny_dataset(n=16)
    over = {"eval.parity": "on", "eval.parity_prompts": 2, "eval.max_new_tokens": 4}
    cfg = tiny_config(tmp_path, **over)
    with pytest.raises(UserError, match="parity failed"):
        train(
            cfg,
            target=tiny_target(),
            train_set=ds.subset(range(12)),
            heldout=ds.subset(range(12, 16)),
        )
    assert (
        seen["export"] == tmp_path / "run" / "export" and (seen["export"] / "config.json").is_file()
    )
    assert len(seen["prompts"]) == 2 and seen["dtype"] == "float32" and seen["block"] == 4
    # the end-of-run evaluation is handed over: where it compared vLLM, that is what is checked
    assert seen["run"] is not None and seen["run"].overall.num_responses >= 2


def test_the_gate_checks_the_comparison_the_evaluation_made(tmp_path, monkeypatch):
    """vLLM serves once: where the end-of-run evaluation compared vLLM greedily, the gate checks
    those decodes and starts no engine; at temperature > 0 (a sampled comparison proves no
    token parity) it serves its pinned prompts itself."""
    from dflash_trainer.config import Config
    from dflash_trainer.eval import parity
    from dflash_trainer.eval.engines import EvalRun

    starts = []
    monkeypatch.setattr(
        parity, "engine_for_config", lambda *a, **k: starts.append(1) or (None, "not here")
    )
    monkeypatch.setattr(parity, "logit_gap", lambda target, prompts: lambda i, a, b: 3.0)
    from dflash_trainer.models.drafter import DFlashConfig
    from dflash_trainer.models.export import hf_config

    export = DFlashConfig(
        hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
        intermediate_size=16, block_size=4, target_layer_ids=[1], num_target_layers=2,
        mask_token_id=0, vocab_size=16,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf_config(export, torch.float32)))
    spec = [_gen([5, 6, 7, 8, 9], [4]), _gen([1, 2, 3, 4, 5], [4])]
    ours = summarize(spec, spec, 4)
    cfg = Config()
    cfg.eval.parity = "auto"

    def run_with(served) -> EvalRun:
        run = EvalRun(groups={"mt-bench": ours}, overall=ours)
        run.compared = {"vllm": {"mt-bench": served.summary}}
        run.details = {"vllm": {"mt-bench": {"vllm_mean_acceptance_length": 4.25}}}
        return run

    same = run_with(_served(spec, spec))
    rec = parity.parity_gate(cfg, None, None, tmp_path, [[1]], "float32", same)
    assert starts == []  # checked, not served again
    assert rec is not None and rec["parity/prompts"] == 2 and rec["parity/identical_to_ours"] == 2
    assert rec["parity/tau"] == rec["parity/tau_served"] == 4.0
    assert rec["parity/served_mean_acceptance_length"] == 4.25 and rec["parity/served_lossless"]
    assert same.details["vllm"]["mt-bench"]["parity_problems"] == []

    low = run_with(_served([_gen([5, 6, 7, 8, 9], [1, 1, 1, 1]), spec[1]], spec))
    with pytest.raises(
        UserError, match="(?s)parity failed.*mt-bench: tau: vLLM 2.500 vs ours 4.000"
    ):
        parity.parity_gate(cfg, None, None, tmp_path, [[1]], "float32", low)
    assert starts == []

    cfg.eval.sampling.temperature = (
        0.7  # a sampled comparison: the gate serves its own greedy sample
    )
    assert parity.parity_gate(cfg, None, None, tmp_path, [[1]], "float32", same) is None
    assert starts == [1]  # it tried to start vLLM (absent here: skipped under auto)
