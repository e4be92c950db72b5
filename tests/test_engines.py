"""Three decoding engines through one interface (eval/engines.py `DecodeEngine`): the project's
loop, the published reference loop and vLLM serving the export decode the same memorised export
(tests/memorised.py, trained once per session) on the prompts it memorised, and the one
evaluation's record (`EvalRun.compare` / `events`) carries each. Greedy float32 on every side, so
what must be equal is: our tokens and vLLM's (spec and plain greedy), ours and our plain greedy,
and each prompt's tau in ours and in the reference loop; vLLM's tau within
eval/served.py's PARITY_TOLERANCE (measured exact; why a tolerance: there).

vLLM runs only where it can (skipped otherwise; DFLASH_REQUIRE_VLLM=1, as in CI, makes a missing
vLLM a failure); the project and reference engines run either way."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_trainer.eval.engines import DecodeEngine, EvalRun, ProjectLoop
from dflash_trainer.eval.parity import PARITY_TOLERANCE, parity_gate
from dflash_trainer.eval.reference import ReferenceLoop
from dflash_trainer.eval.served import ServedLoop
from dflash_trainer.models.embedded import target_location
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.vllm_engine import VLLMEngine
from memorised import BLOCK, NEW_TOKENS
from test_vllm_parity import vllm_python


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the memorised drafter (once per session) + one vLLM engine start
def test_project_reference_and_served_engines_agree_through_one_interface(memorised, capsys):
    pytest.importorskip("dflash", reason="the published reference loop is not installed")
    m = memorised
    drafter = load_drafter(m.export_dir, "cpu", torch.float32)
    stop = list(m.target.eos_token_ids)
    ours = ProjectLoop(m.target, drafter, baseline=True)
    others: list[DecodeEngine] = [ReferenceLoop(m.export_dir, m.target.model, stop, False)]
    python, why = vllm_python()
    if python is not None:
        engine = VLLMEngine(
            python,
            target_location(m.cfg.target.model, m.cfg.target.cache_dir),
            dtype="float32",
            threads=2,
        )
        others.append(ServedLoop(engine, m.export_dir, stop))
    with torch.inference_mode():
        s = ours.decode(m.prompt_ids, NEW_TOKENS, BLOCK)
        run = EvalRun(groups={"memorised": s}, overall=s)
        run.compare(others, NEW_TOKENS, BLOCK)
    rec = run.events()
    with capsys.disabled():
        print(
            f"\nengines on {len(m.prompt_ids)} memorised prompts x {NEW_TOKENS} tokens: "
            + ", ".join(f"{k} {v:.3f}" for k, v in rec.items() if k.startswith("eval/tau"))
            + ("" if python else f" (vLLM skipped: {why})"),
            flush=True,
        )
    assert s.tau > 3.0, s.tau  # the drafter did memorise: agreement at high acceptance
    assert [r.tokens for r in s.ar_results] == [r.tokens for r in s.spec_results]  # lossless
    assert [e.name for e in (ours, *others)] == ["project", "reference", "vllm"][: 1 + len(others)]

    ref = run.compared["reference"]["memorised"]
    per_prompt = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in s.spec_results]
    assert [
        sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in ref.spec_results
    ] == pytest.approx(per_prompt)
    assert rec["eval/tau_reference"] == pytest.approx(rec["eval/tau"])
    assert "eval/speedup_reference/memorised" not in rec  # another clock: no speedup vs ours
    if python is None:
        pytest.skip(f"project and reference engines agree; vLLM unavailable: {why}")
    served = run.compared["vllm"]["memorised"]
    assert [r.tokens for r in served.spec_results] == [r.tokens for r in s.spec_results]
    assert [r.tokens for r in served.ar_results] == [r.tokens for r in s.spec_results]
    assert abs(served.tau - s.tau) <= PARITY_TOLERANCE * s.tau, (served.tau, s.tau)
    assert run.details["vllm"]["memorised"]  # the engine's own figures reach the record's payload
    # the parity gate checks this comparison as it is: vLLM is not started a second time
    cfg = copy.deepcopy(m.cfg)
    cfg.eval.parity = "on"
    rec = parity_gate(cfg, m.target, drafter, m.export_dir, [], "float32", run)
    assert rec is not None and rec["parity/identical_to_ours"] == len(m.prompt_ids)
    assert run.details["vllm"]["memorised"]["parity_problems"] == []
