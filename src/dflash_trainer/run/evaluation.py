"""Evaluation during and at the end of training: measured tau, tau_sim, best-drafter export.

The held-out side of the data (data/prepare.py) has two roles:
- validation: a small stratified subset. Periodic evaluation (every eval.every_steps) decodes a
  fixed, seeded, stratified subset of it (eval.periodic_prompts, chosen once and named in the log),
  and the best drafter by that tau is exported to `{run_dir}/best`;
- report: everything else. At the end of a run (eval.at_end) every report prompt is decoded:
  tau per source and overall (`eval/tau`, `eval/tau/<source>`). It never selects anything.

Both decode in eval.dtype (eval/dtype.py: cast copies, the training drafter is not touched) and
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

from dflash_trainer.config import Config
from dflash_trainer.data.prepare import REPORT, VALIDATION, split_roles, stratified_pick
from dflash_trainer.eval.dtype import drafter_in, dtype_label, eval_dtype, target_in
from dflash_trainer.eval.metrics import summarize
from dflash_trainer.eval.specdecode import evaluate
from dflash_trainer.eval.tau_sim import TauSim, mean_tau
from dflash_trainer.files import replace_dir
from dflash_trainer.models.export import export_drafter, export_dtype

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
    keep = stratified_pick(strata, 0.0, seed, 0x9E41, count=n)
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
        self.dtype = eval_dtype(cfg.eval.dtype, target.device, target.dtype) if ex else None
        self._target = None  # the target in eval.dtype (a cast copy when it differs), lazily
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

    def _eval_target(self):
        if self._target is None:
            self._target = target_in(self.target, self.dtype)
            self._sim = TauSim(
                self._target, [(e.id, e.ids, len(e.prompt)) for e in self.validation + self.report]
            )
        return self._target

    def _measure(self, examples: list[HeldoutPrompt], progress: bool) -> tuple[dict, dict]:
        """(tau, tau_sim) of the current drafter on `examples`, each per source and overall
        ("all"); tau_sim is empty when eval.tau_sim is off. `progress`: bars over prompts."""
        e = self.cfg.eval
        target = self._eval_target()
        drafter = drafter_in(self.drafter, self.dtype)
        s = evaluate(
            target,
            drafter,
            [x.prompt for x in examples],
            e.max_new_tokens,
            self.block_size,
            baseline=False,
            warmup=False,
            progress=progress,
            packed=self.cfg.target.packed_linear,
        )
        by_source = defaultdict(list)
        for x, r in zip(examples, s.spec_results):
            by_source[x.source].append(r)
        taus = {"all": s.tau}
        taus.update(
            {src: summarize(rs, None, self.block_size).tau for src, rs in by_source.items()}
        )
        sims = {}
        if e.tau_sim:
            sim = self._sim.run(
                drafter,
                e.max_new_tokens,
                self.block_size,
                [x.id for x in examples],
                progress=progress,
            )
            source = {x.id: x.source for x in examples}
            replayed = defaultdict(list)
            for key, lens in zip(sim.keys, sim.acceptance_lengths):
                replayed[source[key]].append(lens)
            sims = {"all": sim.tau}
            sims.update({src: mean_tau(lens) for src, lens in replayed.items()})
        return taus, sims

    def _record(self, step: int, examples, which: str, t0: float, progress: bool) -> dict:
        taus, sims = self._measure(examples, progress)
        rec = {
            "eval/tau": float(taus["all"]),
            "eval/prompts": len(examples),
            "eval/set": which,
            "eval/dtype": dtype_label(self.dtype),
            "eval/step": step,
        }
        for src, t in sorted(taus.items()):
            if src != "all":
                rec[f"eval/tau/{src}"] = float(t)
        sim = sims.get("all", float("nan"))
        if self.cfg.eval.tau_sim:
            rec["eval/tau_sim"] = sim
            rec["eval/tau_sim_gap"] = sim - taus["all"]
            for src, t in sorted(sims.items()):
                if src != "all":
                    rec[f"eval/tau_sim/{src}"] = float(t)
        rec["eval/seconds"] = time.perf_counter() - t0
        per = ", ".join(f"{s} {t:.3f}" for s, t in sorted(taus.items()) if s != "all")
        log.info(
            "eval at step %d on %d %s prompts (%s): tau %.3f (%s)%s, %.1f s",
            step,
            len(examples),
            which,
            rec["eval/dtype"],
            taus["all"],
            per,
            f"; tau_sim {sim:.3f} (gap {sim - taus['all']:+.3f})" if self.cfg.eval.tau_sim else "",
            rec["eval/seconds"],
        )
        return rec

    def run(self, step: int) -> dict | None:
        """Periodic: the fixed validation subset; exports best/ when its tau improves."""
        if not self.periodic or step == self.last_step:
            return None
        self.last_step = step
        t0 = time.perf_counter()
        with self.lock:  # no bar: this runs between training steps, under the training bar
            rec = self._record(step, self.periodic, VALIDATION, t0, progress=False)
        tau = rec["eval/tau"]
        if tau > self.best:
            self.best = tau
            tmp = self.run_dir / "best.tmp"
            export_drafter(self.drafter, tmp, export_dtype(self.cfg.checkpoint.export_dtype))
            (tmp / "eval.json").write_text(
                json.dumps({"step": step, "tau": tau, "prompt_set": VALIDATION})
            )
            replace_dir(tmp, self.run_dir / "best")
            rec["eval/best_tau"] = self.best
        return rec

    def final(self, step: int) -> dict | None:
        """End of run: every reported held-out prompt (never used to select anything)."""
        if not self.report:
            return None
        t0 = time.perf_counter()
        with self.lock:
            rec = self._record(step, self.report, "heldout", t0, self.cfg.metrics.console)
        return rec

    def close(self) -> None:
        self._target = self._sim = None
