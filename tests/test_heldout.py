"""Acceptance you can trust: the held-out split, validation vs reported prompts, evaluation at
the end of `train`, the evaluation dtype, no silent fallback, truncated answers."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from dflash_trainer.config_io import load_config
from dflash_trainer.data.chat import (
    Rendering,
    TokenizedDataset,
    build_dataset,
    prompt_hash,
    render_with_spans,
)
from dflash_trainer.data.prepare import (
    REPORT,
    VALIDATION,
    prepare_data,
    split_dataset,
)
from dflash_trainer.data.sources import load_sources
from dflash_trainer.decode.loop import GenResult
from dflash_trainer.errors import UserError
from dflash_trainer.eval import evaluation as ev
from dflash_trainer.eval import prompts as pr
from dflash_trainer.eval.metrics import EvalSummary
from dflash_trainer.run import train
from dflash_trainer.run.evaluation import PeriodicEval, periodic_subset
from tiny import tiny_config, tiny_dataset, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _embedded_shaped(n_mt=80, n_he=164):
    """Ids like the embedded data (MT-Bench first, HumanEval after), lengths increasing."""
    ids = [f"mtbench-{i}" for i in range(n_mt)] + [f"humaneval-{i}" for i in range(n_he)]
    seqs = [np.arange(10 + i, dtype=np.int32) % 100 + 3 for i in range(len(ids))]
    masks = [np.r_[np.zeros(5, np.uint8), np.ones(len(s) - 5, np.uint8)] for s in seqs]
    label = {i: "mt-bench" if i.startswith("mtbench-") else "humaneval" for i in ids}
    return TokenizedDataset(seqs, masks, ids), label


def test_split_is_stratified_seeded_and_not_in_length_order():
    ds, label = _embedded_shaped()
    ev = load_config().eval
    train_set, held = split_dataset(ds, label, 0.1, 0, ev)
    assert not set(train_set.ids) & set(held.ids)
    assert len(train_set) + len(held) == len(ds)
    by_source = {s: held.sources.count(s) for s in set(held.sources)}
    assert by_source == {"mt-bench": 8, "humaneval": 16}  # 10% of each source
    # the reported side keeps >= 16 prompts; validation draws from both sources
    assert held.roles.count(REPORT) >= 16
    val_sources = {s for s, r in zip(held.sources, held.roles) if r == VALIDATION}
    assert val_sources == {"mt-bench", "humaneval"}
    # a seeded shuffle, never length order (the first N are not the N shortest)
    assert list(held.lengths) != sorted(held.lengths)
    assert split_dataset(ds, label, 0.1, 0, ev)[1].ids == held.ids
    assert split_dataset(ds, label, 0.1, 1, ev)[1].ids != held.ids
    # a fixed count of validation prompts instead of the fraction
    ev.validation_prompts = 4
    assert split_dataset(ds, label, 0.1, 0, ev)[1].roles.count(VALIDATION) == 4


def test_report_sources_train_on_the_other_strata_reported_share():
    """data.report_sources: a stratum added for training (synthesised prompts) keeps only its
    validation prompts held out; its reported share is trained on. The kept strata and every
    validation prompt are exactly the split without it."""
    ds, label = _embedded_shaped()
    ids = [*ds.ids, *(f"synth-{i}" for i in range(200))]
    seqs = [*ds.input_ids, *(np.arange(12 + i % 50, dtype=np.int32) + 3 for i in range(200))]
    masks = [np.r_[np.zeros(5, np.uint8), np.ones(len(s) - 5, np.uint8)] for s in seqs]
    ds = TokenizedDataset(seqs, masks, ids)
    label |= {i: "synth" for i in ids if i.startswith("synth-")}
    ev = load_config().eval
    train_all, held_all = split_dataset(ds, label, 0.1, 0, ev)
    train_set, held = split_dataset(ds, label, 0.1, 0, ev, ("mt-bench", "humaneval"))
    roles_all = dict(zip(held_all.ids, zip(held_all.sources, held_all.roles)))
    roles = dict(zip(held.ids, zip(held.sources, held.roles)))
    back = {g for g, (s, r) in roles_all.items() if s == "synth" and r == REPORT}
    assert len(back) == 15  # 20 synth held out, 5 of them validation
    assert roles == {g: v for g, v in roles_all.items() if g not in back}
    assert set(train_set.ids) == set(train_all.ids) | back
    assert not set(train_set.ids) & set(held.ids) and len(train_set) + len(held) == len(ds)
    with pytest.raises(UserError, match="report_sources names mtbench"):
        split_dataset(ds, label, 0.1, 0, ev, ("mtbench",))


def test_periodic_subset_is_fixed_and_stratified():
    ds, label = _embedded_shaped()
    cfg = load_config(None, None, ["--data.eval_fraction=0.5", "--eval.validation_fraction=0.5"])
    _, held = split_dataset(ds, label, 0.5, 0, cfg.eval)
    ev = PeriodicEval(cfg, tiny_target(), None, held, None, None)
    assert len(ev.validation) > 8
    a = periodic_subset(ev.validation, 8, 0)
    assert [e.id for e in a] == [e.id for e in periodic_subset(ev.validation, 8, 0)]
    assert len(a) == 8 and {e.source for e in a} == {"mt-bench", "humaneval"}
    assert not {e.id for e in ev.validation} & {e.id for e in ev.report}


def test_periodic_subset_takes_exactly_n_even_from_strata_of_one():
    """One validation prompt per source and periodic_prompts=2: two prompts are evaluated
    (a stratum of one used to give none, so periodic evaluation decoded nothing)."""
    from dflash_trainer.run.evaluation import HeldoutPrompt

    one_each = [HeldoutPrompt(f"{s}-0", s, VALIDATION, [1], [1, 2]) for s in ("a", "b", "c")]
    picked = periodic_subset(one_each, 2, 0)
    assert len(picked) == 2 and len({e.source for e in picked}) == 2
    assert [e.id for e in picked] == [e.id for e in periodic_subset(one_each, 2, 0)]
    # proportional beyond one per source, exactly n in total, every source represented
    pool = [HeldoutPrompt(f"a-{i}", "a", VALIDATION, [1], [1, 2]) for i in range(7)]
    pool += [HeldoutPrompt(f"b-{i}", "b", VALIDATION, [1], [1, 2]) for i in range(2)]
    pool += [HeldoutPrompt("c-0", "c", VALIDATION, [1], [1, 2])]
    for n in range(1, len(pool) + 1):
        got = periodic_subset(pool, n, 0)
        assert len(got) == n
        assert len({e.source for e in got}) == min(n, 3)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _conv(i, q, a, finish="stop"):
    return {
        "id": f"{q}-{i}",
        "messages": [
            {"role": "user", "content": f"Hello {i}"},
            {"role": "assistant", "content": a},
        ],
        "provenance": {"finish_reason": finish},
    }


def test_prepare_writes_split_files_with_sources(tmp_path, chatml_tokenizer):
    a, b = tmp_path / "chat.jsonl", tmp_path / "code.jsonl"
    _write_jsonl(a, [_conv(i, "a", "Hi there how is it going") for i in range(12)])
    _write_jsonl(b, [_conv(i, "b", "Fine thanks . Bye") for i in range(8)])
    cfg = load_config(
        None,
        None,
        [
            f"--run_dir={tmp_path / 'run'}",
            f"--data.sources={a},{b}",
            f"--data.cache_dir={tmp_path / 'tok'}",
            "--data.eval_fraction=0.25",
        ],
    )
    train_set, held = prepare_data(cfg, chatml_tokenizer)
    assert sorted(set(held.sources)) == ["chat.jsonl", "code.jsonl"]
    run = tmp_path / "run"
    rep = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (run / "validation.jsonl").read_text().splitlines()]
    assert len(rep) + len(val) == len(held) == 3 + 2
    assert {r["source"] for r in rep} == {"chat.jsonl", "code.jsonl"}
    assert all(m["role"] != "assistant" for r in rep for m in r["messages"])
    trained = json.loads((run / "train_ids.json").read_text())
    assert set(trained["ids"]) == set(train_set.ids)
    assert not set(trained["ids"]) & {r["id"] for r in rep + val}
    convs, _ = load_sources([str(a)])
    assert prompt_hash(convs[0].messages) in trained["prompt_hashes"] or convs[0].id in {
        r["id"] for r in rep + val
    }


def test_train_evaluates_every_reported_prompt_at_the_end(tmp_path, caplog):
    ds = tiny_dataset(n=32)
    train_set, held = ds.subset(range(24)), ds.subset(range(24, 32))
    held.sources = ["a", "b"] * 4
    cfg = tiny_config(
        tmp_path,
        **{
            "eval.every_steps": 6,
            "eval.periodic_prompts": 2,
            "eval.max_new_tokens": 8,
            "optim.epochs": 2,
        },
    )
    caplog.set_level(logging.INFO, logger="dflash_trainer.run.evaluation")
    res = train(cfg, target=tiny_target(), train_set=train_set, heldout=held)
    ev = res.eval
    assert ev["eval/set"] == "heldout" and ev["eval/prompts"] == 6  # 8 held out - 2 validation
    assert {"eval/tau/a", "eval/tau/b", "eval/tau_sim", "eval/tau_sim_gap"} <= set(ev)
    assert ev["eval/dtype"] == "float32" and ev["eval/tau"] >= 1.0
    assert ev["eval/tau_sim_gap"] == pytest.approx(ev["eval/tau_sim"] - ev["eval/tau"])
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    sets = [r.get("eval/set") for r in rows if "eval/tau" in r]
    assert sets[-1] == "heldout" and sets.count("validation") >= 1
    best = json.loads((res.run_dir / "best" / "eval.json").read_text())
    assert best["prompt_set"] == "validation"
    assert "periodic evaluation: 2 validation prompts" in caplog.text
    # with the defaults (eval.every_steps=0) train still evaluates at the end
    cfg2 = tiny_config(tmp_path / "b", **{"eval.max_new_tokens": 8, "optim.epochs": 1})
    res2 = train(cfg2, target=tiny_target(), train_set=train_set, heldout=held)
    assert res2.eval["eval/prompts"] == 6 and not (res2.run_dir / "best").exists()


def test_eval_decodes_in_float32_on_cpu_without_touching_the_drafter(tmp_path):
    target = tiny_target()
    target.model.to(torch.bfloat16)
    target.embed_weight = target.model.get_input_embeddings().weight
    target.lm_head = target.model.get_output_embeddings()
    target.dtype = torch.bfloat16
    ds = tiny_dataset(n=8)
    cfg = tiny_config(tmp_path, **{"eval.max_new_tokens": 6})
    from dflash_trainer.run.build import build_drafter

    drafter = build_drafter(cfg, target, "cpu").to(torch.bfloat16)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    import threading

    ev = PeriodicEval(cfg, target, drafter, ds, tmp_path, threading.Lock())
    rec = ev.final(0)
    assert rec["eval/dtype"] == "float32"
    assert next(drafter.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert target.model.get_input_embeddings().weight.dtype == torch.bfloat16
    cfg.eval.dtype = "bfloat16"
    ev2 = PeriodicEval(cfg, target, drafter, ds, tmp_path, threading.Lock())
    assert ev2.final(0)["eval/dtype"] == "bfloat16"


def test_tau_sim_is_logged_per_source_like_tau(tmp_path, monkeypatch):
    """eval/tau_sim/<source>: the mean over that source's reported responses alone."""
    import threading

    from dflash_trainer.eval import tau_sim
    from dflash_trainer.run.build import build_drafter

    # one cycle per response, its length set by the response: sources then differ
    def one_cycle(*a):  # a[4]: the response's ids
        yield tau_sim.Cycle(pos=0, drafts=[], accepted=0, committed=len(a[4]), cap=0)

    monkeypatch.setattr(tau_sim, "replay_cycles", one_cycle)
    target = tiny_target()
    ds = tiny_dataset(n=12, max_len=40)
    ds.sources = ["a", "b"] * 6
    cfg = tiny_config(tmp_path, **{"eval.max_new_tokens": 6})
    ev = PeriodicEval(
        cfg, target, build_drafter(cfg, target, "cpu"), ds, tmp_path, threading.Lock()
    )
    rec = ev.final(0)
    want = {}
    for src in ("a", "b"):
        per = [len(e.ids) for e in ev.report if e.source == src]
        want[src] = sum(per) / len(per)
        assert rec[f"eval/tau_sim/{src}"] == pytest.approx(want[src])
    assert want["a"] != want["b"]  # the check tells the sources apart
    every = [len(e.ids) for e in ev.report]
    assert rec["eval/tau_sim"] == pytest.approx(sum(every) / len(every))


