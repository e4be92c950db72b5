"""Pipeline throughput on the embedded target, as ratios measured side by side in one run.

Rates are steady tokens/s: from the end of the first optimizer step to the end of the last, the
rate a long run converges to, for every schedule and for the plain loop alike (a 12-step run's
pipeline fill and the batches its target ran ahead at the end are ~15% of its time; the
pipelined / sequential row is also given with them in, tokens / TrainResult.train_s).

Rows (each a median over paired repeats, runs interleaved so machine noise hits all alike):
  pipelined / fixed split       core sharing (pipeline.share_cores, pipeline/cores.py) against
                                the fixed target_thread_share split, at the preset's shape and
                                at a drafter-bound one (objective.loss_slots=0: the LM head on
                                every slot), where the target waits on a full queue
  pipelined / sequential        our two schedules, same step functions, same batches
  pipelined / colocated loop    a plain loop written the way existing DFlash trainers are:
                                HF forward with output_hidden_states, then the drafter step,
                                `.item()` logging every step, batches built inline
  observability on / off        the full monitor + sinks + metrics ring vs none of it
  pipelined / stage bound       achieved vs min(isolated target rate, isolated drafter rate),
                                each stage measured alone with the threads it gets in the pipeline
  schedule bound                the most any pipeline can gain over the sequential schedule on
                                these cores: the stages alone, perfectly balanced on their
                                pipelined threads, vs the stages alone on every core in turn
                                (`--bound` repeats only this)

Run: .venv/bin/python bench/bench_pipeline.py [--quick] [--json OUT]
Needs the embedded target (`make setup`); the data are random token sequences of realistic
lengths (throughput does not depend on the token values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.data.batching import plan_epoch
from dflash_trainer.data.chat import TokenizedDataset
from dflash_trainer.models.target import TargetModel
from dflash_trainer.pipeline.cores import usable_cpus
from dflash_trainer.pipeline.prefetcher import build_batch
from dflash_trainer.precision import cpu_kind, use_autocast
from dflash_trainer.run import train
from dflash_trainer.run.build import build_drafter, build_objective, thread_split
from dflash_trainer.train.optim import GuardedStep, build_optimizer, build_scheduler


def _padding_mask(ds, b):
    """[B, S] long, 1 = real token: the rows' lengths against the padded length."""
    lens = torch.as_tensor(ds.lengths[b.sample_ids.numpy()])
    return (torch.arange(b.input_ids.shape[1])[None] < lens[:, None]).long()


def synthetic_dataset(n: int, vocab: int, seed: int = 0) -> TokenizedDataset:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(220), 0.5, n), 48, 512).astype(int)
    ids, masks = [], []
    for L in lengths:
        prompt = max(8, int(L * 0.3))
        ids.append(rng.integers(3, vocab, L).astype(np.int32))
        m = np.zeros(L, np.uint8)
        m[prompt:] = 1
        masks.append(m)
    return TokenizedDataset(ids, masks, [f"b{i}" for i in range(n)])


def make_cfg(run_dir: str, steps: int, schedule: str, extra=()):
    return load_config(
        "smollm2-cpu",
        None,
        [
            f"--run_dir={run_dir}",
            f"--optim.max_steps={steps}",
            "--optim.epochs=50",
            f"--pipeline.schedule={schedule}",
            "--metrics.wandb=off",
            "--metrics.console=false",
            "--metrics.tensorboard=false",
            "--checkpoint.keep_last=1",
            # A few dozen steps cannot finish the sharing trial (pipeline/cores.py): the rows
            # measure sharing itself against the fixed split, what the trial chooses between.
            "--pipeline.share_trial_windows=0",
            *extra,
        ],
    )


def _autocast(cfg):
    """The drafter's compute precision as the trainer applies it (bf16 autocast in the preset)."""
    return torch.autocast(
        "cpu", dtype=torch.bfloat16, enabled=use_autocast(cfg.pipeline.precision, "cpu")
    )


CPU_S: list[float] = []  # process CPU seconds / wall seconds of each run_ours call
WHOLE: list[float] = []  # tokens / train_s of each run_ours call: pipeline fill and drain in


