"""Export/load a drafter in the published z-lab layout (dflash-method.md §1.6).

    out_dir/config.json        Qwen3-style config, architectures ["DFlashDraftModel"]
                               (["DFlash2DraftModel"] for variant dflash2, docs/guides/dflash2.md)
    out_dir/model.safetensors  exactly 3 + 11*L tensors (DFlash2: 6 + 15*L), no "model."
                               prefix, no embed/lm_head
    out_dir/training.json      ours, read by no engine: the target (name, revision) and the
                               resolved training config, so `eval --drafter DIR` needs no preset

Every key and tensor is described in docs/guides/export.md.

The reference loads it with ``DFlashDraftModel.from_pretrained(out_dir)`` (tests/test_export.py).
Writes are atomic: everything goes to a sibling temp dir which is then renamed into place, so a
crash never leaves a half-written export under out_dir.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.errors import UserError
from dflash_trainer.files import replace_dir
from dflash_trainer.models import rope, variants
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.embedded import EMBEDDED_PREFIX
from dflash_trainer.precision import DTYPE_NAMES, DTYPES

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TRAINING_NAME = "training.json"

log = logging.getLogger(__name__)


def export_dtype(name: str) -> torch.dtype | None:
    """checkpoint.export_dtype / `export.dtype` as a torch dtype (None: as trained / as stored).
    A library call's name is checked here too (the config checks its own)."""
    if name in ("", "keep"):
        return None
    if name not in DTYPES:
        raise UserError(f"export dtype '{name}' is not one of {sorted(DTYPES)}/keep.")
    return DTYPES[name]


def last_layer_tap_warning(config: DFlashConfig) -> str | None:
    """A warning when the drafter taps the target's last decoder layer: vLLM serves it, SGLang
    cannot capture that layer (sglang#32204) and fails at the first draft step."""
    ids, n = list(config.target_layer_ids), config.num_target_layers
    if n and ids and max(ids) == n - 1:
        return (
            f"the drafter taps the target's last decoder layer ({n - 1} of 0..{n - 1}): vLLM "
            "serves this export, SGLang cannot (it cannot capture the last layer, sglang#32204, "
            "and fails at the first draft step); choose --target.taps without the last layer "
            "to serve with SGLang"
        )
    return None


_LAYER_PARAMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def expected_names(num_layers: int, variant: str = "dflash") -> list[str]:
    """The published tensor names: DFlash's 3 + 11*L, then the variant's own."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        names += [f"layers.{i}.{p}.weight" for p in _LAYER_PARAMS]
    return names + variants.get(variant).tensor_names(num_layers)


def hf_config(cfg: DFlashConfig, dtype: torch.dtype) -> dict:
    """config.json content: the fields of dflash-method.md §1.6 plus the transformers-5 rope
    form."""
    out = dict(cfg.extra)
    dflash_config = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
    }
    dflash_config.update(cfg.options)  # the reference and vLLM read a variant's keys there
    out.update(
        {
            "architectures": [cfg.spec.architecture],
            "model_type": "qwen3",
            "block_size": cfg.block_size,
            "num_target_layers": cfg.num_target_layers,
            "dflash_config": dflash_config,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            # the RoPE in every form engines read: transformers 5 (`rope_parameters`), older
            # readers (`rope_theta` + `rope_scaling`, vLLM 0.32's transformers<5.20)
            "rope_theta": cfg.rope_theta,
            "rope_parameters": rope.rope_parameters(cfg.rope_theta, cfg.rope_scaling),
            "rope_scaling": cfg.rope_scaling,
            "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "layer_types": ["full_attention"] * cfg.num_layers,
            "sliding_window": None,
            "use_sliding_window": False,
            "initializer_range": cfg.init_std,
            "dtype": DTYPE_NAMES[dtype],
        }
    )
    return out


def _hub_commit(model: str, revision: str | None) -> str | None:
    """The commit of a Hub model in the local Hugging Face cache (offline; None if not there)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, CONFIG_NAME, revision=revision)
    except Exception:  # not a repo id, no huggingface_hub: nothing to record
        return None
    if not isinstance(found, str):
        return None
    parts = Path(found).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