def _gen(tokens):
    return GenResult(tokens=tokens, acceptance_lengths=[1], accepted_drafts=[0], block_sizes=[4])


def test_lossless_line_names_bf16_near_ties():
    spec = [_gen([1, 2, 3]), _gen([4, 5, 6]), _gen([7, 8])]
    ar = [_gen([1, 2, 3]), _gen([4, 9, 9]), _gen([7, 8])]
    base = dict(
        block_size=4,
        num_responses=3,
        num_cycles=3,
        num_tokens=8,
        tau=1.0,
        tau_token_weighted=1.0,
        histogram=[1.0, 0, 0, 0],
        position_acceptance=[0, 0, 0],
        tpot=0.1,
        draft_share=0.5,
        outputs_match=2 / 3,
        spec_results=spec,
        ar_results=ar,
    )
    s = EvalSummary(**base, decode_dtype="bfloat16", tie_gaps=[0.0625])
    assert s.lossless_line().startswith(
        "identical except bf16 near-ties: 1 of 3, largest logit gap 0.0625"
    )
    assert "near-ties" in s.to_dict()["lossless_line"]
    assert "DIFFERS" in EvalSummary(**base, decode_dtype="float32", tie_gaps=[0.0]).lossless_line()
    assert "DIFFERS" in EvalSummary(**base, decode_dtype="bfloat16", tie_gaps=[5.0]).lossless_line()
    base.update(outputs_match=1.0, ar_results=spec)
    assert EvalSummary(**base).lossless_line().startswith("identical to plain greedy")


