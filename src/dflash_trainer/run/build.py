"""Everything a run needs, built from the config: target, data, drafter, objective, optimizer,
LR schedule and the resume state. Nothing here starts a thread (run/trainer.py does)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_trainer import checkpoint as ckpt
from dflash_trainer.checkpoint import ResumePlan, TrainState
from dflash_trainer.config import Config, anchor_share
from dflash_trainer.config_io import to_dict
from dflash_trainer.data.batching import plan_epoch, plan_skipping
from dflash_trainer.data.chat import TokenizedDataset
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.errors import UserError
from dflash_trainer.models.attention import resolve_impl
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.init_target import init_from_target, warm_start
from dflash_trainer.models.layer_map import Unmappable
from dflash_trainer.models.target import TargetModel
from dflash_trainer.pipeline.cores import CoreShare, usable_cpus
from dflash_trainer.pipeline.feature_cache import FeatureCache
from dflash_trainer.pipeline.protocols import Target
from dflash_trainer.precision import use_autocast
from dflash_trainer.run import rundir
from dflash_trainer.run.memory_plan import MemoryPlan, plan_memory
from dflash_trainer.train.anchor_policy import AnchorPolicy
from dflash_trainer.train.budget import TimeBudget
from dflash_trainer.train.objective import DFlashObjective
from dflash_trainer.train.optim import GuardedStep, build_optimizer, build_scheduler

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """The built run. `state` is where training continues (a fresh TrainState or the resumed
    one); `resume` says how it was found (None: a fresh start)."""

    cfg: Config
    run_dir: Path
    rank: int
    world_size: int
    target: Target  # models.target.TargetModel (or a test double with the same surface)
    train_set: TokenizedDataset
    heldout: TokenizedDataset | None  # validation + reported prompts (data/prepare.py)
    drafter: DFlashDrafter
    model: torch.nn.Module  # the drafter, or its DDP wrapper under torchrun
    objective: DFlashObjective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    optim_step: GuardedStep  # clip + on-device non-finite skip + optimizer step
    generator: torch.Generator  # anchor sampling, per rank
    drafter_device: torch.device
    feature_dtype: torch.dtype
    autocast: bool
    embed_weight: torch.Tensor
    lm_head: torch.nn.Module
    config_dict: dict
    resume: ResumePlan | None
    state: TrainState
    total_steps: int
    lr_segments: list
    budget: TimeBudget | None = None  # optim.time_budget_s: training stops when it is spent
    memory: MemoryPlan | None = None  # what the drafter's device holds (pipeline.memory_plan)
    anchor_policy: AnchorPolicy | None = None  # objective.anchors other than random


def thread_split(cfg: Config) -> tuple[int, int]:
    """(target threads per worker, drafter threads) for CPU stages."""
    total = cfg.pipeline.cpu_threads or usable_cpus()
    if cfg.pipeline.schedule == "sequential":
        return total, total
    t = max(1, round(total * cfg.pipeline.target_thread_share))
    return t, max(1, total - t)


def feature_cache(cfg: Config, parts, captured=None) -> FeatureCache | None:
    """The run's FeatureCache (pipeline.feature_cache_gb > 0), shared by its target workers;
    `captured`: features kept while generating the data (CapturedFeatures), adopted by the
    samples whose ids they were computed on."""
    gb = cfg.pipeline.feature_cache_gb
    if gb <= 0:
        if captured is not None:
            captured.clear()
        return None
    devices = [torch.device(d) for d in cfg.pipeline.target_devices] + [parts.drafter_device]
    if any(d.type != "cpu" for d in devices):
        raise UserError(
            f"pipeline.feature_cache_gb={gb}: the feature cache is for CPU runs (target and "
            f"drafter on cpu, here {[str(d) for d in devices]}); set it to 0 on GPUs"
        )
    cache = FeatureCache(parts.train_set.lengths, int(gb * 2**30))
    if captured is not None:
        final = parts.objective.needs_target_hidden
        cache.adopt(parts.train_set, captured, parts.target, final, parts.feature_dtype)
    return cache


def share_cores(cfg: Config, hs_q, cache, drafter_threads: int, target_threads: int):
    """The CPU pipeline's CoreShare (pipeline/cores.py), or None: off by config, on GPUs, or
    when there is nothing to borrow (no cache and parking off)."""
    p = cfg.pipeline
    devices = [torch.device(d) for d in (*p.target_devices, p.drafter_device)]
    if any(d.type != "cpu" for d in devices):
        return None
    park = p.share_cores and len(p.target_devices) == 1
    if not park and cache is None:
        return None
    total = drafter_threads + target_threads
    return CoreShare(
        hs_q, drafter_threads, total, park=park, adapt=park, trial_windows=p.share_trial_windows
    )


def count_steps(lengths, cfg: Config, rank: int = 0, world: int = 1) -> tuple[int, list[int]]:
    per_epoch = [
        len(plan_epoch(lengths, cfg.batching, e, rank, world)) for e in range(cfg.optim.epochs)
    ]
    total = sum(per_epoch) // cfg.optim.grad_accum
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    return total, per_epoch


def build_drafter(cfg: Config, target, device) -> DFlashDrafter:
    try:  # fail before any work, not at the first drafter step
        resolve_impl(cfg.drafter.attention, device)
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.drafter.init_from:
        return warm_start(cfg.drafter.init_from, cfg.drafter, target).to(device)
    dcfg = DFlashConfig.from_configs(cfg.drafter, target)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg)
    if cfg.drafter.init == "target":
        try:
            init_from_target(drafter, target, cfg.drafter.init_tap)
        except Unmappable as e:
            raise UserError(
                f"drafter.init=target: {e}. Start from random weights (--drafter.init=random), "
                "or, where only some of its layers differ, copy others (--drafter.init_tap)."
            ) from None
        except ValueError as e:
            raise UserError(f"drafter.init=target: {e}.") from None
    return drafter.to(device)


def replicate_target(cfg: Config, first) -> list:
    """One target per `pipeline.target_devices` entry; `first` serves the first device and every
    entry on that same device (the workers take turns on it: one copy of the weights)."""
    return [first] + [
        first if torch.device(dev) == first.device else TargetModel.load(cfg.target, dev)
        for dev in cfg.pipeline.target_devices[1:]
    ]


def require_sources(cfg: Config) -> None:
    """A run that prepares its own data needs data.sources: a preset that names none (qwen3-8b)
    refuses here, before the target is loaded, instead of training on nothing in particular."""
    if not cfg.data.sources:
        raise UserError(
            "no training data: data.sources is empty (the qwen3-8b preset names none on purpose). "
            "Answer your prompts with the target first (dflash-trainer generate "
            "--generate.prompts=PROMPTS.jsonl --generate.out=ANSWERS.jsonl, same --preset), "
            "then pass "
            "--data.sources=ANSWERS.jsonl (a list: a.jsonl,b.jsonl@2; JSONL/JSON/Parquet or a "
            "saved HF dataset dir; 'embedded' = the built-in MT-Bench + HumanEval prompts; "
            "'synth' = --synth.prompts=N prompts the target writes itself, answered by it)."
        )


def load_inputs(cfg: Config, target=None, train_set=None, heldout=None) -> tuple:
    """(target, train_set, heldout): the given ones, else loaded/prepared from the config."""
    if train_set is None:
        require_sources(cfg)
    if target is None:
        target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    if train_set is None:
        train_set, heldout = prepare_data(cfg, target.tokenizer)
    if len(train_set) == 0:
        raise UserError(
            "no training examples left after filtering; check data.sources and data.max_length"
        )
    return target, train_set, heldout


def plan_total_steps(cfg: Config, lengths, plan: ResumePlan | None, rank: int, world: int) -> int:
    """Optimizer steps of the whole run. A resume on another world size re-plans the rest of
    its epoch without the samples already trained, so the total follows from that plan."""
    total, per_epoch = count_steps(lengths, cfg, rank, world)
    if plan is None or plan.epoch_skip is None:
        return total
    st = plan.state
    first = len(
        plan_skipping(lengths, cfg.batching, st.epoch, rank, world, plan.epoch_skip).batches
    )
    left = first - len(st.consumed) + sum(per_epoch[st.epoch + 1 :])
    total = st.step + max(0, left) // cfg.optim.grad_accum
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    return total


def heads_dtype(target, drafter: DFlashDrafter, autocast: bool) -> torch.dtype:
    """The dtype of the drafter's frozen embedding and LM head: the target's under autocast,
    else the drafter's own."""
    return target.embed_weight.dtype if autocast else next(drafter.parameters()).dtype


