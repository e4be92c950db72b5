"""Prompt synthesis (data/synthesize.py): filters, near-duplicates, the held-out exclusion,
determinism under a seed, provenance, both engines' plumbing, and `generate`'s synthesis mode."""

import json
from pathlib import Path

import pytest
import torch

from dflash_trainer import cli
from dflash_trainer.config import Config
from dflash_trainer.data import synthesize as syn
from dflash_trainer.data.chat import Rendering
from dflash_trainer.errors import UserError
from dflash_trainer.models.target import TargetModel
from dflash_trainer.models.vllm_engine import VLLMEngine
from test_generate import char_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

HELD = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."


@pytest.fixture
def target():
    return TargetModel.from_hf(tiny_model(), char_tokenizer(), [0], name="tiny")


def lenient(tmp_path, prompts=6, **synth) -> Config:
    """The tiny random model writes random characters: filters loose enough to keep some."""
    cfg = Config()
    cfg.run_dir = str(tmp_path / "run")
    s = cfg.synth
    s.prompts, s.exclude, s.min_chars, s.max_tokens, s.hints = prompts, [], 1, 48, ["", "hi "]
    # nucleus sampling: the tests' seeds keep 6 of its random text
    s.sampling.top_p, s.sampling.top_k = 0.95, synth.pop("top_k", 0)
    for k, v in synth.items():
        setattr(s, k, v)
    return cfg


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_near_duplicates_exact_near_and_containment():
    idx = syn.NearDuplicates(0.6)
    idx.add("How do I reverse a list in Python?")
    assert idx.near("how do I   reverse a LIST in python!")  # same normalised text
    assert idx.near("How do I reverse a list in Python quickly?")  # Jaccard 5/7
    assert not idx.near("How do I sort a dictionary by value in Python?")
    assert not idx.near("What is the capital of France?")
    held = syn.NearDuplicates(0.6, containment=True)
    held.add(HELD)
    fragment = "engaging travel blog post about a recent trip to Hawaii"
    assert held.near(fragment)  # a piece copied out of a held-out prompt
    assert not syn.NearDuplicates(0.6).near(fragment)


@pytest.mark.parametrize(
    "text,ended,why",
    [
        ("Explain how rainbows form in the sky.", True, None),
        ("Explain how rainbows form in the sky.", False, "cut"),
        ("Hi?", True, "short"),
        ("!!!! ---- 1234 5678 #### ????", True, "garbage"),
        ("Tell me \x07 something", True, "garbage"),
        ("What is this?\nassistant\nSure", True, "template"),
        ("Explain <|im_start|> tokens", True, "template"),
        ("Объясни, как образуется радуга на небе.", True, "language"),
        ("the cat sat the cat sat the cat sat the cat sat the cat sat", True, "loop"),
    ],
)
def test_reject_reasons(text, ended, why):
    assert syn.reject_reason(text, text, ended, min_chars=8) == why


def test_pre_query_is_the_template_up_to_the_user_text(chatml_tokenizer):
    r, tok = Rendering(), chatml_tokenizer

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    system = "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
    assert syn.pre_query_ids(tok, r, "", "Tell me") == ids(system + "<|im_start|>user\nTell me")
    own = "<|im_start|>system\nHi there<|im_end|>\n<|im_start|>user\n"
    assert syn.pre_query_ids(tok, r, "Hi there", "") == ids(own)
    with pytest.raises(UserError, match="data.format=text"):
        syn.pre_query_ids(chatml_tokenizer, Rendering(format="text"), "", "")


