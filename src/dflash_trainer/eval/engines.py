"""Decoding engines behind one interface: given prompts, an `EvalSummary` of their decoding.

Every evaluation (the end of a run, the `eval` command, the demo, the parity gate) decodes through
a `DecodeEngine`; another engine plugs in as one more implementation and one more name in
`ENGINES`, with no branch in any caller:
- `project`: the project's loop (eval/evaluation.py `evaluate`), optionally with the plain greedy
  baseline of each prompt (speedup, losslessness);
- `reference`: the published reference loop (`dflash_generate`) on the export (eval/reference.py);
- `vllm`: the export served by vLLM as its DFlash drafter (eval/served.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash_trainer.config import Config
from dflash_trainer.errors import UserError
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.metrics import EvalSummary, summarize, tau_by_context
from dflash_trainer.eval.reference import ReferenceLoop
from dflash_trainer.eval.served import ServedLoop
from dflash_trainer.models.vllm_engine import engine_for_config
from dflash_trainer.precision import dtype_label

log = logging.getLogger(__name__)

# the engines an evaluation can compare against its own decoding (eval.compare)
ENGINES = ("project", "reference", "vllm")


class DecodeEngine(Protocol):
    """One way of decoding prompts (token ids, rendered as in training) with a drafter."""

    name: str
    # its decode times are on the project loop's clock, so its speedup is taken against the
    # project loop's plain baseline (eval/speedup_<name>); False for another runtime's times
    same_clock: bool

    def decode(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int
    ) -> EvalSummary: ...

    def details(self) -> dict:
        """The engine's own figures of its last decode, beyond the summary ({} when none)."""
        ...


@dataclass
class ProjectLoop:
    """The project's loop on `target` and `drafter` (both as given: cast them first).
    `baseline`: also plain greedy decoding of each prompt (speedup, lossless)."""

    target: Any
    drafter: Any
    baseline: bool = False
    warmup: bool = False
    progress: bool = False
    packed: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # evaluate's sampling/verify settings
    name: str = "project"
    same_clock: bool = True

    def decode(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int
    ) -> EvalSummary:
        return evaluate(
            self.target,
            self.drafter,
            list(prompts),
            max_new_tokens,
            block_size,
            baseline=self.baseline,
            warmup=self.warmup,
            progress=self.progress,
            packed=self.packed,
            **self.options,
        )

    def details(self) -> dict:
        return {}


def comparison_engines(
    cfg: Config, target: Any, export_dir: str | Path | None, names: Sequence[str]
) -> list[DecodeEngine]:
    """The engines `names` (of eval.compare) decoding the export in `export_dir` beside `target`
    (a TargetModel in the evaluation's dtype)."""
    engines = [_comparison_engine(n, cfg, target, export_dir) for n in names]
    return [x for x in engines if x is not None]  # required: never None (an error instead)


def eval_command_engines(cfg: Config, target: Any, export_dir: Path) -> list[DecodeEngine]:
    """The `eval` command's comparisons: eval.compare, with eval.engine=vllm's (reference loop
    and vLLM; at temperature > 0 vLLM only: the reference loop is greedy) added, and vLLM where
    the parity gate asks for it (eval.parity=on, or auto where vLLM can run)."""
    e = cfg.eval
    names = list(e.compare)
    if e.engine == "vllm":
        adds = ("reference", "vllm") if e.sampling.greedy else ("vllm",)
        names += [n for n in adds if n not in names]
    gate = "vllm" not in names and e.parity != "off"
    wanted = [(n, True) for n in names] + ([("vllm", e.parity == "on")] if gate else [])
    engines = [_comparison_engine(n, cfg, target, export_dir, need) for n, need in wanted]
    return [x for x in engines if x is not None]


def _comparison_engine(
    name: str, cfg: Config, target: Any, export_dir: str | Path | None, required: bool = True
) -> DecodeEngine | None:
    """The engine `name`; where it is vLLM and vLLM cannot run, an error (`required`) or None."""
    if name not in ENGINES or name == "project":
        raise UserError(
            f"eval.compare: '{name}' is no engine to compare with; use any of reference, vllm."
        )
    if export_dir is None:
        raise UserError(f"eval.compare={name} decodes the export, and this run wrote none.")
    stop = list(target.eos_token_ids)
    if name == "reference":
        if not cfg.eval.sampling.greedy:
            raise UserError(
                "eval.compare=reference: the reference loop (dflash_generate) decodes greedily; "
                "compare it at --eval.sampling.temperature=0 (vLLM compares at any temperature)."
            )
        return ReferenceLoop(export_dir, target.model, stop, progress=cfg.metrics.console)
    dtype, loaded = dtype_label(target.dtype), dtype_label(target.loaded_dtype)
    need = "vLLM is needed here but cannot run" if required else ""
    engine, why = engine_for_config(cfg, dtype, required=need)
    if engine is None:
        log.info("eval: vLLM does not serve the export beside this evaluation: %s", why)
        return None
    if loaded != dtype:
        log.warning(
            "eval: the target decodes in %s from weights loaded in %s (target.dtype=%s); vLLM "
            "loads the model directory in %s, so outputs can differ for that reason alone: pass "
            "--target.dtype=%s for a token-exact served comparison",
            dtype,
            loaded,
            cfg.target.dtype,
            dtype,
            dtype,
        )
    # at temperature > 0 the acceptance compares (the same rule: tests/test_engine_rule.py),
    # the sampled tokens do not
    return ServedLoop(engine, export_dir, stop, sampling=cfg.eval.sampling)