def test_bf16_evaluate_reports_gaps_of_its_divergences():
    """A bf16 decode on a tiny target: every divergence (if any) gets its logit gap."""
    from test_specdecode import _real_drafter, side
    from test_specdecode import tiny_target as hf_target

    model = hf_target("llama", seed=5).to(torch.bfloat16)
    drafter = _real_drafter(model, block_size=8).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 100, (1, 7), generator=g) for _ in range(4)]
    t = side(model)
    t.eos_token_ids = []
    s = ev.evaluate(t, drafter, prompts, 24, 8, warmup=False)
    assert s.decode_dtype == "bfloat16"
    assert len(s.tie_gaps) == s.num_divergent
    assert "bf16 near-ties" in s.lossless_line() or s.lossless


def test_heldout_without_a_file_is_an_error(tmp_path):
    cfg = load_config(None, None, [f"--run_dir={tmp_path / 'none'}"])
    with pytest.raises(UserError, match="no held-out prompts at .*Training writes them"):
        pr.load_prompt_set("heldout", cfg)


def test_named_dataset_overlapping_training_is_reported_apart(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(5)]
    f = tmp_path / "set.jsonl"
    _write_jsonl(f, rows)
    # trained on q0 by id and on q3 by its prompt text (another id in the training file)
    (run / "train_ids.json").write_text(
        json.dumps({"ids": ["q0", "x"], "prompt_hashes": [prompt_hash(rows[3]["messages"])]})
    )
    cfg = load_config(None, None, [f"--run_dir={run}", f"--eval.datasets={f}"])
    seen = {}

    def fake_run(target, drafter, convs, *a, **k):
        seen[len(seen)] = [c for c, _ in convs]
        return len(convs)

    monkeypatch.setattr(ev, "run_conversations", fake_run)
    with caplog.at_level(logging.WARNING):
        res = ev.evaluate_datasets(cfg, None, None, 4)
    assert res == {f"{f}:trained": 2, f"{f}:unseen": 3}
    assert seen[0] == ["q0", "q3"]
    assert "2 of 5 prompts" in caplog.text