def test_deterministic_under_a_seed_with_provenance_and_reuse(target, tmp_path):
    cfg = lenient(tmp_path)
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    stats = syn.synthesize_prompts(cfg, target, a, "project")
    assert stats["kept"] == 6 and stats["engine"] == "project" and not stats["reused"]
    assert stats["candidates"] == 6 + sum(stats["rejected"].values())
    syn.synthesize_prompts(cfg, target, b, "project")
    assert read(a) == read(b)
    cfg.synth.seed = 1
    syn.synthesize_prompts(cfg, target, c, "project")
    assert [r["messages"] for r in read(c)] != [r["messages"] for r in read(a)]
    recs = read(a)
    assert len({syn.normalise(r["messages"][0]["content"]) for r in recs}) == 6
    assert {r["provenance"]["hint"] for r in recs} == {"", "hi "}  # hints interleaved
    prov = recs[0]["provenance"]
    assert prov["synthesised"] is True
    assert {k: prov[k] for k in ("seed", "temperature", "top_p", "top_k", "engine", "dtype")} == {
        "seed": 0,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 0,
        "engine": "project",
        "dtype": "float32",
    }
    assert "target_revision" in prov and recs[0]["source"] == "synth"
    # same settings: the file is reused, not resampled
    cfg.synth.seed = 0
    again = syn.synthesize_prompts(cfg, target, a, "project")
    assert again["reused"] and read(a) == recs


def test_a_file_made_under_the_engines_old_name_is_reused(target, tmp_path):
    """Prompts written when the project's loop was named "hf" (generate.engine's renamed value)
    were made by the same engine: reused, not resampled; another engine's are resampled."""
    cfg = lenient(tmp_path)
    path = tmp_path / "a.jsonl"
    syn.synthesize_prompts(cfg, target, path, "project")
    recs = read(path)
    for r in recs:
        r["provenance"]["engine"] = "hf"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    again = syn.synthesize_prompts(cfg, target, path, "project")
    assert again["reused"] and read(path) == recs
    for r in recs:
        r["provenance"]["engine"] = "vllm"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    assert not syn.synthesize_prompts(cfg, target, path, "project")["reused"]


def test_top_k_reaches_both_engines(target, tmp_path, monkeypatch):
    """synth.sampling.top_k reaches the project's sampler and vLLM's request (decode.sampler
    tests what top_k does to the draw)."""
    cfg = lenient(tmp_path, prompts=2, top_k=7)
    seen = []
    ids = target.tokenizer("Explain how rainbows form.", add_special_tokens=False)["input_ids"]

    def fake_decode(_t, rows, _n, sampling, seeds, *_a):
        seen.append(sampling)
        return [(list(ids), True) for _ in rows]

    monkeypatch.setattr(syn, "decode_batch", fake_decode)
    syn.synthesize_prompts(cfg, target, tmp_path / "k.jsonl", "project")
    assert seen and {(x.temperature, x.top_p, x.top_k) for x in seen} == {(1.0, 0.95, 7)}
    assert {r["provenance"]["top_k"] for r in read(tmp_path / "k.jsonl")} == {7}

    class FakeVllm(VLLMEngine):  # the real request, no subprocess
        def _launch(self, req, stream, on_results):
            seen.append(req)
            return {"results": [{"samples": [[*ids, 2]]} for _ in req["prompts"]]}

    engine = FakeVllm(python=Path("python"), target="tiny")
    out = syn._sample_vllm(engine, [[1, 2]], 1, cfg.synth, [2], seed=0)
    assert seen[-1]["top_k"] == 7 and seen[-1]["top_p"] == 0.95 and out == [[(list(ids), True)]]


def _fake_sampler(target, texts):
    """sample_turns that hands out `texts` in order across rounds (every hint row the same),
    each ended on the stop token; cut turns once they run out."""
    tok = target.tokenizer
    queue = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def sample(_t, rows, count, _s, _engine, _vllm, _seed):
        out = [(queue.pop(0), True) if queue else ([], False) for _ in range(count)]
        return [out for _ in rows]

    return sample