@dataclass
class EvalRun:
    """One evaluation's results, whichever command ran it: per group (a source of held-out
    prompts, or an `eval.datasets` entry) the project loop's summary; the same prompts decoded
    by each compared engine; tau_sim. `events()` is what every sink receives (eval/*)."""

    groups: dict[str, EvalSummary]
    overall: EvalSummary  # every group's responses together
    sims: dict[str, float] = field(default_factory=dict)  # "all" and per group; {} = not run
    sim_gap: float | None = None  # tau_sim - tau on the decoded prompts
    sim_prompts: int = 0
    sim_ctx: dict[str, tuple[float, int]] = field(default_factory=dict)  # tau_sim per context
    compared: dict[str, dict[str, EvalSummary]] = field(default_factory=dict)  # engine -> group
    details: dict[str, dict[str, dict]] = field(default_factory=dict)  # engine -> group -> own

    @classmethod
    def of(cls, groups: dict[str, EvalSummary]) -> EvalRun:
        """The run of `groups` decoded apart (the `eval` command's datasets), with their
        responses together as the overall summary."""
        spec = [r for s in groups.values() for r in s.spec_results]
        ar = [r for s in groups.values() for r in s.ar_results]
        block = next(iter(groups.values())).block_size if groups else 1
        overall = summarize(spec, ar or None, block)
        overall.prompts = [p for s in groups.values() for p in s.prompts]
        return cls(groups=groups, overall=overall)

    def compare(
        self,
        engines: Sequence[DecodeEngine],
        max_new_tokens: int,
        block: int,
        groups: Sequence[str] = (),
    ) -> None:
        """Each engine decodes the prompts our loop answered in every group (of `groups` only,
        when given). An engine on our clock gets its speedup against our plain baseline."""
        for e in engines:
            for g, s in self.groups.items():
                if groups and g not in groups:
                    continue
                out = e.decode(s.prompts, max_new_tokens, block)
                if e.same_clock and s.ar_tpot and out.tpot > 0:
                    out.speedup = s.ar_tpot / out.tpot
                self.compared.setdefault(e.name, {})[g] = out
                self.details.setdefault(e.name, {})[g] = e.details()

    def events(self) -> dict[str, Any]:
        """eval/tau, eval/tau/<group>, eval/prompts/<group>, eval/tau_sim(/<group>),
        eval/tau_sim_gap, eval/speedup, eval/lossless (1/0) and its line where a baseline ran,
        eval/tau_<engine> per compared engine (eval/tau_reference, eval/tau_vllm,
        eval/tau_adaptive) and eval/speedup_<engine> (on our clock: against our plain baseline;
        vLLM: against its own plain greedy); each also per group."""
        rec: dict[str, Any] = {"eval/tau": float(self.overall.tau)}
        for g, s in self.groups.items():
            rec[f"eval/tau/{g}"] = float(s.tau)
            rec[f"eval/prompts/{g}"] = s.num_responses
        if self.sims:
            rec["eval/tau_sim"] = float(self.sims["all"])
            if self.sim_gap is not None:
                rec["eval/tau_sim_gap"] = self.sim_gap
            rec.update({f"eval/tau_sim/{g}": v for g, v in self.sims.items() if g != "all"})
        o = self.overall
        if o.prompts:  # tau per context-length bucket (eval/metrics.py tau_by_context)
            lens = [r.acceptance_lengths for r in o.spec_results]
            for b, (tau, n) in tau_by_context(lens, [len(p) for p in o.prompts]).items():
                rec[f"eval/tau_ctx/{b}"], rec[f"eval/cycles_ctx/{b}"] = tau, n
        for b, (tau, n) in self.sim_ctx.items():
            rec[f"eval/tau_sim_ctx/{b}"], rec[f"eval/sim_cycles_ctx/{b}"] = tau, n
        if o.speedup is not None:
            rec["eval/speedup"] = float(o.speedup)
            rec.update({f"eval/speedup/{g}": s.speedup for g, s in self.groups.items()})
        if o.lossless is not None:
            rec["eval/lossless"] = float(o.lossless)
            rec["eval/lossless_line"] = o.lossless_line()
            rec.update(
                {f"eval/lossless_line/{g}": s.lossless_line() for g, s in self.groups.items()}
            )
        for name, by_group in self.compared.items():
            taus = [x for s in by_group.values() for x in _response_taus(s)]
            rec[f"eval/tau_{name}"] = sum(taus) / len(taus) if taus else 1.0
            rec.update({f"eval/tau_{name}/{g}": s.tau for g, s in by_group.items()})
            rec.update(
                {f"eval/speedup_{name}/{g}": s.speedup for g, s in by_group.items() if s.speedup}
            )
        return rec


def _response_taus(s: EvalSummary) -> list[float]:
    return [
        sum(r.acceptance_lengths) / len(r.acceptance_lengths)
        for r in s.spec_results
        if r.acceptance_lengths
    ]
