import json

import pytest

from dflash_trainer.data.sources import load_sources, parse_source_spec, read_source
from dflash_trainer.errors import DataError, UserError

OPENAI = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "be nice"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a"},
    ]
}


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_jsonl_both_shapes_and_ids(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [OPENAI, {**SHAREGPT, "id": "abc"}])
    convs, rep = load_sources([str(p)])
    assert [c.id for c in convs] == ["d:1", "abc"]
    assert convs[1].messages == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert convs[0].source == str(p)
    assert rep.sources[0].read == 2 and rep.sources[0].kept == 2


def test_json_list_and_data_key(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([OPENAI, SHAREGPT]))
    (tmp_path / "b.json").write_text(json.dumps({"data": [OPENAI]}))
    convs, _ = load_sources([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert [c.id for c in convs] == ["a:0", "a:1", "b:0"]


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {**OPENAI, "id": None},
        {"messages": [{"role": "user", "content": "x"}], "id": None},
        {**OPENAI, "id": "z"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    convs, rep = load_sources([str(tmp_path / "p.parquet")])
    assert [c.id for c in convs] == ["p:0", "z"]
    assert rep.sources[0].dropped_empty == 1


def test_parquet_bad_row_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [OPENAI, {"messages": [{"role": "bot", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: row 1: field 'messages\[0\]\.role'"):
        load_sources([str(tmp_path / "p.parquet")])


def test_hf_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "hf"
    datasets.Dataset.from_list([SHAREGPT, SHAREGPT]).save_to_disk(str(d))
    convs, _ = load_sources([str(d)])
    assert len(convs) == 2 and convs[0].id == "hf:0"
    assert convs[0].messages[-1] == {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    "record, field, line",
    [
        ("{not json", "<json>", 2),
        ({"text": "hi"}, "messages", 2),
        ({"messages": "hi"}, "messages", 2),
        ({"messages": [{"content": "x"}]}, r"messages\[0\]\.role", 2),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]\.role", 2),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content", 2),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content", 2),
        ({"conversations": [{"from": "robot", "value": "x"}]}, r"conversations\[0\]\.from", 2),
        (
            {"conversations": [{"from": "gpt", "value": ["x"]}]},
            r"conversations\[0\]\.value\[0\]",
            2,
        ),
        ({**OPENAI, "id": [1]}, "id", 2),
        ([1, 2], "<record>", 2),
    ],
)
def test_bad_record_names_file_line_field(tmp_path, record, field, line):
    p = write_jsonl(tmp_path / "bad.jsonl", [OPENAI, record, OPENAI])
    with pytest.raises(
        DataError,
        match=rf"bad\.jsonl: line {line}: field '{field}'.*"
        r"data\.on_bad_record=skip",
    ):
        load_sources([str(p)])
    convs, rep = load_sources([str(p)], on_bad_record="skip")
    assert len(convs) == 2 and rep.sources[0].bad == 1 and rep.sources[0].read == 3


def test_non_utf8_line(tmp_path):
    p = tmp_path / "enc.jsonl"
    p.write_bytes(json.dumps(OPENAI).encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"enc\.jsonl: line 2: field '<bytes>': not valid UTF-8"):
        load_sources([str(p)])
    convs, rep = load_sources([str(p)], on_bad_record="skip")
    assert len(convs) == 1 and rep.sources[0].bad == 1


def test_bad_json_file(tmp_path):
    (tmp_path / "x.json").write_text('[{"messages": []},\n oops]')
    with pytest.raises(DataError, match=r"x\.json: line 2: invalid JSON"):
        load_sources([str(tmp_path / "x.json")])
    (tmp_path / "z.json").write_text(json.dumps({"data": [OPENAI, {"messages": [{"role": 1}]}]}))
    with pytest.raises(DataError, match=r"z\.json: item 1: field 'messages\[0\]\.role'"):
        load_sources([str(tmp_path / "z.json")])
    (tmp_path / "y.json").write_text('{"rows": []}')
    with pytest.raises(DataError, match=r"y\.json: a JSON source must be a list"):
        load_sources([str(tmp_path / "y.json")])


def test_empty_and_missing_and_roots(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"e\.jsonl: the source is empty"):
        load_sources([str(tmp_path / "e.jsonl")])
    with pytest.raises(UserError, match="does not exist"):
        load_sources([str(tmp_path / "nope.jsonl")])
    inside = tmp_path / "root"
    inside.mkdir()
    p = write_jsonl(tmp_path / "out.jsonl", [OPENAI])
    with pytest.raises(UserError, match="outside the allowed data roots"):
        load_sources([str(p)], roots=[str(inside)])
    q = write_jsonl(inside / "in.jsonl", [OPENAI])
    assert len(load_sources([str(q)], roots=[str(inside)])[0]) == 1
    with pytest.raises(UserError, match="unknown extension"):
        (tmp_path / "a.txt").write_text("x")
        load_sources([str(tmp_path / "a.txt")])


def test_empty_and_responseless_dropped_and_counted(tmp_path):
    recs = [
        OPENAI,
        {"messages": []},
        {"messages": [{"role": "user", "content": "q"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
    ]
    convs, rep = load_sources([str(write_jsonl(tmp_path / "d.jsonl", recs))])
    assert len(convs) == 1
    assert rep.sources[0].dropped_empty == 3 and rep.total("read") == 4


def test_weights_deterministic(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{**OPENAI, "id": f"a{i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{**OPENAI, "id": f"b{i}"} for i in range(10)])
    convs, rep = load_sources([f"{a}@2.5", f"{b}@0.3"], seed=1)
    ids = [c.id for c in convs]
    assert rep.sources[0].sampled == 25 and rep.sources[1].sampled == 3
    assert all(ids.count(f"a{i}") in (2, 3) for i in range(10))
    assert len({i for i in ids if i.startswith("b")}) == 3
    assert ids == [c.id for c in load_sources([f"{a}@2.5", f"{b}@0.3"], seed=1)[0]]
    assert ids != [c.id for c in load_sources([f"{a}@2.5", f"{b}@0.3"], seed=2)[0]]
    assert parse_source_spec("x@y.jsonl") == ("x@y.jsonl", 1.0)
    with pytest.raises(UserError, match="weight"):
        parse_source_spec("x.jsonl@-1")


def test_huge_line_streams(tmp_path):
    """A 100 MB line is read (and memory stays bounded by that line, not the file)."""
    import tracemalloc

    p = tmp_path / "big.jsonl"
    big = "x" * (100 << 20)
    with open(p, "w") as f:
        f.write(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": big},
                    ]
                }
            )
            + "\n"
        )
        f.write(json.dumps(OPENAI) + "\n")
    del big
    tracemalloc.start()
    convs = read_source(p)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(convs) == 2 and len(convs[0].messages[1]["content"]) == 100 << 20
    # Streaming peak ~ 2x the line (readline's chunk join, then decoded line + parsed record);
    # reading the file whole, or keeping the bytes alive while parsing, needs >= 3x.
    assert peak < 230 << 20, peak >> 20


# ------------------------------------------------------------------------ datasets.load_dataset


def fake_hub(monkeypatch, hub: dict) -> list:
    """`datasets.load_dataset` answering from `hub` {(name, config): DatasetDict} (no network),
    the way the real one does: no split -> the DatasetDict, a split -> that Dataset. Returns
    the calls made."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        if (path, name) not in hub:
            raise datasets.exceptions.DatasetNotFoundError(
                f"Dataset '{path}' doesn't exist on the Hub or cannot be accessed."
            )
        dd = hub[(path, name)]
        if split is None:
            return dd
        if split not in dd:
            raise ValueError(f'Unknown split "{split}". Should be one of {list(dd)}.')
        return dd[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def chat_hub(monkeypatch) -> list:
    """org/chat: ultrachat-like OpenAI rows in train_sft, ShareGPT rows in test_sft; org/multi
    has a config 'code' with one split."""
    from datasets import Dataset, DatasetDict

    train = [{**OPENAI, "prompt": f"p{i}"} for i in range(4)]
    train[1] = {"messages": [{"role": "user", "content": "only a question"}], "prompt": "x"}
    test = [{**SHAREGPT, "id": f"t{i}"} for i in range(3)]
    return fake_hub(
        monkeypatch,
        {
            ("org/chat", None): DatasetDict(
                train_sft=Dataset.from_list(train), test_sft=Dataset.from_list(test)
            ),
            ("org/multi", "code"): DatasetDict(train=Dataset.from_list([OPENAI, OPENAI])),
        },
    )


def test_hub_dataset_split_config_and_weight(monkeypatch):
    calls = chat_hub(monkeypatch)
    convs, rep = load_sources(
        ["org/chat:train_sft@2", "org/chat:test_sft", "org/multi:code:train@0.5"], seed=3
    )
    assert calls == [
        ("org/chat", None, "train_sft"),
        ("org/chat", None, "test_sft"),
        ("org/multi", "code", "train"),
    ]
    s = rep.sources
    assert [x.path for x in s] == [
        "org/chat:train_sft",
        "org/chat:test_sft",
        "org/multi:code:train",
    ]
    assert (s[0].read, s[0].dropped_empty, s[0].kept, s[0].sampled) == (4, 1, 3, 6)
    assert (s[1].kept, s[1].sampled) == (3, 3) and (s[2].kept, s[2].sampled) == (2, 1)
    # rows without an 'id' are named by dataset, split and row; records are parsed as usual
    by_source = {}
    for c in convs:
        by_source.setdefault(c.source, []).append(c)
    assert sorted({c.id for c in by_source["org/chat:train_sft"]}) == [
        "chat:train_sft:0",
        "chat:train_sft:2",
        "chat:train_sft:3",
    ]
    assert [c.id for c in by_source["org/chat:test_sft"]] == ["t0", "t1", "t2"]
    assert by_source["org/chat:test_sft"][0].messages[-1] == {"role": "assistant", "content": "a"}
    assert by_source["org/multi:code:train"][0].id.startswith("multi:code:train:")


def test_hub_dataset_without_split(monkeypatch):
    from datasets import Dataset, DatasetDict

    calls = chat_hub(monkeypatch)
    with pytest.raises(
        DataError,
        match=r"'org/chat' has the splits test_sft, train_sft; name one, e\.g\. "
        r"'org/chat:test_sft'",
    ):
        load_sources(["org/chat"])
    assert calls == [("org/chat", None, None)]
    fake_hub(monkeypatch, {("org/one", None): DatasetDict(train=Dataset.from_list([OPENAI]))})
    convs, _ = load_sources(["org/one"])  # a single split needs no name
    assert [c.id for c in convs] == ["one:0"]


def test_hub_dataset_errors_name_the_spec_and_the_fix(monkeypatch, tmp_path):
    chat_hub(monkeypatch)
    with pytest.raises(DataError) as e:
        load_sources(["org/nope:train"])
    msg = str(e.value)
    assert "cannot load 'org/nope:train' with datasets.load_dataset (DatasetNotFoundError" in msg
    assert "check the id, config and split" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(DataError, match=r"'org/chat:dev'.*Unknown split \"dev\""):
        load_sources(["org/chat:dev"])
    with pytest.raises(UserError, match="not NAME, NAME:SPLIT or NAME:CONFIG:SPLIT"):
        load_sources(["org/chat:a:b:c"])
    # a bad row is named like a bad line of a file
    from datasets import Dataset, DatasetDict

    bad = [OPENAI, {"messages": [{"role": "bot", "content": "x"}]}]
    fake_hub(monkeypatch, {("org/bad", None): DatasetDict(train=Dataset.from_list(bad))})
    with pytest.raises(DataError, match=r"org/bad:train: row 1: field 'messages\[0\]\.role'"):
        load_sources(["org/bad:train"])
    # data.roots allows local data only
    with pytest.raises(UserError, match=r"'org/chat:train_sft' is not a local path.*data\.roots"):
        load_sources(["org/chat:train_sft"], roots=[str(tmp_path)])


def test_hub_dataset_needs_datasets_installed(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DataError, match=r"'org/chat:train_sft'.*dflash-trainer\[hf\]"):
        load_sources(["org/chat:train_sft"])


def test_local_path_wins_and_file_names_are_not_hub_ids(monkeypatch, tmp_path):
    from datasets import Dataset

    calls = chat_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    Dataset.from_list([SHAREGPT]).save_to_disk("org/chat")  # same name as the Hub dataset
    convs, _ = load_sources(["org/chat"])
    assert calls == [] and [c.id for c in convs] == ["chat:0"]
    for missing in ("data/train.jsonl", "train.jsonl", "chat"):
        with pytest.raises(UserError, match=f"'{missing}' does not exist"):
            load_sources([missing])
    assert calls == []


def test_local_dir_of_data_files_via_load_dataset(monkeypatch, tmp_path):
    """A downloaded dataset (a dir of JSONL files per split) is read by the real load_dataset,
    offline; a split is named with ':SPLIT' and may slice."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "ultra"
    (d / "data").mkdir(parents=True)
    for split in ("train", "test"):
        write_jsonl(
            d / "data" / f"{split}.jsonl", [{**OPENAI, "id": f"{split}{i}"} for i in range(3)]
        )
    convs, _ = load_sources([f"{d}:test[:2]@2"])
    assert [c.id for c in convs] == ["test0", "test0", "test1", "test1"]
    assert convs[0].messages == OPENAI["messages"] and convs[0].source == f"{d}:test[:2]"
    with pytest.raises(DataError, match=r"has the splits test, train; name one"):
        load_sources([str(d)])
    with pytest.raises(UserError, match="outside the allowed data roots"):
        load_sources([f"{d}:train"], roots=[str(tmp_path / "elsewhere")])


# ------------------------------------------------------------------------------------ tool use


def test_tool_turns_openai_and_sharegpt(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    openai = {
        "messages": [
            {"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"},
            {"role": "assistant", "content": "5"},
        ]
    }
    only_call = {"messages": [openai["messages"][0], {"role": "assistant", "tool_calls": [call]}]}
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "function_call", "value": '[{"name": "f", "arguments": {"x": 1}}]'},
            {"from": "observation", "value": "r"},
            {"from": "tool", "value": "r2"},
            {"from": "gpt", "value": "a"},
        ]
    }
    convs, rep = load_sources(
        [str(write_jsonl(tmp_path / "t.jsonl", [openai, only_call, sharegpt]))]
    )
    assert rep.sources[0].dropped_empty == 0  # a tool call alone is something to learn
    assert convs[0].messages == [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"},
        {"role": "assistant", "content": "5"},
    ]
    assert convs[1].messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert [m["role"] for m in convs[2].messages] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    assert convs[2].messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    ]


def test_tool_fields_from_arrow_rows_and_bad_tool_turns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet gives every message every field (None where a record had none)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q", "tool_call_id": None},
                {"role": "tool", "content": "r", "tool_call_id": "c1"},
                {"role": "assistant", "content": "a", "tool_call_id": None},
            ]
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    convs, _ = load_sources([str(tmp_path / "p.parquet")])
    assert convs[0].messages == [
        {"role": "user", "content": "q"},
        {"role": "tool", "content": "r", "tool_call_id": "c1"},
        {"role": "assistant", "content": "a"},
    ]
    bad = [
        (
            {"from": "function_call", "value": "add(2, 3)"},
            r"conversations\[1\]\.value.*JSON object",
        ),
        ({"from": "function_call", "value": '{"arguments": 1}'}, r"conversations\[1\]\.value"),
    ]
    for turn, field in bad:
        rec = {"conversations": [{"from": "human", "value": "q"}, turn]}
        with pytest.raises(DataError, match=rf"line 1: field '{field}"):
            load_sources([str(write_jsonl(tmp_path / "b.jsonl", [rec]))])
    rec = {"messages": [{"role": "assistant", "content": "a", "tool_calls": "add"}]}
    with pytest.raises(DataError, match=r"messages\[0\]\.tool_calls': expected a list"):
        load_sources([str(write_jsonl(tmp_path / "c.jsonl", [rec]))])
    rec = {"messages": [{"role": "user"}]}  # content may be left out only beside tool calls
    with pytest.raises(DataError, match=r"messages\[0\]\.content': missing"):
        load_sources([str(write_jsonl(tmp_path / "d.jsonl", [rec]))])