def run_ours(target, ds, steps, schedule, observe=True, extra=()) -> float:
    """Steady tokens/s: from the end of the first optimizer step to the end of the last
    (TrainResult.steady_tok_s), the rate a long run converges to; the plain loop and the
    isolated stages are timed the same way (their first step outside the clock)."""
    with tempfile.TemporaryDirectory() as d:
        cfg = make_cfg(d, steps, schedule, extra)
        c0 = time.process_time()
        r = train(cfg, target=target, train_set=ds, observe=observe)
        CPU_S.append((time.process_time() - c0) / r.wall_s)
        WHOLE.append(r.tokens / r.train_s)
        return r.steady_tok_s


def run_colocated(target, ds, steps) -> float:
    """The baseline loop: what a user would write without a pipeline."""
    with tempfile.TemporaryDirectory() as d:
        cfg = make_cfg(d, steps, "sequential")
        torch.set_num_threads(cfg.pipeline.cpu_threads or usable_cpus())
        drafter = build_drafter(cfg, target, "cpu")
        obj = build_objective(cfg, drafter)  # the same objective as ours (loss_slots included)
        opt = build_optimizer(drafter.parameters(), cfg.optim)
        sched = build_scheduler(opt, cfg.optim, steps)
        gen = torch.Generator().manual_seed(0)
        plan = plan_epoch(ds.lengths, cfg.batching, 0)
        tokens, t0 = 0, 0.0
        for i in range(steps):
            b = build_batch(ds, plan[i % len(plan)], cfg.batching.pad_multiple, 0)
            with torch.no_grad():
                out = target.model(
                    input_ids=b.input_ids,
                    attention_mask=_padding_mask(ds, b),
                    output_hidden_states=True,
                )
                feats = torch.cat([out.hidden_states[j + 1] for j in target.layer_ids], -1)
            with _autocast(cfg):
                res = obj(
                    drafter,
                    target.embed_weight,
                    target.lm_head,
                    feats,
                    b.input_ids,
                    b.loss_mask,
                    gen,
                )
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            print(f"\r  colocated step {i} loss {res.loss.item():.3f}", end="", file=sys.stderr)
            if i == 0:  # timed like ours: from the end of the first step to the end of the last
                t0 = time.perf_counter()
            else:
                tokens += b.num_real_tokens
        print(file=sys.stderr)
        return tokens / (time.perf_counter() - t0)


def isolated_rates(target, ds, steps, schedule="pipelined") -> tuple[float, float]:
    """Each stage alone, with the threads it gets in `schedule`: its share of the cores when
    pipelined, every core when sequential."""
    with tempfile.TemporaryDirectory() as d:
        cfg = make_cfg(d, steps, schedule)
    t_thr, d_thr = thread_split(cfg)
    plan = plan_epoch(ds.lengths, cfg.batching, 0)
    batches = [
        build_batch(ds, plan[i % len(plan)], cfg.batching.pad_multiple, 0) for i in range(steps)
    ]
    torch.set_num_threads(t_thr)
    target.features(batches[0].input_ids, _padding_mask(ds, batches[0]))  # warm-up
    t0 = time.perf_counter()
    feats = [target.features(b.input_ids, _padding_mask(ds, b)) for b in batches]
    t_rate = sum(b.num_real_tokens for b in batches) / (time.perf_counter() - t0)
    torch.set_num_threads(d_thr)
    drafter = build_drafter(cfg, target, "cpu")
    obj = build_objective(cfg, drafter)
    opt = build_optimizer(drafter.parameters(), cfg.optim)
    guard = GuardedStep(opt, drafter.parameters(), 1.0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)

    def dstep(b, f):
        with _autocast(cfg):
            res = obj(
                drafter, target.embed_weight, target.lm_head, f, b.input_ids, b.loss_mask, gen
            )
        res.loss.backward()
        guard(res.loss)

    dstep(batches[0], feats[0])
    t0 = time.perf_counter()
    for b, f in zip(batches, feats):
        dstep(b, f)
    d_rate = sum(b.num_real_tokens for b in batches) / (time.perf_counter() - t0)
    torch.set_num_threads(usable_cpus())
    return t_rate, d_rate