def drafter_heads(target, drafter: DFlashDrafter, device: torch.device, autocast: bool) -> tuple:
    """(embed_weight, lm_head) for the drafter: the target's frozen ones. Without autocast they
    must also be in the drafter's dtype (e.g. a bf16 target on CPU with an fp32 drafter): then,
    or on another device, the drafter gets its own frozen copy."""
    head_dtype = heads_dtype(target, drafter, autocast)
    embed_weight = target.embed_weight.to(device, dtype=head_dtype)
    lm_head = target.lm_head
    if device != torch.device(target.device) or next(lm_head.parameters()).dtype != head_dtype:
        lm_head = copy.deepcopy(target.lm_head).to(device, dtype=head_dtype)
        lm_head.requires_grad_(False)
    return embed_weight, lm_head


def resume_plan(
    cfg: Config, run_dir: Path, rank: int, world_size: int, resume_from: Path | None
) -> ResumePlan | None:
    """This rank's position in the checkpoint it resumes from (None: a fresh start), known
    before the LR schedule is built."""
    if not (cfg.checkpoint.resume or resume_from is not None):
        return None
    return ckpt.plan_resume(
        run_dir, rank=rank, world_size=world_size, seed=cfg.seed, checkpoint=resume_from
    )


def checked_memory_plan(
    cfg: Config,
    drafter: DFlashDrafter,
    objective: DFlashObjective,
    target,
    autocast: bool,
    feature_dtype: torch.dtype,
    world_size: int,
    data_tokens: int,
) -> MemoryPlan | None:
    """The run's memory plan (pipeline.memory_plan; None when off), logged and checked against
    the drafter's device: a UserError naming the knobs where it cannot fit (refuse)."""
    mode = cfg.pipeline.memory_plan
    if mode == "off":
        return None
    device = torch.device(cfg.pipeline.drafter_device)
    plan = plan_memory(
        cfg,
        drafter,
        objective,
        int(target.vocab_size),
        device,
        autocast,
        feature_dtype,
        heads_dtype(target, drafter, autocast),
        target_bytes=co_located_target_bytes(cfg, target, device),
        world_size=world_size,
        data_tokens=data_tokens,
    )
    for line in plan.lines():
        log.info(line)
    plan.check(mode)
    return plan


