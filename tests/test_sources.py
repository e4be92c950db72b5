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