def schedule_bound(target, ds, steps: int) -> dict:
    """The most any pipeline can gain over the sequential schedule on these cores, from the
    stages timed alone. With every core busy and the work perfectly balanced, a pipeline spends
    the isolated stages' thread-seconds per token at their pipelined thread counts; the
    sequential schedule spends the isolated stages' wall seconds per token on every core. Their
    ratio is how much an op loses by running on all cores instead of its share (on 2 cores: how
    far one op on two threads is from twice its one-thread speed)."""
    with tempfile.TemporaryDirectory() as d:
        split = thread_split(make_cfg(d, steps, "pipelined"))
    tp, dp = isolated_rates(target, ds, steps, "pipelined")
    ts, dsq = isolated_rates(target, ds, steps, "sequential")
    balanced = sum(split) / (split[0] / tp + split[1] / dp)
    sequential = 1 / (1 / ts + 1 / dsq)
    return {
        "pipelined_threads": list(split),
        "target_tok_s": {"pipelined_threads": tp, "all_threads": ts},
        "drafter_tok_s": {"pipelined_threads": dp, "all_threads": dsq},
        "balanced_pipeline_tok_s": balanced,
        "sequential_tok_s": sequential,
        "bound": balanced / sequential,
    }


def bound_only(steps: int, repeats: int) -> None:
    """schedule_bound alone, repeated (each repeat times both stages at both thread counts)."""
    cfg = load_config("smollm2-cpu")
    target = TargetModel.load(cfg.target, "cpu")
    ds = synthetic_dataset(400, target.vocab_size)
    bounds = []
    for r in range(repeats):
        b = schedule_bound(target, ds, steps)
        bounds.append(b["bound"])
        print(f"bound repeat {r}: {json.dumps(b)}", file=sys.stderr)
    print(
        f"balanced pipeline / sequential, stages alone: {statistics.median(bounds):.3f} "
        f"({min(bounds):.3f}-{max(bounds):.3f}), threads {b['pipelined_threads']}, {cpu_kind()}"
    )


def overhead_only(steps: int, repeats: int) -> None:
    """Observability on vs off, paired and alternating (on, off, off, on, ...) so drift cancels."""
    cfg = load_config("smollm2-cpu")
    target = TargetModel.load(cfg.target, "cpu")
    ds = synthetic_dataset(400, target.vocab_size)
    run_ours(target, ds, 2, "pipelined")
    on, off = [], []
    for r in range(repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for observe in order:
            (on if observe else off).append(
                run_ours(target, ds, steps, "pipelined", observe=observe)
            )
        print(f"repeat {r}: on {on[-1]:.0f} tok/s, off {off[-1]:.0f} tok/s", file=sys.stderr)
    rs = [a / b for a, b in zip(on, off)]
    result = {
        "observability_on_vs_off": {
            "median": statistics.median(rs),
            "min": min(rs),
            "max": max(rs),
        },
        "steps_per_run": steps,
        "repeats": repeats,
        "tokens_per_s": {"on": statistics.median(on), "off": statistics.median(off)},
    }
    print(f"observability on / off: {statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})")
    print(json.dumps(result))


def sharing_only(steps: int, repeats: int) -> None:
    """Core sharing as shipped against the fixed split, at the preset's shape: sharing itself
    (trial off), the fixed split, and the default policy (the trial decides, then the rest of
    the run keeps its verdict), in alternating triples of `steps`-step runs."""
    cfg = load_config("smollm2-cpu")
    target = TargetModel.load(cfg.target, "cpu")
    ds = synthetic_dataset(400, target.vocab_size)
    run_ours(target, ds, 2, "pipelined")  # warm-up
    modes = {
        "shared": [],
        "fixed": ["--pipeline.share_cores=false"],
        "trial": ["--pipeline.share_trial_windows=3"],  # the default, after make_cfg's 0
    }
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats):
        for m, extra in modes.items():
            rates[m].append(run_ours(target, ds, steps, "pipelined", extra=extra))
        print(f"repeat {r}: " + ", ".join(f"{m} {v[-1]:.0f}" for m, v in rates.items()))
    for m in ("shared", "trial"):
        rs = [a / b for a, b in zip(rates[m], rates["fixed"])]
        print(
            f"{m} / fixed split: {statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f}), "
            f"{steps} steps x {repeats} repeats, {cpu_kind()}"
        )
    print(json.dumps({"steps": steps, "repeats": repeats, "tok_s": rates, "cpu": cpu_kind()}))


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--overhead",
        action="store_true",
        help="only observability on vs off, longer runs, more repeats",
    )
    ap.add_argument(
        "--bound",
        action="store_true",
        help="only the schedule bound (stages alone at their pipelined and at all threads)",
    )
    ap.add_argument(
        "--sharing",
        action="store_true",
        help="only core sharing (itself and as the trial decides) vs the fixed split, long runs",
    )
    return ap.parse_args()


