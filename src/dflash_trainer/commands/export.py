"""`dflash-trainer export CHECKPOINT_DIR --export.out=DIR`: a checkpoint's drafter in the published
DFlash format (config.json + model.safetensors, what SGLang, vLLM and the `dflash` package
load), plus training.json (the target's name and revision, the resolved training config), so
that `dflash-trainer eval --drafter DIR` needs no preset. docs/guides/export.md describes every
file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash_trainer import checkpoint as ckpt
from dflash_trainer.config import Config
from dflash_trainer.errors import UserError
from dflash_trainer.models.export import (
    CONFIG_NAME,
    TRAINING_NAME,
    WEIGHTS_NAME,
    export_drafter,
    export_dtype,
    load_drafter,
    read_training,
    recorded_architectures,
    serving_note,
    training_record,
)

log = logging.getLogger(__name__)


def _is_export(p: Path) -> bool:
    return (p / CONFIG_NAME).is_file() and (p / WEIGHTS_NAME).is_file()


def _source(path: Path) -> tuple[Path, dict | None]:
    """(the export to copy, its training record): from a checkpoint, a run directory (latest
    checkpoint) or an export directory."""
    if _is_export(path) and not (path / "state.json").is_file():
        return path, read_training(path)
    src = ckpt.checkpoint_dir(path)
    meta = ckpt.read_meta(src)
    step = int(meta.get("train_state", {}).get("step", 0))
    rec = training_record(meta.get("config", {}), step=step, source=str(src.resolve()))
    return ckpt.checkpoint_export(src), rec


def _check_out(out: Path, src: Path) -> None:
    if out.resolve() == src.resolve():
        raise UserError(f"export.out {out} is the source itself; choose another directory.")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not _is_export(out))):
        raise UserError(
            f"export.out {out} exists and is not an export (no config.json + model.safetensors); "
            "it would be replaced. Choose a new or empty directory."
        )


def export(source, out, dtype: str = "bfloat16") -> tuple[Path, dict | None]:
    """Library form of the command: (the written directory, its training record)."""
    src, rec = _source(Path(source))
    out = Path(out)
    _check_out(out, src)
    drafter = load_drafter(src)  # validates names, shapes and finiteness
    export_drafter(drafter, out, export_dtype(dtype), training=rec)  # keep: unchanged
    note = serving_note(recorded_architectures(rec))
    if note:
        log.warning("export %s: %s", out, note)
    return out, rec


def run(cfg: Config, args) -> int:
    e = cfg.export
    if not e.out:
        raise UserError("export: name the output directory: --export.out=DIR.")
    out, rec = export(e.source or cfg.run_dir, e.out, e.dtype)
    config = json.loads((out / CONFIG_NAME).read_text())
    size = (out / WEIGHTS_NAME).stat().st_size
    target = (rec or {}).get("target", {})
    what = f"step {rec['step']} of {rec['checkpoint']}" if rec and rec.get("step") else "export"
    print(f"exported {what} to {out}")
    print(
        f"    {CONFIG_NAME}: {config['num_hidden_layers']} layers, block_size "
        f"{config['block_size']}, target layers {config['dflash_config']['target_layer_ids']}, "
        f"{config['dtype']}"
    )
    print(f"    {WEIGHTS_NAME}: {size / 1e6:.1f} MB")
    if rec is not None:
        rev = target.get("revision") or target.get("commit") or "not recorded"
        print(f"    {TRAINING_NAME}: target {target.get('model')} (revision {rev})")
        if target.get("engine_model"):
            print(f"    serve with target {target['engine_model']} (docs/guides/export.md)")
    else:
        print(f"    no {TRAINING_NAME} in the source: eval will need the target (--preset/flags)")
    print(f"evaluate: dflash-trainer eval --drafter {out}")
    return 0