def co_located_target_bytes(cfg: Config, target, device: torch.device) -> int:
    """The target's weight bytes where a target worker runs on the drafter's device (its
    workers there share one copy), else 0."""
    if all(torch.device(d) != device for d in cfg.pipeline.target_devices):
        return 0
    return sum(p.numel() * p.element_size() for p in target.model.parameters())


def claim_run_dir(cfg: Config, rank: int, claimed: rundir.Claim | None = None) -> Path | None:
    """One run per directory (run/rundir.py): rank 0 refuses, resumes or moves an earlier run
    aside before this run writes anything there, unless its caller did (`claimed`: the command
    claims before it opens the run's log there). Returns the checkpoint to start from (None:
    run_dir's latest when resuming, else a fresh start)."""
    if claimed is not None:
        return claimed.resume_from
    if rank == 0:
        return rundir.claim(cfg).resume_from
    if cfg.checkpoint.resume_from:
        return ckpt.checkpoint_dir(cfg.checkpoint.resume_from)
    return None


def build_objective(cfg: Config, drafter: DFlashDrafter) -> DFlashObjective:
    d = cfg.objective
    return DFlashObjective(
        cfg.drafter.block_size,
        d.num_anchors,
        d.gamma,
        drafter.config.mask_token_id,  # an init_from export brings its own
        d.loss_chunk_blocks,
        weighting=d.weighting,
        dpace_alpha=d.dpace_alpha,
        feature_noise=d.feature_noise,
        kd_weight=d.kd_weight,
        kd_temperature=d.kd_temperature,
        loss_slots=d.loss_slots,
        hidden_weight=d.hidden_weight,
        label_source=d.label_source,
        reject_weight=d.reject_weight,
        extra_terms=drafter.config.spec.objective_terms(d, drafter.config),
    )


def check_mask_token(cfg: Config, train_set, mask_id: int, target) -> None:
    """The MASK token must never occur in the training text: a drafter could not tell a masked
    slot from that token. Refused, naming the id and where it occurs (a published drafter's own
    mask, with drafter.init_from, is only warned about: it cannot be changed)."""
    found = next(
        ((i, int(np.count_nonzero(x == mask_id))) for i, x in enumerate(train_set.input_ids)
         if np.any(x == mask_id)),
        None,
    )  # fmt: skip
    if found is None:
        return
    convert = getattr(getattr(target, "tokenizer", None), "convert_ids_to_tokens", None)
    name = convert(mask_id) if convert is not None else None
    what = (
        f"the MASK token id {mask_id}{f' ({name!r})' if name else ''} occurs in the training text "
        f"(sample {train_set.ids[found[0]]}, {found[1]} times there): the drafter could not tell "
        "a masked slot from it"
    )
    if cfg.drafter.init_from:
        log.warning("%s; it is the mask of drafter.init_from's drafter, kept", what)
        return
    raise UserError(
        f"{what}. Set --drafter.mask_token_id to an id the text never holds (a reserved special "
        "token), or -1 for auto (a padded embedding row, else a reserved special token)."
    )