SCHEDULES = (
    "pipelined", "fixed_split", "sequential", "colocated", "obs_off", "heavy_shared", "heavy_fixed"
)  # fmt: skip


def _repeats(target, ds, steps: int, repeats: int):
    """Every schedule's tokens/s per repeat, interleaved so machine drift hits all; process CPU
    over wall of the pipelined runs; pipelined over sequential whole-run (fill and drain in)."""
    rows: dict[str, list[float]] = {k: [] for k in SCHEDULES}
    fixed = ["--pipeline.share_cores=false"]
    heavy = ["--objective.loss_slots=0"]  # the LM head on every slot: the drafter is the bound
    cpu_wall, whole = [], []
    for r in range(repeats):
        rows["pipelined"].append(run_ours(target, ds, steps, "pipelined"))
        cpu_wall.append(CPU_S[-1])
        pipelined_whole = WHOLE[-1]
        rows["fixed_split"].append(run_ours(target, ds, steps, "pipelined", extra=fixed))
        rows["sequential"].append(run_ours(target, ds, steps, "sequential"))
        whole.append(pipelined_whole / WHOLE[-1])
        rows["colocated"].append(run_colocated(target, ds, steps))
        rows["obs_off"].append(run_ours(target, ds, steps, "pipelined", observe=False))
        rows["heavy_shared"].append(run_ours(target, ds, steps, "pipelined", extra=heavy))
        rows["heavy_fixed"].append(run_ours(target, ds, steps, "pipelined", extra=heavy + fixed))
        print(
            f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in rows.items()),
            file=sys.stderr,
        )
    return rows, cpu_wall, whole


def _spread(rs: list[float]) -> dict:
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}


def _result(rows, cpu_wall, whole, sb: dict, steps: int, repeats: int) -> dict:
    t_rate = sb["target_tok_s"]["pipelined_threads"]
    d_rate = sb["drafter_tok_s"]["pipelined_threads"]

    def ratio(a, b):
        return _spread([x / y for x, y in zip(rows[a], rows[b])])

    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "machine": f"{cpu_kind()}, {usable_cpus()} CPU threads, torch {torch.__version__}",
        "tokens_per_s": med,
        "pipelined_vs_fixed_split": ratio("pipelined", "fixed_split"),
        "drafter_bound_shared_vs_fixed": ratio("heavy_shared", "heavy_fixed"),
        "process_cpu_over_wall": statistics.median(cpu_wall),
        "pipelined_vs_sequential": ratio("pipelined", "sequential"),
        "pipelined_vs_sequential_fill_and_drain_in": _spread(whole),
        "pipelined_vs_colocated": ratio("pipelined", "colocated"),
        "observability_on_vs_off": ratio("pipelined", "obs_off"),
        "isolated_target_tok_s": t_rate,
        "isolated_drafter_tok_s": d_rate,
        "pipelined_vs_stage_bound": med["pipelined"] / min(t_rate, d_rate),
        "schedule_bound": sb,
        "steps_per_run": steps,
        "repeats": repeats,
    }


