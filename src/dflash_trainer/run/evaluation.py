"""Evaluation during and at the end of training: measured tau, tau_sim, best-drafter export.

The held-out side of the data (data/prepare.py) has two roles:
- validation: a small stratified subset. Periodic evaluation (every eval.every_steps) decodes a
  fixed, seeded, stratified subset of it (eval.periodic_prompts, chosen once and named in the log),
  and the best drafter by that tau is exported to `{run_dir}/best`;
- report: everything else. At the end of a run (eval.at_end) every report prompt is decoded:
  tau per source and overall (`eval/tau`, `eval/tau/<source>`). It never selects anything.

Both decode in eval.dtype (precision.eval_dtype; cast copies, the training drafter is untouched) and
log `eval/tau_sim` and `eval/tau_sim/<source>` (eval/tau_sim.py) beside the measured tau, with
the gap. Only the end-of-run evaluation draws progress bars (metrics.console): the periodic one
runs between training steps, under the training bar.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.prepare import REPORT, VALIDATION, split_roles, stratified_pick
from dflash_trainer.eval.engines import EvalRun, ProjectLoop, comparison_engines
from dflash_trainer.eval.metrics import EvalSummary, format_table, summarize, tau_by_context
from dflash_trainer.eval.tau_sim import TauSim, mean_tau
from dflash_trainer.files import replace_dir
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.export import export_drafter, export_dtype, load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import dtype_label, eval_dtype, frozen_in

log = logging.getLogger(__name__)


@dataclass
class HeldoutPrompt:
    id: str
    source: str
    role: str  # validation / report
    prompt: list[int]  # token ids before the first supervised token
    ids: list[int]  # the whole sequence (prompt + the target's response)


def heldout_examples(heldout, cfg: Config) -> list[HeldoutPrompt]:
    """The held-out examples with their source and role. A dataset without roles (built by
    hand, e.g. in tests) is split into validation/report here the way data/prepare.py does."""
    if heldout is None or len(heldout) == 0:
        return []
    sources = heldout.sources or ["data"] * len(heldout)
    roles = heldout.roles or split_roles(heldout.ids, sources, cfg.eval, cfg.seed)
    out = []
    for cid, src, role, ids, mask in zip(
        heldout.ids, sources, roles, heldout.input_ids, heldout.loss_mask
    ):
        first = int(mask.argmax()) if mask.any() else 0
        if first > 0:
            out.append(HeldoutPrompt(cid, src, role, ids[:first].tolist(), ids.tolist()))
    return out


def periodic_subset(examples: list[HeldoutPrompt], n: int, seed: int) -> list[HeldoutPrompt]:
    """A fixed, seeded subset of `n` validation prompts stratified by source (all when fewer)."""
    if len(examples) <= n:
        return list(examples)
    strata = defaultdict(list)
    for e in examples:
        strata[e.source].append(e.id)
    keep = stratified_pick(strata, 0.0, seed, 0x9E41, count=n, subset=True)
    return [e for e in examples if e.id in keep]


class PeriodicEval:
    """Acceptance length on held-out prompts during training (drafter thread, between steps)
    and at the end of the run.

    It borrows the target under `lock` (the target worker takes the same lock per batch), so the
    pipeline stalls for no longer than the evaluation itself.
    """

    def __init__(self, cfg: Config, target, drafter, heldout, run_dir: Path, lock):
        self.cfg, self.target, self.drafter = cfg, target, drafter
        self.run_dir, self.lock = run_dir, lock
        ex = heldout_examples(heldout, cfg)
        self.validation = [e for e in ex if e.role == VALIDATION]
        self.report = [e for e in ex if e.role == REPORT]
        self.periodic = periodic_subset(self.validation, cfg.eval.periodic_prompts, cfg.seed)
        self.prompts = [e.prompt for e in self.periodic]
        self.best = float("-inf")
        self.last_step = -1
        self.final_run: EvalRun | None = None  # the end-of-run evaluation (the parity gate's)
        self.dtype = eval_dtype(cfg.eval.dtype, target.device, target.dtype) if ex else None
        # the target in eval.dtype (a cast copy when it differs), lazily
        self._target: TargetModel | None = None
        self._sim: TauSim | None = None
        if cfg.eval.every_steps and self.periodic:
            log.info(
                "periodic evaluation: %d validation prompts (of %d; seed %d, stratified by "
                "source): %s",
                len(self.periodic),
                len(self.validation),
                cfg.seed,
                ", ".join(e.id for e in self.periodic),
            )
        elif cfg.eval.every_steps:
            log.warning("periodic evaluation: no validation prompts; best/ is not exported")

    @property
    def block_size(self) -> int:
        return self.cfg.eval.block_size or self.cfg.drafter.block_size

    @property
    def decode_dtype(self) -> torch.dtype:
        """eval.dtype resolved (there are held-out prompts: else nothing is evaluated)."""
        assert self.dtype is not None, "no held-out prompts: nothing to evaluate"
        return self.dtype

    @property
    def dtype_name(self) -> str:
        """eval.dtype resolved, by name ("float32")."""
        return dtype_label(self.decode_dtype)

    def eval_target(self) -> Any:
        """The target in eval.dtype (a cast copy where training uses another dtype), made once;
        what every evaluation of this run decodes with (and the parity gate)."""
        if self._target is None:
            target = self.target.cast(self.decode_dtype)
            self._sim = TauSim(
                target,
                [(e.id, e.ids, len(e.prompt)) for e in self.validation + self.report],
                self.cfg.eval.sampling,
                packed=self.cfg.target.packed_linear,
            )
            self._target = target
        return self._target

    def exported_drafter(self, export_dir: Path) -> Any:
        """The export as written (its stored dtype), cast to eval.dtype like every evaluation:
        what the reference loop and vLLM load too."""
        device = next(self.target.model.parameters()).device
        return frozen_in(load_drafter(export_dir, device), self.decode_dtype)

    def _measure(
        self,
        examples: list[HeldoutPrompt],
        progress: bool,
        decoded: list[HeldoutPrompt] | None = None,
        export_dir: Path | None = None,
    ) -> EvalRun:
        """The one evaluation of held-out prompts: the `decoded` ones (default all `examples`)
        decoded by the project's loop, per source; tau_sim replayed on every one of `examples`
        (eval.tau_sim). With `export_dir` (the end of the run) the export is decoded, and the
        baseline and the compared engines (eval.at_end_baseline, eval.compare,
        eval.at_end_adaptive) run too."""
        e = self.cfg.eval
        decoded = examples if decoded is None else decoded
        target = self.eval_target()
        final = export_dir is not None
        drafter = (
            self.exported_drafter(export_dir)
            if export_dir is not None
            else frozen_in(self.drafter, self.decode_dtype)
        )
        loop = ProjectLoop(
            target,
            drafter,
            baseline=final and e.at_end_baseline,
            progress=progress,
            packed=self.cfg.target.packed_linear,
            options=self._sampled(),
        )
        s = loop.decode([x.prompt for x in decoded], e.max_new_tokens, self.block_size)
        run = EvalRun(groups=_by_source(decoded, s), overall=s)
        if export_dir is not None:
            self._compare(run, drafter, export_dir, progress)
        if e.tau_sim and self._sim is not None:
            self._simulate(run, drafter, examples, decoded, progress)
        return run

    def _sampled(self) -> dict[str, Any]:
        """The project loop's eval.sampling and eval.seed: measured tau and tau_sim (which reads
        the same eval.sampling) follow one rule, the one the `eval` command decodes by."""
        return {"sampling": self.cfg.eval.sampling, "seed": self.cfg.eval.seed}

    def _compare(self, run: EvalRun, drafter: Any, export_dir: Path, progress: bool) -> None:
        """The end of the run: eval.compare's engines on every group, and the project loop with
        adaptive verify on eval.at_end_adaptive's sources."""
        e, target = self.cfg.eval, self.eval_target()
        if e.compare:
            engines = comparison_engines(self.cfg, target, export_dir, e.compare)
            run.compare(engines, e.max_new_tokens, self.block_size)
        if e.at_end_adaptive:
            adaptive = ProjectLoop(
                target,
                drafter,
                progress=progress,
                packed=self.cfg.target.packed_linear,
                options={"verify": "adaptive", **self._sampled()},
                name="adaptive",
            )
            run.compare([adaptive], e.max_new_tokens, self.block_size, e.at_end_adaptive)

    def _simulate(
        self,
        run: EvalRun,
        drafter: Any,
        examples: list[HeldoutPrompt],
        decoded: list[HeldoutPrompt],
        progress: bool,
    ) -> None:
        """tau_sim replayed on every one of `examples`: overall, per source, and its gap to the
        measured tau on the `decoded` ones."""
        e = self.cfg.eval
        assert self._sim is not None
        ids = [x.id for x in examples]
        sim = self._sim.run(drafter, e.max_new_tokens, self.block_size, ids, progress)
        lens = dict(zip(sim.keys, sim.acceptance_lengths))
        advances = dict(zip(sim.keys, sim.committed))  # where each cycle starts (greedy replay)
        replayed = defaultdict(list)
        for x in examples:
            replayed[x.source].append(lens[x.id])
        run.sims = {"all": sim.tau}
        run.sims.update({src: mean_tau(ls) for src, ls in sorted(replayed.items())})
        run.sim_gap = mean_tau([lens[x.id] for x in decoded]) - run.overall.tau
        run.sim_prompts = len(examples)
        run.sim_ctx = tau_by_context(
            [lens[x.id] for x in examples],
            [len(x.prompt) for x in examples],
            [advances[x.id] for x in examples],
        )

    def _record(
        self,
        step: int,
        examples: list[HeldoutPrompt],
        which: str,
        progress: bool,
        decoded: list[HeldoutPrompt] | None = None,
        export_dir: Path | None = None,
    ) -> tuple[dict, EvalRun]:
        t0 = time.perf_counter()
        run = self._measure(examples, progress, decoded, export_dir)
        rec = run.events()
        rec.update(
            {
                "eval/prompts": run.overall.num_responses,
                "eval/set": which,
                "eval/dtype": self.dtype_name,
                "eval/step": step,
            }
        )
        if run.sims:
            rec["eval/tau_sim_prompts"] = run.sim_prompts
        rec["eval/seconds"] = time.perf_counter() - t0
        per = ", ".join(f"{g} {s.tau:.3f}" for g, s in run.groups.items())
        sim = run.sims.get("all", float("nan"))
        log.info(
            "eval at step %d on %d %s prompts (%s): tau %.3f (%s)%s, %.1f s",
            step,
            run.overall.num_responses,
            which,
            rec["eval/dtype"],
            run.overall.tau,
            per,
            f"; tau_sim {sim:.3f} (gap {run.sim_gap:+.3f})" if run.sims else "",
            rec["eval/seconds"],
        )
        return rec, run

    def run(self, step: int) -> dict | None:
        """Periodic: the fixed validation subset; exports best/ when its tau improves."""
        if not self.periodic or step == self.last_step:
            return None
        self.last_step = step
        with self.lock:  # no bar: this runs between training steps, under the training bar
            rec, _ = self._record(step, self.periodic, VALIDATION, progress=False)
        tau = rec["eval/tau"]
        if tau > self.best:
            self.best = tau
            tmp = self.run_dir / "best.tmp"
            export_drafter(self.drafter, tmp, export_dtype(self.cfg.checkpoint.export_dtype))
            (tmp / "eval.json").write_text(
                json.dumps({"step": step, "tau": tau, "prompt_set": VALIDATION})
            )
            replace_dir(tmp, RunLayout.of(self.run_dir).best)
            rec["eval/best_tau"] = self.best
        return rec

    def final(self, step: int, export_dir: Path | None = None) -> dict | None:
        """End of run: the reported held-out prompts (never used to select anything), those of
        eval.at_end_sources decoded ([] = all), tau_sim on every one. With `export_dir`, the
        export is what is decoded, beside the baseline and eval.compare's engines. Prints the
        table (metrics.console); returns the eval/* record every sink receives."""
        if not self.report:
            return None
        keep = set(self.cfg.eval.at_end_sources)
        decoded = [e for e in self.report if not keep or e.source in keep] or self.report
        console = self.cfg.metrics.console
        log.info(
            "held-out evaluation at step %d: %d prompts decoded (%s)%s",
            step,
            len(decoded),
            ", ".join(sorted({e.source for e in decoded})),
            f", tau_sim on {len(self.report)}" if self.cfg.eval.tau_sim else "",
        )
        with self.lock:
            rec, run = self._record(step, self.report, "heldout", console, decoded, export_dir)
        self.final_run = run
        if console:
            print(format_table(run.groups), flush=True)
        return rec

    def close(self) -> None:
        self._target = self._sim = None


def _by_source(examples: list[HeldoutPrompt], s: EvalSummary) -> dict[str, EvalSummary]:
    """`s` (one summary over `examples`, in order) split per source."""
    spec: dict[str, list] = defaultdict(list)
    ar: dict[str, list] = defaultdict(list)
    prompts: dict[str, list] = defaultdict(list)
    for i, x in enumerate(examples):
        spec[x.source].append(s.spec_results[i])
        prompts[x.source].append(x.prompt)
        if s.ar_results:
            ar[x.source].append(s.ar_results[i])
    out = {}
    for src in sorted(spec):
        part = summarize(spec[src], ar[src] or None, s.block_size)
        part.decode_dtype, part.prompts = s.decode_dtype, prompts[src]
        out[src] = part
    return out