def test_never_emits_a_held_out_prompt(target, tmp_path, monkeypatch):
    held_file = tmp_path / "heldout.jsonl"
    rec = {"id": "mtbench-81", "messages": [{"role": "user", "content": HELD}], "source": "mt"}
    held_file.write_text(json.dumps(rec) + "\n")
    good = [
        "Explain how rainbows form in the sky.",
        "List three uses of baking soda at home.",
        "Describe the water cycle for a child.",
    ]
    texts = [
        HELD,  # verbatim
        HELD.upper() + "!!",  # same normalised text
        "Compose an engaging travel blog post about a recent trip to Hawaii.",  # near
        good[0],
        good[0] + " ",  # duplicate of a kept one
        good[1],
        "Explain how rainbows form in the sky, briefly.",  # near-duplicate of a kept one
        good[2],
    ]
    monkeypatch.setattr(syn, "sample_turns", _fake_sampler(target, texts))
    cfg = lenient(tmp_path, prompts=3, exclude=[str(held_file)], hints=[""])
    out = tmp_path / "p.jsonl"
    stats = syn.synthesize_prompts(cfg, target, out, "project")
    assert [r["messages"][0]["content"] for r in read(out)] == good
    assert stats["rejected"] == {"held_out": 3, "duplicate": 2}


def test_vllm_engine_gets_n_samples_per_pre_query(target, tmp_path, monkeypatch):
    tok = target.tokenizer
    calls = []

    class FakeVLLM:
        dtype = "bfloat16"

        def run(self, prompts, max_new_tokens, **kw):
            calls.append({"prompts": prompts, "max_new_tokens": max_new_tokens, **kw})
            n = kw["n"]
            stop = kw["stop_ids"][0]
            samples = [
                tok(f"Question number {i} about topic {i * 7}.")["input_ids"] + [stop]
                for i in range(n)
            ]
            return {"results": [{"tokens": samples[0], "samples": samples} for _ in prompts]}

    monkeypatch.setattr(syn, "choose_engine", lambda cfg, choice, budget: ("vllm", FakeVLLM()))
    cfg = lenient(tmp_path, prompts=4)
    out = tmp_path / "v.jsonl"
    stats = syn.synthesize_prompts(cfg, target, out, "vllm")
    (call,) = calls
    assert call["mode"] == "generate" and call["n"] >= 2 and call["max_new_tokens"] == 48
    assert call["stop_ids"] == [int(x) for x in target.eos_token_ids]
    assert call["sampling"].temperature == 1.0 and call["sampling"].top_p == 0.95
    assert len(call["prompts"]) == 2  # one pre-query per hint
    recs = read(out)
    assert stats["kept"] == 4 and recs[0]["provenance"]["engine"] == "vllm"
    assert recs[0]["provenance"]["dtype"] == "bfloat16"
    assert recs[0]["messages"][0]["content"] == "Question number 0 about topic 0."


def test_no_usable_turn_is_a_clear_error(target, tmp_path, monkeypatch):
    monkeypatch.setattr(syn, "sample_turns", _fake_sampler(target, ["x"]))
    cfg = lenient(tmp_path, prompts=2, min_chars=5, max_rounds=2)
    with pytest.raises(UserError, match="none of .* sampled user turns passed"):
        syn.synthesize_prompts(cfg, target, tmp_path / "x.jsonl", "project")


def test_cli_generate_synthesises_then_answers(tmp_path, capsys):
    d = tmp_path / "tiny-model"
    tiny_model().save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    run_dir = tmp_path / "run"
    argv = [
        "generate",
        "--generate.engine=project",
        "--generate.max_new_tokens=4",
        f"--target.model={d}",
        "--target.dtype=float32",
        "--target.num_taps=1",
        f"--run_dir={run_dir}",
        "--generate.prompts=synth",
        "--synth.prompts=3",
        "--synth.min_chars=1",
        "--synth.max_tokens=48",
        "--synth.exclude=[]",
    ]
    torch.manual_seed(0)
    assert cli.main(argv) == 0
    prompts = read(run_dir / "generated.prompts.jsonl")
    answers = read(run_dir / "generated.jsonl")
    assert len(prompts) == 3 and {r["id"] for r in answers} == {r["id"] for r in prompts}
    for r in answers:
        assert r["messages"][0] == next(p for p in prompts if p["id"] == r["id"])["messages"][0]
        assert r["provenance"]["engine"] == "project"
    assert "synth: 3 prompts" in capsys.readouterr().out


