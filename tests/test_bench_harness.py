"""`dflash-trainer bench`: the scripts it runs carry their own arguments and row adapters
(bench/), and the harness runs each, turning its last stdout line into table rows."""

from pathlib import Path

from dflash_trainer import bench_harness
from dflash_trainer.bench_harness import SCRIPTS, find_bench_dir, load_script, run_all

REPO = Path(__file__).resolve().parents[1]


def test_every_bench_script_has_its_arguments_and_adapter():
    bdir = find_bench_dir(REPO)
    for script in SCRIPTS:
        module = load_script(bdir / script)
        assert set(module.BENCH_ARGS) == {"full", "quick"}, script
        assert callable(module.bench_rows), script


def test_run_all_runs_a_script_and_adapts_its_summary(tmp_path, monkeypatch):
    (tmp_path / "bench_fake.py").write_text(
        "import json, sys\n"
        "from dflash_trainer import bench_harness\n"
        'BENCH_ARGS = {"full": ["2.0"], "quick": ["1.5"]}\n'
        "def bench_rows(s):\n"
        '    return [bench_harness.row("fake work", "a", "b", s["ratio"])]\n'
        'if __name__ == "__main__":\n'
        '    print("noise")\n'
        '    print(json.dumps({"ratio": float(sys.argv[1])}))\n'
    )
    (tmp_path / "bench_broken.py").write_text(
        'BENCH_ARGS = {"full": [], "quick": []}\n'
        "def bench_rows(s):\n"
        "    return []\n"
        'if __name__ == "__main__":\n'
        "    raise SystemExit(3)\n"
    )
    monkeypatch.setattr(bench_harness, "SCRIPTS", ["bench_fake.py", "bench_broken.py"])
    monkeypatch.setenv("PYTHONPATH", str(REPO / "src"))
    rows = run_all(tmp_path, quick=True)
    assert [(r["script"], r["work"], r["ratio"]) for r in rows[:1]] == [
        ("bench_fake.py", "fake work", 1.5)
    ]
    assert rows[1]["script"] == "bench_broken.py" and "FAILED rc=3" in rows[1]["note"]
    assert run_all(tmp_path, only=["bench_fake.py"])[0]["ratio"] == 2.0


def test_compare_drafter_steps_runs_each_way_on_the_same_batches():
    """The demo-step A/B of bench_read_slots and bench_frozen_head: two equal ways on the same
    seeded drafter, batches and anchors give equal losses and gradients; each way's `before`
    runs before every step, warm-up included."""
    import torch

    from dflash_trainer.bench_harness import DEMO_BLOCK, DEMO_HIDDEN, DEMO_VOCAB, StepWay
    from dflash_trainer.train.objective import DFlashObjective

    torch.manual_seed(0)
    embed = torch.randn(DEMO_VOCAB, DEMO_HIDDEN)
    head = torch.nn.Linear(DEMO_HIDDEN, DEMO_VOCAB, bias=False).requires_grad_(False)
    calls: list[str] = []
    ways = {
        w: StepWay(
            DFlashObjective(DEMO_BLOCK, 4, mask_token_id=0, loss_slots=2),
            before=lambda w=w: calls.append(w),
        )
        for w in ("a", "b")
    }
    c = bench_harness.compare_drafter_steps(ways, embed, head, steps=1)
    assert calls == ["a", "b"] * 3  # two warm-up steps and the measured one, interleaved
    assert c.worst_loss == 0.0 and c.worst_grad == 0.0
    assert set(c.ms) == {"a", "b"} and all(v > 0 for v in c.ms.values())