def _engine_model(t: dict, model, embedded: bool, local: bool) -> str | None:
    if not model:
        return None
    if embedded:
        from dflash_trainer.files import cache_root

        try:
            from dflash_trainer.models.embedded import embedded_target_dir

            return str(embedded_target_dir(t.get("cache_dir", ""), str(model).split(":", 1)[1]))
        except UserError:  # not installed here: where it will be converted
            return str(cache_root(t.get("cache_dir", "")) / "models")
    return str(Path(model).resolve()) if local else str(model)


# The target classes vLLM serves a DFlash drafter beside: vLLM feeds the drafter the target's
# auxiliary hidden states, which only a model class implementing `SupportsEagle3` gives (vLLM
# 0.32.0, the CPU build the project runs: v1/worker/gpu_model_runner.py
# `_setup_eagle3_aux_hidden_state_outputs`, which the CPU runner calls too, raises "Model does not
# support EAGLE3 interface" otherwise). These are the text-generation architectures of its model
# registry whose class has it (SGLang 0.5.23's DFLASH targets are a subset). Not among them, so
# not served: Gemma 1/2/3 and 3n, Mixtral, Qwen2-MoE, OLMoE, Phi-MoE, GPT-2, Falcon, Cohere, GLM-4,
# InternLM2 and others. tests/test_vllm_families.py serves Llama (Llama 3's RoPE included),
# Mistral, Phi-3, Qwen2, Qwen3, Qwen3-MoE and gpt-oss, and checks that Gemma 3 is refused.
VLLM_DFLASH_TARGETS = frozenset(
    {
        "AfmoeForCausalLM",
        "ApertusForCausalLM",
        "Cohere2MoeForCausalLM",
        "DeepseekForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Ernie4_5ForCausalLM",
        "Gemma4ForCausalLM",
        "GptOssForCausalLM",
        "GraniteForCausalLM",
        "GraniteSWAForCausalLM",
        "IQuestCoderForCausalLM",
        "InternLM3ForCausalLM",
        "K2HorizonForCausalLM",
        "LLaMAForCausalLM",
        "LagunaForCausalLM",
        "Llama4ForCausalLM",
        "LlamaForCausalLM",
        "MiMoForCausalLM",
        "MiMoV2FlashForCausalLM",
        "MiMoV2ForCausalLM",
        "MiniCPM3ForCausalLM",
        "MiniCPMForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Ministral3ForCausalLM",
        "MistralForCausalLM",
        "MistralLarge3ForCausalLM",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "Phi3ForCausalLM",
        "Plamo3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "SarvamMLAForCausalLM",
        "Step1ForCausalLM",
        "TeleChat2ForCausalLM",
        "TeleChat3ForCausalLM",
        "TeleFLMForCausalLM",
    }
)


def serving_note(architectures: list[str] | None) -> str | None:
    """A warning for an export whose target no serving engine runs DFlash beside, else None."""
    if not architectures or any(a in VLLM_DFLASH_TARGETS for a in architectures):
        return None
    return (
        f"the target ({', '.join(architectures)}) is not a class vLLM serves a DFlash drafter "
        "beside (it gives no auxiliary hidden states: no SupportsEagle3 in vLLM 0.32; "
        "docs/guides/families.md): this export is evaluated here and by the reference package, "
        "but no engine serves it"
    )


def recorded_architectures(record: dict | None) -> list[str] | None:
    """The target's `architectures` from its config.json, where the training record's target
    can be read here without the network (a local directory, the converted embedded target, a
    Hub model in the local cache); None where it cannot."""
    t = (record or {}).get("target") or {}
    path = None
    for d in (t.get("local_dir"), t.get("engine_model")):
        if d and (Path(d) / CONFIG_NAME).is_file():
            path = Path(d) / CONFIG_NAME
            break
    if path is None and t.get("model") and t.get("commit"):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(t["model"], CONFIG_NAME, revision=t["commit"])
        except Exception:  # not a repo id, no huggingface_hub: nothing to read
            found = None
        path = Path(found) if isinstance(found, str) else None
    if path is None:
        return None
    try:
        archs = json.loads(path.read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(a) for a in archs] if isinstance(archs, list) else None