def source_cfg(tmp_path, prompts=4) -> Config:
    """data.sources = ['synth'] on the tiny target: four prompts, answers of four tokens."""
    cfg = lenient(tmp_path, prompts=prompts)
    cfg.data.sources = ["synth"]
    cfg.target.model, cfg.target.dtype = "tiny", "float32"
    cfg.target.cache_dir = str(tmp_path / "cache")
    cfg.generate.engine, cfg.generate.max_new_tokens = "project", 4
    return cfg


def test_synth_data_source_is_cached_by_every_setting(target, tmp_path, monkeypatch):
    from dflash_trainer.data.prepare import resolve_sources

    cfg = source_cfg(tmp_path)
    (greedy,) = resolve_sources(cfg, target)
    prompts_file, answers = syn.synth_cache_paths(cfg)
    assert greedy == str(answers) and answers.parent == prompts_file.parent
    recs, prompts = read(answers), read(prompts_file)
    assert sorted(r["id"] for r in recs) == sorted(p["id"] for p in prompts) and len(recs) == 4
    assert all(r["provenance"]["temperature"] == 0.0 for r in recs)
    # cached: nothing is loaded, sampled or generated the second time
    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("target loaded"))
    monkeypatch.setattr(syn, "sample_turns", lambda *a, **k: pytest.fail("resampled"))
    assert resolve_sources(cfg, None) == [greedy]
    # sampled answers: another answers file for the same prompts (the prompts file is reused)
    cfg.synth.answer_sampling.temperature, cfg.synth.answer_sampling.top_p = 0.8, 0.9
    (sampled,) = resolve_sources(cfg, target)
    assert sampled != greedy and syn.synth_cache_paths(cfg)[0] == prompts_file
    recs = read(answers.parent / sampled.rsplit("/", 1)[-1])
    assert {(r["provenance"]["temperature"], r["provenance"]["top_p"]) for r in recs} == {
        (0.8, 0.9)
    }
    assert read(prompts_file) == prompts
    # another synthesis setting names another prompts file
    cfg.synth.seed = 1
    assert syn.synth_cache_paths(cfg)[0] != prompts_file


def test_synth_data_source_without_prompts_is_a_clear_error(target, tmp_path):
    from dflash_trainer.data.prepare import resolve_sources

    cfg = source_cfg(tmp_path, prompts=0)
    with pytest.raises(UserError, match="synth.prompts is 0"):
        resolve_sources(cfg, target)


def test_synth_conversations_are_their_own_stratum():
    from dflash_trainer.data.prepare import source_label

    written = {"/c/e.jsonl": "embedded", "/c/s.answers.jsonl": "synth"}
    assert source_label("mtbench-81", "/c/e.jsonl", written) == "mt-bench"
    assert source_label("humaneval-3", "/c/e.jsonl", written) == "humaneval"
    assert source_label("synth-000017", "/c/s.answers.jsonl", written) == "synth"
    assert source_label("a-1", "/data/mine.jsonl", written) == "mine.jsonl"


def test_generate_says_when_synth_prompts_are_not_asked_for(tmp_path, caplog):
    """`--synth.prompts=N` alone used to switch `generate` to synthesis; now it takes
    --generate.prompts=synth, and the old spelling is told so instead of passing in silence."""
    missing = tmp_path / "none.jsonl"
    argv = ["generate", "--synth.prompts=3", f"--generate.prompts={missing}"]
    with caplog.at_level("WARNING"):
        assert cli.main(argv + [f"--run_dir={tmp_path / 'run'}"]) != 0  # the file is missing
    assert "--generate.prompts=synth" in caplog.text and "synth.prompts=3" in caplog.text
