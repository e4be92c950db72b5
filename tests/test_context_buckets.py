"""tau per context-length bucket (eval/metrics.py tau_by_context), against a hand count."""

import pytest

from dflash_trainer.decode.loop import GenResult
from dflash_trainer.eval.engines import EvalRun
from dflash_trainer.eval.metrics import context_bucket, summarize, tau_by_context


def test_bucket_names_and_edges():
    assert [context_bucket(n) for n in (0, 511, 512, 1023, 1024, 4095, 8191, 8192, 50_000)] == [
        "0-512", "0-512", "512-1K", "512-1K", "1K-2K", "2K-4K", "4K-8K", "8K+", "8K+",
    ]  # fmt: skip


def test_cycles_fall_in_the_bucket_of_the_context_they_start_after():
    # response A: prompt 500, cycles commit 5, 10, 3 -> contexts 500, 505, 515
    # response B: prompt 1020, cycles commit 2, 4 -> contexts 1020, 1022
    # response C: prompt 3000, no cycle (ended at the prefill token)
    out = tau_by_context([[5, 10, 3], [2, 4], []], [500, 1020, 3000])
    assert out == {"0-512": (7.5, 2), "512-1K": ((3 + 2 + 4) / 3, 3)}
    assert list(out) == ["0-512", "512-1K"]  # in order of length


def test_an_evaluation_reports_tau_per_bucket():
    r = GenResult([1] * 18, [5, 10, 3], [4, 9, 2], [16, 16, 16], decode_time=1.0)
    s = summarize([r], None, 16)
    s.prompts = [[0] * 500]
    run = EvalRun(groups={"g": s}, overall=s, sim_ctx={"1K-2K": (2.5, 4)})
    rec = run.events()
    assert rec["eval/tau_ctx/0-512"] == 7.5 and rec["eval/cycles_ctx/0-512"] == 2
    assert rec["eval/tau_ctx/512-1K"] == 3.0 and rec["eval/cycles_ctx/512-1K"] == 1
    assert rec["eval/tau_sim_ctx/1K-2K"] == 2.5 and rec["eval/sim_cycles_ctx/1K-2K"] == 4


def test_long_prompts_ask_each_question_after_the_other_conversations(tmp_path):
    """eval.datasets=long:N: each held-out question after ~N tokens (4 characters each) of the
    other held-out conversations, answers included, never its own; a bad size is refused."""
    import json

    from dflash_trainer.config import Config
    from dflash_trainer.errors import UserError
    from dflash_trainer.eval.prompts import load_prompt_set

    convs = [
        {"id": f"c{i}", "messages": [
            {"role": "user", "content": f"question {i} " + "x" * 50},
            {"role": "assistant", "content": f"answer {i} " + "y" * 80},
        ]}
        for i in range(3)
    ]  # fmt: skip
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = Config()
    cfg.eval.heldout_path = str(path)
    got = load_prompt_set("long:300", cfg)
    assert [cid for cid, _ in got] == ["long-c0", "long-c1", "long-c2"]
    for i, (_, (system, user)) in enumerate(got):
        question = convs[i]["messages"][0]["content"]
        assert system["role"] == "system" and user == {"role": "user", "content": question}
        assert len(system["content"]) >= 300 * 4
        assert f"question {i}" not in system["content"]
        assert f"answer {(i + 1) % 3}" in system["content"]
    with pytest.raises(UserError, match="long or long:N"):
        load_prompt_set("long:big", cfg)