def training_record(config: dict, *, step: int | None = None, source: str | None = None) -> dict:
    """training.json content: which target the drafter belongs to and how it was trained.
    `config` is the resolved training config (config.to_dict); `source` the checkpoint."""
    from dflash_trainer import __version__

    t = config.get("target", {}) or {}
    model = t.get("model")
    embedded = str(model or "").startswith(EMBEDDED_PREFIX)
    local = bool(model) and not embedded and Path(str(model)).is_dir()
    revision = t.get("revision") or None
    commit = _hub_commit(model, revision) if model and not local and not embedded else None
    return {
        "format": 1,
        "written_by": f"dflash-trainer {__version__}",
        "step": step,
        "checkpoint": source,
        "target": {
            "model": model,
            "revision": revision,
            "commit": commit,
            "local_dir": str(Path(str(model)).resolve()) if local else None,
            # what a serving engine loads (vLLM `model=`, SGLang --model-path): the converted
            # directory for the embedded target, never `embedded:...` nor its Hub original
            "engine_model": _engine_model(t, model, embedded, local),
            "engine_revision": None if embedded or local else (commit or revision),
        },
        "config": config,
    }


def read_training(path: str | os.PathLike) -> dict | None:
    """training.json of the export in `path` (None: an export without one, e.g. z-lab's)."""
    p = Path(path) / TRAINING_NAME
    if not p.is_file():
        return None
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{p}: not valid JSON ({e}); re-export with `dflash-trainer export`."
        ) from None
    if not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
        raise UserError(f"{p}: no 'config' object; re-export with `dflash-trainer export`.")
    return rec


def export_drafter(
    drafter: DFlashDrafter,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    training: dict | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ training.json when `training` is given) into
    out_dir (replacing it atomically)."""
    return export_weights(drafter.config, drafter.state_dict(), out_dir, dtype, training)


def export_weights(
    config: DFlashConfig,
    sd: dict,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    training: dict | None = None,
) -> Path:
    """export_drafter from a config and a state dict (e.g. a checkpoint snapshot's host copy,
    written while the live drafter trains on)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    names = expected_names(config.num_layers, config.variant)
    assert sorted(sd) == sorted(names), f"unexpected drafter params: {sorted(set(sd) ^ set(names))}"
    dtype = dtype or next(iter(sd.values())).dtype
    if dtype not in DTYPE_NAMES:
        raise UserError(f"export dtype {dtype} is not supported; use float32/bfloat16/float16.")
    tensors = {n: sd[n].detach().to(device="cpu", dtype=dtype).contiguous() for n in names}
    warn = last_layer_tap_warning(config)
    if warn:
        log.warning("export %s: %s", out, warn)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(
            json.dumps(hf_config(config, dtype), indent=2) + "\n", encoding="utf-8"
        )
        if training is not None:
            (tmp / TRAINING_NAME).write_text(
                json.dumps(training, indent=1) + "\n", encoding="utf-8"
            )
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# config.json keys the loader reads or checks; any other key is kept in DFlashConfig.extra
_KNOWN_CONFIG_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "block_size",
        "num_target_layers",
        "dflash_config",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "rms_norm_eps",
        "max_position_embeddings",
        "attention_bias",
        "attention_dropout",
        "tie_word_embeddings",
        "hidden_act",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "initializer_range",
        "dtype",
    }
)


def _rope_scaling(d: dict, path: Path) -> dict[str, Any] | None:
    """The RoPE form config.json declares, read exactly (models/rope.py): `rope_parameters`
    (transformers 5) and the older `rope_scaling` must agree where both are given; a form this
    drafter cannot compute as engines do is refused, never dropped."""
    try:
        forms = {
            k: rope.normalise_scaling(d.get(k), f"{path}: {k}")
            for k in ("rope_parameters", "rope_scaling")
            if d.get(k)
        }
    except ValueError as e:
        raise UserError(f"{e}. Serve and load it with an engine that computes it.") from None
    if len({json.dumps(v, sort_keys=True) for v in forms.values()}) > 1:
        raise UserError(
            f"{path}: rope_parameters {d['rope_parameters']} and rope_scaling "
            f"{d['rope_scaling']} declare two different RoPE forms; keep the one the drafter "
            "was trained with."
        )
    return next(iter(forms.values()), None)


