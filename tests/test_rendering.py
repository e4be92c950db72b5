"""One rendering for training, generation and evaluation (data/chat.py: Rendering): the chat
template's variables (enable_thinking), a replacement template (data.chat_template), and raw text
for a base model without a template (data.format=text), through generate, train and eval."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import CHATML_SPECIALS, CHATML_TEMPLATE, word_tokenizer
from dflash_trainer.commands import eval as eval_command
from dflash_trainer.commands import generate as generate_command
from dflash_trainer.config import DataConfig
from dflash_trainer.data import generate as gen
from dflash_trainer.data.chat import Rendering, build_dataset
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.data.sources import Conversation, load_sources
from dflash_trainer.decode import loop as sd
from dflash_trainer.errors import DataError, UserError
from dflash_trainer.eval import evaluation as ev
from dflash_trainer.models.target import TargetModel
from dflash_trainer.run import train
from tiny import base_tokenizer, tiny_config, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

THINK_SPECIALS = [*CHATML_SPECIALS, "<think>", "</think>"]
# Qwen3's switch: with enable_thinking=false an empty think block opens every answer (the
# generation prompt's and the rendered history's alike, so the template is prefix-stable).
NO_THINK = (
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}" + NO_THINK + "{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n" + NO_THINK + "{% endif %}"
)
PROMPT = [{"role": "user", "content": "Hello"}]
CONV = {"id": "c0", "messages": [*PROMPT, {"role": "assistant", "content": "Hi there"}]}


def config(tmp_path, **over):
    """tiny_config with one torch thread: `generate` sets pipeline.cpu_threads process-wide, and
    a tiny model on a busy 2-core box is many times slower with two."""
    return tiny_config(tmp_path, **{"pipeline.cpu_threads": 1, **over})


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate_args(cfg, prompts, output, max_new_tokens=2, batch_size=1):
    """`generate`'s settings are the config's [generate] section: set them on `cfg` (the
    command's argparse namespace carries nothing of its own)."""
    g = cfg.generate
    g.prompts, g.out, g.limit = str(prompts), str(output), 0
    g.max_new_tokens, g.batch_size = max_new_tokens, batch_size
    return SimpleNamespace()


def three_prompts(cfg, target, monkeypatch, tmp_path) -> tuple[list, list, list]:
    """The prompt ids of CONV as training tokenizes it (prepare_data: the ids before the first
    supervised token), as `generate` hands them to the target, and as `eval` decodes from them:
    each entry point builds its own rendering from `cfg`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = write_jsonl(tmp_path / "conv.jsonl", [CONV])
    cfg.data.sources, cfg.eval.datasets = [str(src)], [str(src)]
    train_set, _ = prepare_data(cfg, target.tokenizer)
    mask = train_set.loss_mask[0]
    trained = train_set.input_ids[0][: int(mask.argmax())].tolist()

    seen = []

    def decode(model, rows, *a, **k):  # generation: what the target is asked to continue
        seen.extend(rows)
        return [([5], True) for _ in rows]

    monkeypatch.setattr(gen, "decode_batch", decode)
    monkeypatch.setattr(TargetModel, "load", classmethod(lambda cls, c, d, *_: target))
    assert generate_command.run(cfg, generate_args(cfg, src, tmp_path / "gen.jsonl")) == 0

    def summary(self, prompts, *a, **k):  # evaluation: what is decoded
        seen.extend(prompts)
        r = sd.GenResult([5], [1], [0], [4])
        return SimpleNamespace(spec_results=[r], ar_results=[r], tie_gaps=[])

    monkeypatch.setattr(ev.PromptDecoder, "summary", summary)
    ev.evaluate_datasets(cfg, target, None, 4)
    generated, evaluated = seen
    return trained, list(generated), list(evaluated)


def test_enable_thinking_renders_training_as_generation_and_eval(tmp_path, monkeypatch):
    tok = word_tokenizer(THINK_SPECIALS, THINK_TEMPLATE)
    think = tok.convert_tokens_to_ids("<think>")
    rendered = {}
    for on in (False, True):
        cfg = config(
            tmp_path / f"t{on}",
            **{
                "target.enable_thinking": on,
                "data.eval_fraction": 0,
                "data.cache_dir": tmp_path / "tok",  # shared: the key must tell them apart
            },
        )
        trained, generated, evaluated = three_prompts(
            cfg, tiny_target(tokenizer=tok), monkeypatch, tmp_path / f"t{on}"
        )
        assert trained == generated == evaluated, on
        rendered[on] = trained
    assert think in rendered[False] and think not in rendered[True]


def test_chat_template_file_replaces_the_tokenizers_everywhere(tmp_path, monkeypatch):
    tok = word_tokenizer(THINK_SPECIALS, CHATML_TEMPLATE)  # its own: a default system turn
    system = tok.convert_tokens_to_ids("system")
    path = tmp_path / "template.jinja"
    path.write_text(THINK_TEMPLATE)
    cfg = config(
        tmp_path / "a",
        **{
            "data.chat_template": path,
            "data.eval_fraction": 0,
            "data.cache_dir": tmp_path / "tok",
        },
    )
    trained, generated, evaluated = three_prompts(
        cfg, tiny_target(tokenizer=tok), monkeypatch, tmp_path / "a"
    )
    text = tok.apply_chat_template(  # with the config's enable_thinking (false)
        PROMPT,
        chat_template=THINK_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert trained == generated == evaluated == tok(text, add_special_tokens=False)["input_ids"]
    assert system not in trained
    # another template text in the same file: the tokenized-data cache must not answer for it
    path.write_text(CHATML_TEMPLATE)
    train_set, _ = prepare_data(cfg, tok)
    assert system in train_set.input_ids[0].tolist()


def test_a_missing_chat_template_file_is_named_before_any_work(tmp_path, monkeypatch):
    cfg = config(tmp_path, **{"data.chat_template": tmp_path / "nope.jinja"})
    with pytest.raises(UserError, match=r"data\.chat_template: '.*nope\.jinja' is not a file"):
        prepare_data(cfg, word_tokenizer(CHATML_SPECIALS, CHATML_TEMPLATE))

    def no_load(*a, **k):
        raise AssertionError("the target must not be loaded with a bad data.chat_template")

    monkeypatch.setattr(TargetModel, "load", no_load)
    with pytest.raises(UserError, match=r"nope\.jinja' is not a file"):
        generate_command.run(cfg, generate_args(cfg, "embedded", tmp_path / "g.jsonl"))


# ------------------------------------------------------------------------------ raw text


def test_raw_text_records_parse_and_wrong_shapes_name_the_format(tmp_path):
    f = write_jsonl(
        tmp_path / "raw.jsonl",
        [
            {"text": "a document"},
            {"id": "p", "prompt": "2 + 3 =", "completion": " 5"},
            {"prompt": "x"},
        ],
    )
    convs, rep = load_sources([str(f)], data_format="text")
    assert [(c.id, c.messages) for c in convs] == [
        ("raw:1", [{"role": "assistant", "content": "a document"}]),
        ("p", [{"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": " 5"}]),
    ]
    assert rep.sources[0].dropped_empty == 1  # a prompt without a completion: nothing to learn
    prompts, _ = load_sources([str(f)], data_format="text", prompts_only=True)
    assert prompts[2].messages == [{"role": "user", "content": "x"}]  # ... but one to answer

    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [CONV])
    with pytest.raises(DataError, match=r"line 1: field 'text': missing.*--data\.format=chat"):
        load_sources([str(bad)], data_format="text")
    with pytest.raises(DataError, match=r"line 1: field 'messages': missing.*--data\.format=text"):
        load_sources([str(f)])
    for rec, problem in [
        ({"text": 3}, r"field 'text': expected a string"),
        ({"text": "a", "prompt": "b"}, "not both"),
        ({"prompt": "a", "completion": ["b"]}, r"field 'completion': expected a string"),
    ]:
        write_jsonl(bad, [rec])
        with pytest.raises(DataError, match=problem):
            load_sources([str(bad)], data_format="text")


@pytest.mark.parametrize("bos_first", [True, False])
def test_raw_text_tokenization_frames_with_the_tokenizers_bos_and_eos(tmp_path, bos_first):
    tok = base_tokenizer(bos_first)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    head = [bos] if bos_first else []

    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    convs = [
        Conversation("doc", [{"role": "assistant", "content": "Once upon a time"}], "s"),
        Conversation(
            "pair",
            [{"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": " 5."}],
            "s",
        ),
        Conversation(  # cut at the generation limit: the target never produced an EOS
            "cut",
            [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": " 1 2 3"}],
            "s",
            truncated=True,
        ),
    ]
    text = Rendering(format="text")
    ds = build_dataset(DataConfig(), tok, convs, cache_dir=tmp_path, rendering=text)
    got = {i: (x.tolist(), m.tolist()) for i, x, m in zip(ds.ids, ds.input_ids, ds.loss_mask)}
    doc = enc("Once upon a time")
    assert got["doc"] == (head + doc + [eos], [0] * len(head) + [1] * (len(doc) + 1))
    p, c = enc("2 + 3 ="), enc(" 5.")
    assert got["pair"] == (head + p + c + [eos], [0] * len(head + p) + [1] * (len(c) + 1))
    p, c = enc("Count:"), enc(" 1 2 3")
    assert got["cut"] == (head + p + c, [0] * len(head + p) + [1] * len(c))
    # the prompt part is what generation and evaluation feed the target
    assert text.prompt_ids(tok, [{"role": "user", "content": "2 + 3 ="}]) == head + enc("2 + 3 =")


def test_a_tokenizer_without_template_names_both_ways_forward(tmp_path, monkeypatch):
    tok = base_tokenizer()
    both = r"has no chat template.*--data\.format=text.*--data\.chat_template=FILE"
    convs, _ = load_sources([str(write_jsonl(tmp_path / "c.jsonl", [CONV]))])
    with pytest.raises(UserError, match=both):
        build_dataset(DataConfig(), tok, convs, cache_dir=tmp_path)
    # generation, where a default (chat) run meets the template-less target first
    monkeypatch.setattr(
        TargetModel, "load", classmethod(lambda cls, c, d, *_: tiny_target(tokenizer=tok))
    )
    cfg = config(tmp_path)
    with pytest.raises(UserError, match=both):
        generate_command.run(cfg, generate_args(cfg, tmp_path / "c.jsonl", tmp_path / "g.jsonl"))
    # the second way forward: a template file
    assert Rendering(chat_template=CHATML_TEMPLATE).prompt_ids(tok, PROMPT)


def greedy_continuation(target, ids: list[int], max_new: int) -> list[int]:
    """Reference: no cache, no padding, argmax until an EOS id."""
    out = []
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(target.model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if nxt in target.eos_token_ids:
            break
        out.append(nxt)
    return out


def test_base_model_without_template_generates_trains_and_evaluates(tmp_path, monkeypatch):
    tok = base_tokenizer()
    target = tiny_target(tokenizer=tok)
    monkeypatch.setattr(TargetModel, "load", classmethod(lambda cls, c, d, *_: target))
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"id": f"p{i}", "prompt": f"Q{i}: {i} + {i} ="} for i in range(12)],
    )
    answers = tmp_path / "answers.jsonl"
    cfg = config(
        tmp_path,
        **{
            "data.format": "text",
            "data.sources": answers,
            "data.cache_dir": tmp_path / "tok",
            "data.eval_fraction": 0.25,
            "eval.max_new_tokens": 6,
            "eval.validation_fraction": 0,
            "optim.epochs": 2,
        },
    )

    # generate: the target continues each prompt's raw text; the record is a text-format pair
    assert generate_command.run(cfg, generate_args(cfg, prompts, answers, 10, 4)) == 0
    recs = read_jsonl(answers)
    assert len(recs) == 12 and set(recs[0]) == {"id", "prompt", "completion", "provenance"}
    assert recs[0]["provenance"]["format"] == "text"
    for r in recs[:3]:
        ids = [tok.bos_token_id] + tok(r["prompt"], add_special_tokens=False)["input_ids"]
        want = tok.decode(greedy_continuation(target, ids, 10), skip_special_tokens=True)
        assert r["completion"] == want

    # train: the real path (prepare_data -> tokenization -> pipeline -> end-of-run eval)
    res = train(cfg, target=target)
    assert res.steps > 0 and res.eval["eval/prompts"] == 3
    held = read_jsonl(res.run_dir / "heldout.jsonl")
    assert len(held) == 3 and all(set(h) == {"id", "prompt", "source"} for h in held)

    # eval: the export's training.json brings data.format=text; raw prompts are continued
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"id": "r", "prompt": "7 + 7 ="}])
    out = tmp_path / "eval.json"
    args = SimpleNamespace(
        drafter_path=str(res.export_dir),
        output=str(out),
        preset=None,
        config_file=None,
        overrides=[f"--eval.datasets=heldout,{raw}"],
    )
    assert eval_command.run(cfg, args) == 0
    d = json.loads(out.read_text())["datasets"]
    assert d["heldout"]["num_responses"] == 3 and d[str(raw)]["num_responses"] == 1
    assert d["heldout"]["lossless"] is True and d[str(raw)]["lossless"] is True