# ------------------------------------------------------------------------ truncated answers


def _tokens(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_truncated_answers_end_without_end_of_turn(tmp_path, chatml_tokenizer):
    tok = chatml_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    src = tmp_path / "d.jsonl"
    _write_jsonl(
        src,
        [
            _conv(0, "a", "Hi there how is it going", "stop"),
            _conv(1, "a", "Tell me a long text word word", "length"),
            {**_conv(2, "a", "Fine thanks"), "provenance": {}, "finish_reason": "length"},
        ],
    )
    convs, _ = load_sources([str(src)])
    assert [c.truncated for c in convs] == [False, True, True]
    cfg = load_config(None, None, [f"--data.cache_dir={tmp_path / 'tok'}"])
    ds = build_dataset(cfg.data, tok, convs)
    assert ds.stats["open_ended"] == 2
    for ids, mask, c in zip(ds.input_ids, ds.loss_mask, convs):
        sup = ids[mask.astype(bool)].tolist()
        if c.truncated:
            assert eot not in sup and ids[-1] != eot  # the text ends with the content
            assert "".join(tok.convert_ids_to_tokens(sup)) == c.messages[-1]["content"]
        else:
            assert sup[-1] == eot
    cfg.data.truncated = "drop"
    dropped = build_dataset(cfg.data, tok, convs)
    assert dropped.ids == [convs[0].id] and dropped.stats["dropped_truncated"] == 2
    # the span helper alone: content kept, end-of-turn and template tail cut
    text, spans = render_with_spans(tok, convs[1].messages, open_last=True)
    assert text.endswith("word word") and text[spans[-1][0] : spans[-1][1]].endswith("word")
    assert _tokens(tok, text)[-1] != eot


def test_conversations_decode_in_eval_dtype_on_copies():
    """A bf16 target and drafter decode on float32 copies (TargetModel.cast, frozen_in: what the
    run's evaluation does in eval.dtype); the originals stay bf16."""
    from dflash_trainer.models.target import TargetModel
    from dflash_trainer.precision import frozen_in
    from test_specdecode import FakeTokenizer, _real_drafter
    from test_specdecode import tiny_target as hf_target

    model = hf_target("llama", seed=2).to(torch.bfloat16)
    target = TargetModel.from_hf(model, FakeTokenizer(), [0, 2])
    drafter = _real_drafter(model, block_size=4).to(torch.bfloat16)
    convs = [("a", [{"role": "user", "content": "hi"}])]
    t32, d32 = target.cast(torch.float32), frozen_in(drafter, torch.float32)
    s = ev.run_conversations(t32, d32, convs, 6, 4, None, Rendering())
    assert s.decode_dtype == "float32" and s.lossless is True
    assert next(drafter.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.bfloat16


def test_end_of_run_evaluation_reaches_metrics_jsonl_as_the_demo_reports_it(tmp_path):
    """The one end-of-run evaluation (what the demo configures: one source decoded, the plain
    baseline, tau_sim on every reported prompt) writes eval/tau, eval/tau_sim and per-source
    values into metrics.jsonl, equal to what demo_summary.json's `heldout` holds."""
    from dflash_trainer.commands.demo import configure_final_eval, heldout_checks
    from dflash_trainer.run.evaluation import heldout_examples

    ds = tiny_dataset(n=16)
    train_set, held = ds.subset(range(12)), ds.subset(range(12, 16))
    held.sources = ["mt-bench", "humaneval"] * 2
    cfg = tiny_config(tmp_path, **{"eval.max_new_tokens": 6, "optim.epochs": 1})
    report = [e for e in heldout_examples(held, cfg) if e.role == "report"]
    configure_final_eval(cfg, report)
    cfg.eval.compare = []  # the reference loop: tests/test_reference_tau.py
    res = train(cfg, target=tiny_target(), train_set=train_set, heldout=held)
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    (ev,) = [r for r in rows if r.get("eval/set") == "heldout"]
    assert {
        "eval/tau",
        "eval/tau_sim",
        "eval/tau/mt-bench",
        "eval/speedup",
        "eval/lossless",
    } <= set(ev)
    assert "eval/tau/humaneval" not in ev  # decoded: mt-bench only; replayed: every source
    assert {f"eval/tau_sim/{s}" for s in ("mt-bench", "humaneval")} <= set(ev)
    checks = heldout_checks(res.eval, cfg)
    assert checks["tau"] == ev["eval/tau"] == ev["eval/tau/mt-bench"]
    assert checks["tau_sim"]["all"] == ev["eval/tau_sim"]
    assert checks["tau_sim"]["humaneval"] == ev["eval/tau_sim/humaneval"]
    assert (
        checks["speedup"] == ev["eval/speedup"] and checks["lossless"] == ev["eval/lossless_line"]
    )
    assert checks["prompts"] == ev["eval/prompts"] and checks["tau_sim_prompts"] == len(report)
    assert checks["cycle_in_plain_steps"] == pytest.approx(ev["eval/tau"] / ev["eval/speedup"])


def test_a_cycles_cost_in_plain_steps():
    """8 tokens: drafting in 4 cycles of 2 tokens, 1 s each (tau 2, 2 tok/s); plain in 8 steps
    of 0.25 s (4 tok/s): speedup 0.5, so a cycle cost 4 plain steps (1 s / 0.25 s) and drafting
    would pay above 4 tokens a cycle."""
    from dflash_trainer.commands.demo import cycle_in_plain_steps

    tau, speedup = 8 / 4, (8 / 4.0) / (8 / 2.0)
    assert cycle_in_plain_steps(tau, speedup) == pytest.approx(1.0 / 0.25)
    assert cycle_in_plain_steps(1.3, None) is None  # no baseline decoded: nothing to compare


def test_the_demo_summary_prints_rounded_named_figures():
    from dflash_trainer.commands.demo import summary_lines

    summary = {
        "cpu": "AMD EPYC (AVX2)",
        "phases_s": {"target": 16.2, "data": 163.9, "training": 364.1, "evaluation": 75.1},
        "heldout": {
            "source": "mt-bench",
            "prompts": 6,
            "tau": 1.212383143578319,
            "speedup": 0.47597042705035575,
            "lossless": "identical to plain greedy decoding on 6 of 6 (float32)",
            "tau_sim": {"humaneval": 1.7387971978835626, "mt-bench": 1.2123831, "all": 1.56332},
            "tau_sim_prompts": 18,
        },
        "steps": 951,
        "demo_wall_s": 620.6372819869999,
        "first_loss": 23.509496688842773,
        "last_loss": 2.5698935985565186,
    }
    assert dict(summary_lines(summary)) == {
        "cpu": "AMD EPYC (AVX2)",
        "wall": "621 s (target 16 s, data 164 s, training 364 s, evaluation 75 s)",
        "training": "951 steps, loss 23.51 -> 2.57",
        "held-out": "mt-bench tau 1.212 on 6 prompts, speedup 0.48x, identical to plain greedy "
        "decoding on 6 of 6 (float32)",
        "tau_sim": "1.563 on 18 prompts (humaneval 1.739, mt-bench 1.212)",
    }