def _config_from_json(d: dict, path: Path) -> DFlashConfig:
    def need(key, src=d):
        if key not in src:
            raise UserError(
                f"{path}: missing field '{key}'. Re-export the drafter with "
                "`dflash-trainer export` or fix the file."
            )
        return src[key]

    dc = need("dflash_config")
    arch = (d.get("architectures") or ["DFlashDraftModel"])[0]
    spec = variants.by_architecture(arch)
    if spec is None:
        known = sorted(v.architecture for v in variants.REGISTRY.values())
        raise UserError(
            f"{path}: architectures {d.get('architectures')}: this trainer loads {known} only."
        )
    options = {k: need(k, dc) for k in spec.options}
    for k in ("input_embedding_scale", "output_multiplier"):
        if float(dc.get(k, 1.0)) != 1.0:
            raise UserError(f"{path}: dflash_config.{k}={dc[k]} is not supported (only 1.0).")
    if float(dc.get("final_logit_softcapping") or 0.0) > 0:
        raise UserError(f"{path}: dflash_config.final_logit_softcapping is not supported.")
    rp = d.get("rope_parameters") or {}
    theta = d.get("rope_theta") or rp.get("rope_theta") or 1e6
    scaling = _rope_scaling(d, path)
    if d.get("attention_bias"):
        raise UserError(f"{path}: attention_bias=true is not supported (Qwen3 DFlash has none).")
    lt = d.get("layer_types") or []
    if any(t != "full_attention" for t in lt):
        raise UserError(
            f"{path}: layer_types {sorted(set(lt))}: only full_attention layers are "
            "supported by this trainer."
        )
    try:
        return DFlashConfig(
            hidden_size=int(need("hidden_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=int(d.get("head_dim") or need("hidden_size") // need("num_attention_heads")),
            intermediate_size=int(need("intermediate_size")),
            block_size=int(d.get("block_size", 16)),
            target_layer_ids=list(need("target_layer_ids", dc)),
            num_target_layers=int(need("num_target_layers")),
            mask_token_id=int(need("mask_token_id", dc)),
            vocab_size=int(need("vocab_size")),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            init_std=float(d.get("initializer_range", 0.02)),
            extra={k: v for k, v in d.items() if k not in _KNOWN_CONFIG_KEYS},
            variant=spec.name,
            options=options,
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: invalid drafter config: {e}.") from None


_EXPORT_DIR_HINT = (
    "point to a directory written by `export_drafter` (config.json + model.safetensors)."
)


def read_export_config(path: str | os.PathLike) -> DFlashConfig:
    """The drafter config of the export in directory `path` (its config.json), read exactly:
    a key this reader cannot honour is refused with the reason (`_config_from_json`)."""
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise UserError(f"{cfg_path} does not exist; {_EXPORT_DIR_HINT}")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_path}: not valid JSON ({e}); the file is damaged.") from None
    if not isinstance(raw, dict):
        raise UserError(f"{cfg_path}: expected a JSON object.")
    return _config_from_json(raw, cfg_path)


def load_drafter(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Load an export (ours or z-lab's). Validates names and shapes; dtype None = as stored."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    w_path = d / WEIGHTS_NAME
    cfg = read_export_config(d)
    if not w_path.is_file():
        raise UserError(f"{w_path} does not exist; {_EXPORT_DIR_HINT}")
    try:
        sd = load_file(str(w_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise UserError(
            f"{w_path}: cannot read safetensors ({e}); the file is truncated or "
            "damaged. Re-export it."
        ) from None
    # Accept the "model." prefix some converters add (SGLang tries both forms too).
    if sd and all(k.startswith("model.") for k in sd):
        sd = {k[len("model.") :]: v for k, v in sd.items()}
    want = expected_names(cfg.num_layers, cfg.variant)
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        raise UserError(
            f"{w_path}: tensor names do not match config.json "
            f"({cfg.num_layers} layers): missing {missing[:5]}, unexpected "
            f"{extra[:5]}. The weights and config belong to different models."
        )
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    ref = model.state_dict()
    for n in want:
        if tuple(sd[n].shape) != tuple(ref[n].shape):
            raise UserError(
                f"{w_path}: '{n}' has shape {tuple(sd[n].shape)} but config.json "
                f"implies {tuple(ref[n].shape)}. The weights and config do not match."
            )
        if not torch.isfinite(sd[n]).all():
            raise UserError(f"{w_path}: '{n}' contains NaN/inf values; the export is corrupt.")
    model.load_state_dict(sd, assign=True)
    dtype = dtype or sd["fc.weight"].dtype
    return model.to(device=device, dtype=dtype)