def time_budget(cfg: Config, plan: ResumePlan | None) -> TimeBudget | None:
    """optim.time_budget_s, less what the resumed checkpoint's run already spent."""
    if cfg.optim.time_budget_s <= 0:
        return None
    used = float(plan.meta.get("budget_used_s", 0.0)) if plan is not None else 0.0
    return TimeBudget(cfg.optim.time_budget_s, used_s=used)


def anchor_policy_for(
    cfg: Config, num_samples: int, device: torch.device, world_size: int
) -> AnchorPolicy | None:
    """objective.anchors' memory of next starts (train/anchor_policy.py); None for random."""
    share = anchor_share(cfg.objective.anchors)
    if share == 0.0:
        return None
    if world_size > 1 or cfg.pipeline.split:
        raise UserError(
            f"objective.anchors={cfg.objective.anchors} runs in one process for now: each "
            "torchrun rank would keep its own memory of next starts, which the checkpoint does "
            "not gather. Use objective.anchors=random with --nproc / pipeline.split."
        )
    return AnchorPolicy(share, cfg.objective.num_anchors, num_samples, device)


def build_run(
    cfg: Config,
    *,
    target=None,
    train_set=None,
    heldout=None,
    rank: int = 0,
    world_size: int = 1,
    ddp_wrap=None,
    claimed: rundir.Claim | None = None,
) -> RunParts:
    run_dir = Path(cfg.run_dir)
    resume_from = claim_run_dir(cfg, rank, claimed)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    p = cfg.pipeline
    device = torch.device(p.drafter_device)
    target, train_set, heldout = load_inputs(cfg, target, train_set, heldout)

    drafter = build_drafter(cfg, target, device)
    check_mask_token(cfg, train_set, drafter.config.mask_token_id, target)
    model = ddp_wrap(drafter) if ddp_wrap is not None else drafter
    autocast = use_autocast(p.precision, device)
    feature_dtype = torch.bfloat16 if device.type == "cuda" else next(drafter.parameters()).dtype
    objective = build_objective(cfg, drafter)
    # before any run state exists: a refusal loses nothing
    memory = checked_memory_plan(
        cfg, drafter, objective, target, autocast, feature_dtype, world_size,
        int(np.asarray(train_set.lengths).sum()),
    )  # fmt: skip
    optimizer = build_optimizer(drafter.parameters(), cfg.optim)
    plan = resume_plan(cfg, run_dir, rank, world_size, resume_from)
    total_steps = plan_total_steps(cfg, train_set.lengths, plan, rank, world_size)
    lr_segments = ckpt.lr_segments(plan, total_steps)
    budget = time_budget(cfg, plan)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps, lr_segments, budget)
    optim_step = GuardedStep(optimizer, drafter.parameters(), cfg.optim.grad_clip, device)
    generator = torch.Generator(device=device)
    generator.manual_seed(cfg.seed * 1000003 + rank)
    config_dict = to_dict(cfg)
    policy = anchor_policy_for(cfg, len(train_set), device, world_size)
    state = TrainState(consumed=[])
    if plan is not None:
        held = dict(drafter=drafter, optimizer=optimizer, scheduler=scheduler, generator=generator)
        stateful = {"anchor_policy": policy} if policy is not None else None
        state = ckpt.restore(plan, **held, config=config_dict, stateful=stateful)
        if rank == 0:
            ckpt.reconcile_ledger(run_dir, plan.path)
    embed_weight, lm_head = drafter_heads(target, drafter, device, autocast)
    return RunParts(
        cfg=cfg,
        run_dir=run_dir,
        rank=rank,
        world_size=world_size,
        target=target,
        train_set=train_set,
        heldout=heldout,
        drafter=drafter,
        model=model,
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        optim_step=optim_step,
        generator=generator,
        drafter_device=device,
        feature_dtype=feature_dtype,
        autocast=autocast,
        embed_weight=embed_weight,
        lm_head=lm_head,
        config_dict=config_dict,
        resume=plan,
        state=state,
        total_steps=total_steps,
        lr_segments=lr_segments,
        budget=budget,
        memory=memory,
        anchor_policy=policy,
    )