def _print_table(result: dict) -> None:
    sb = result["schedule_bound"]
    print("\n| comparison | ratio (median, min-max) |\n|---|---|")
    for k in (
        "pipelined_vs_fixed_split",
        "drafter_bound_shared_vs_fixed",
        "pipelined_vs_sequential",
        "pipelined_vs_sequential_fill_and_drain_in",
        "pipelined_vs_colocated",
        "observability_on_vs_off",
    ):
        v = result[k]
        print(f"| {k} | {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f}) |")
    print(f"| process CPU time / wall, pipelined | {result['process_cpu_over_wall']:.2f} |")
    print(
        f"| pipelined_vs_stage_bound | {result['pipelined_vs_stage_bound']:.3f} "
        f"(target alone {result['isolated_target_tok_s']:.0f} tok/s, drafter alone "
        f"{result['isolated_drafter_tok_s']:.0f} tok/s) |"
    )
    print(
        f"| most any pipeline gains over sequential here (stages alone, balanced) | "
        f"{sb['bound']:.3f} ({sb['balanced_pipeline_tok_s']:.0f} vs {sb['sequential_tok_s']:.0f} "
        f"tok/s) |"
    )


def main() -> None:
    args = _args()
    steps, repeats = (6, 1) if args.quick else (12, 3)
    if args.sharing:
        return sharing_only(steps=80, repeats=3)
    if args.overhead:
        return overhead_only(steps=20, repeats=4)
    if args.bound:
        return bound_only(steps=16, repeats=4)
    cfg = load_config("smollm2-cpu")
    target = TargetModel.load(cfg.target, "cpu")
    ds = synthetic_dataset(400, target.vocab_size)
    # Warm-up (allocator, kernels) outside the measurement.
    run_ours(target, ds, 2, "pipelined")
    rows, cpu_wall, whole = _repeats(target, ds, steps, repeats)
    sb = schedule_bound(target, ds, steps)
    result = _result(rows, cpu_wall, whole, sb, steps, repeats)
    _print_table(result)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--quick"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    out = []
    steady, whole = "training throughput (steady tokens/s)", "training throughput (tokens/s)"
    for key, work, a, b in (
        ("pipelined_vs_fixed_split", steady, "shared cores", "fixed 50/50 split"),
        ("drafter_bound_shared_vs_fixed", steady, "shared cores, drafter-bound", "fixed split"),
        ("pipelined_vs_sequential", steady, "pipelined", "sequential"),
        (
            "pipelined_vs_sequential_fill_and_drain_in",
            whole,
            "pipelined, fill and drain in",
            "sequential",
        ),
        ("pipelined_vs_colocated", steady, "pipelined", "plain colocated loop"),
        ("observability_on_vs_off", steady, "observability on", "off"),
    ):
        v = s.get(key)
        if v is not None:  # results of an older bench_pipeline lack the newer rows
            out.append(bench_harness.row(work, a, b, v["median"], v["min"], v["max"]))
    if "process_cpu_over_wall" in s:
        out.append(
            bench_harness.row(
                "training, pipelined",
                "process CPU time",
                "wall time",
                s["process_cpu_over_wall"],
                note="cores kept busy",
            )
        )
    out.append(
        bench_harness.row(
            "training throughput",
            "pipelined",
            "bound of isolated stages",
            s["pipelined_vs_stage_bound"],
            note=f"target alone {s['isolated_target_tok_s']:.0f} tok/s, drafter alone "
            f"{s['isolated_drafter_tok_s']:.0f} tok/s",
        )
    )
    sb = s.get("schedule_bound")
    if sb is not None:  # older results lack it
        out.append(
            bench_harness.row(
                "training throughput, stages alone",
                "balanced pipeline",
                "sequential",
                sb["bound"],
                note="the most any pipeline can gain over sequential on these cores: "
                f"{sb['balanced_pipeline_tok_s']:.0f} vs {sb['sequential_tok_s']:.0f} tok/s",
            )
        )
    return out


if __name__ == "__main__":
    main()
