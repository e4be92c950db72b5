"""`make bench` within its time budget (bench_plan.py): every script in full on a machine like the
reference, the long ones quick on one twice as slow, and the whole run inside the budget."""

import pytest

from dflash_trainer.bench_harness import SCRIPTS
from dflash_trainer.bench_plan import BenchPlan, reference


def _run(slowness: float, budget: float, quick: bool = False) -> tuple[dict[str, str], float]:
    """Every script through the plan on a machine `slowness` x the reference one."""
    now = [0.0]
    plan = BenchPlan(budget, quick=quick, clock=lambda: now[0])
    modes = {}
    for i, script in enumerate(SCRIPTS):
        mode = plan.mode(script, SCRIPTS[i + 1 :])
        took = slowness * reference(script)[0 if mode == "full" else 1]
        now[0] += took
        plan.done(script, mode, took)
        modes[script] = mode
    return modes, now[0]


def test_the_reference_machine_runs_everything_in_full_within_the_default_budget():
    full = sum(reference(s)[0] for s in SCRIPTS)
    assert full < 1080  # the table itself fits the default budget
    modes, took = _run(1.0, 1080)
    assert set(modes.values()) == {"full"} and took == pytest.approx(full)


def test_a_machine_twice_as_slow_runs_the_long_scripts_quick_and_stays_in_the_budget():
    modes, took = _run(2.0, 1080)
    quick = [s for s, m in modes.items() if m == "quick"]
    assert "bench_pipeline.py" in quick and modes["bench_batching.py"] == "full"
    assert took <= 1080, took
    # unplanned, the same machine would take twice the reference's full time
    assert 2 * sum(reference(s)[0] for s in SCRIPTS) > 1080


def test_quick_and_an_unlimited_budget_override_the_plan():
    modes, _ = _run(5.0, 1080, quick=True)
    assert set(modes.values()) == {"quick"}
    modes, took = _run(5.0, 0)
    assert set(modes.values()) == {"full"} and took > 1080


def test_every_script_has_reference_seconds():
    from dflash_trainer.bench_plan import REFERENCE_S

    assert set(REFERENCE_S) == set(SCRIPTS)
    assert all(quick <= full for full, quick in REFERENCE_S.values())


def test_the_bench_command_runs_a_script_quick_when_the_budget_says_so(tmp_path, monkeypatch):
    """`dflash-trainer bench` end to end on two fake scripts: the first runs far slower than its
    reference (a sleep and an interpreter start against 0.1 s), so the second, long in full,
    runs quick; its rows and results.md say so."""
    import json
    from pathlib import Path

    from dflash_trainer import bench_harness, bench_plan
    from dflash_trainer.commands import bench as bench_command
    from dflash_trainer.config import Config

    repo = Path(__file__).resolve().parents[1]
    bdir = tmp_path / "bench"
    bdir.mkdir()
    (bdir / "bench_pipeline.py").write_text("")  # what find_bench_dir looks for
    for name, seconds in (("bench_a.py", 0.3), ("bench_b.py", 0.0)):
        (bdir / name).write_text(
            "import json, sys, time\n"
            "from dflash_trainer import bench_harness\n"
            'BENCH_ARGS = {"full": ["full"], "quick": ["quick"]}\n'
            "def bench_rows(s):\n"
            '    return [bench_harness.row("work " + s["mode"], "a", "b", 1.0)]\n'
            'if __name__ == "__main__":\n'
            f"    time.sleep({seconds})\n"
            '    print(json.dumps({"mode": sys.argv[1]}))\n'
        )
    monkeypatch.setattr(bench_harness, "SCRIPTS", ["bench_a.py", "bench_b.py"])
    monkeypatch.setattr(bench_command, "SCRIPTS", ["bench_a.py", "bench_b.py"])
    refs = {"bench_a.py": (0.1, 0.1), "bench_b.py": (5.0, 0.01)}
    monkeypatch.setattr(bench_plan, "REFERENCE_S", refs)
    monkeypatch.setenv("PYTHONPATH", str(repo / "src"))
    monkeypatch.chdir(tmp_path)
    cfg = Config()
    cfg.bench.time_budget_s = 4.0  # 0.3 s + 3 x 5.0 s would not fit; 0.3 + 3 x 0.01 does
    assert bench_command.run(cfg, None) == 0
    rows = json.loads((bdir / "out" / "results.json").read_text())["rows"]
    assert [(r["script"], r["mode"], r["work"]) for r in rows] == [
        ("bench_a.py", "full", "work full"),
        ("bench_b.py", "quick", "work quick"),
    ]
    assert "quick (fewer repeats): bench_b.py" in (bdir / "out" / "results.md").read_text()
