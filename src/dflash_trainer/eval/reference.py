"""Our tau, cross-checked by the published reference loop on the exported drafter.

`dflash_generate` of the `dflash` package (z-lab's reference implementation, installed by
`make setup`) loads the export the way users will, and decodes greedily with the target
verifying. Same prompts, same stop ids, same block size: in fp32 its tau equals ours exactly
(tests/test_specdecode.py); a gap means the export or the loop differ from the reference.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.decode.loop import GenResult
from dflash_trainer.errors import UserError
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.models import variants
from dflash_trainer.observe.progress import showing_progress


@contextlib.contextmanager
def _cpu_clock(ref_model_module: Any) -> Iterator[None]:
    """The reference times with torch.cuda.synchronize(), which a CPU build cannot run."""
    if torch.cuda.is_available():
        yield
        return
    saved = ref_model_module._cuda_time
    ref_model_module._cuda_time = time.perf_counter
    try:
        yield
    finally:
        ref_model_module._cuda_time = saved


def reference_class(ref_model_module: Any, export_dir: str | Path) -> Any:
    """The reference class that loads the export: the one its variant names (by config.json's
    architecture; models/variants/), as the reference's own benchmark picks it."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
    spec = variants.by_architecture(arch) or variants.get("dflash")
    return getattr(ref_model_module, spec.reference_class)


@dataclass
class ReferenceLoop:
    """The reference loop as a DecodeEngine (eval/engines.py): the export in `export_dir` drafting
    for `target_model`, greedy; its summary has the acceptance lengths (tau), not the tokens.
    `progress`: a bar over prompts (observe/progress.py; drawn only when stderr is a terminal)."""

    export_dir: str | Path
    target_model: torch.nn.Module
    stop_ids: Sequence[int] = ()
    progress: bool = True
    name: str = "reference"
    same_clock: bool = False  # its own times (no per-cycle clock): no speedup against ours

    def decode(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int
    ) -> EvalSummary:
        try:  # optional: the reference package is installed by `make setup`, not a dependency
            from dflash import model as ref
        except ImportError:
            raise UserError(
                "the reference check needs the `dflash` package: "
                "pip install --no-deps dflash==0.1.0"
            ) from None
        param = next(self.target_model.parameters())
        cls = reference_class(ref, self.export_dir)
        drafter = cls.from_pretrained(str(self.export_dir), dtype=param.dtype)
        drafter = drafter.to(param.device).eval()
        results = []
        with (
            _cpu_clock(ref),
            warnings.catch_warnings(),
            showing_progress(
                len(prompts), desc="reference", unit="prompt", enabled=self.progress
            ) as bar,
        ):
            # The reference passes `past_key_values`, which transformers 5.x renamed `cache` and
            # warns about on every call; the warning is the package's, not the user's to act on.
            warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated")
            for ids in prompts:
                x = torch.tensor([list(ids)], dtype=torch.long, device=param.device)
                r = ref.dflash_generate(
                    drafter,
                    self.target_model,
                    x,
                    max_new_tokens,
                    list(self.stop_ids) or None,
                    block_size=block_size,
                    return_stats=True,
                )
                lens = [int(a) for a in r.acceptance_lengths]
                results.append(
                    GenResult(
                        tokens=[], acceptance_lengths=lens, accepted_drafts=[], block_sizes=[]
                    )
                )
                bar.update(1)
        return summarize(results, None, block_size)

    def details(self) -> dict:
        return {}


def reference_tau(
    export_dir: str | Path,
    target_model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int] = (),
    progress: bool = True,
) -> dict:
    """tau of the reference loop over `prompts` (token id lists), aggregated like ours: the
    mean over responses of each response's mean tokens per cycle."""
    loop = ReferenceLoop(export_dir, target_model, stop_ids, progress)
    s = loop.decode(prompts, max_new_tokens, block_size)
    return {"tau": s.tau, "num_prompts": s.num_responses}
