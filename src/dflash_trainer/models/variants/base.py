"""What a drafter variant is: the seams through which it changes the one DFlash backbone
(models/drafter.py), its training objective (train/objective.py) and its export
(models/export.py). A variant is a `DrafterVariant` in one file of this package plus one line in
the registry (models/variants/__init__.py); tests/test_variants.py adds a toy one that way.

The seams, each with DFlash's behaviour as the default here:
  - `options`: keys of the variant's own shape (DFlashConfig.options, exported into
    config.json's dflash_config; the defaults are the `drafter.*` keys' defaults in config.py);
  - `layer_parts`: modules wrapped around a decoder layer's attention and MLP sublayers
    (`prepare` the sublayer's input, `finish` its output);
  - `drafter_parts`: modules the drafter holds once (beside its layers);
  - `reset_parts`: their neutral start, where the drafter drafts what plain DFlash would, so a
    drafter of a variant in `warm_starts_from` converts into this one exactly;
  - `propose`: the block's draft tokens from the slots' logits;
  - `objective_terms`: loss terms and metrics added to the block loss;
  - `architecture` / `reference_class`: the names in config.json and in the `dflash` reference
    package; `tensor_names`: the published names of the tensors it adds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch import nn

from dflash_trainer.config import DrafterConfig, ObjectiveConfig


class SublayerWrap(Protocol):
    """A module around one sublayer: prepare(x) -> (x', state); finish(y, state) -> y'."""

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def finish(self, y: torch.Tensor, state: Any) -> torch.Tensor: ...


class DrafterShape(Protocol):
    """What a variant reads of the drafter's config (models/drafter.py DFlashConfig)."""

    hidden_size: int
    block_size: int
    vocab_size: int
    init_std: float
    options: dict[str, Any]


class ObjectiveTerms(Protocol):
    """Loss terms a variant adds beside the block loss, with their metric names."""

    metric_names: list[str]

    def __call__(
        self,
        drafter: nn.Module,
        hidden: torch.Tensor,
        lm_head: Any,
        labels: torch.Tensor,
        label_valid: torch.Tensor,
        slot_weights: torch.Tensor,
        chunk_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(0-d differentiable loss to add, 1-D detached metrics in metric_names' order)."""
        ...


def pick(
    scores: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """argmax over the last dim; at T > 0 a Gumbel-max sample of softmax(scores / T)."""
    if temperature <= 0:
        return scores.argmax(dim=-1)
    u = torch.rand(scores.shape, device=scores.device, generator=generator)
    gumbel = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
    return (scores.float() / temperature + gumbel).argmax(dim=-1)


def schema_defaults(keys: tuple[str, ...]) -> dict[str, Any]:
    """The defaults of `drafter.<key>` in config.py's schema: written once, there."""
    fields = {f.name: f for f in dataclasses.fields(DrafterConfig)}
    return {k: fields[k].default for k in keys}


def _as_type_of(default: Any, value: Any) -> Any:
    """`value` as an int or float where the default is one (bools and other types as given)."""
    if isinstance(default, bool) or not isinstance(default, int | float):
        return value
    return type(default)(value)


class DrafterVariant:
    name = "dflash"
    architecture = "DFlashDraftModel"
    reference_class = "DFlashDraftModel"
    options: tuple[str, ...] = ()
    objective_options: tuple[str, ...] = ()  # objective.* keys read by objective_terms
    warm_starts_from: tuple[str, ...] = ()

    def default_options(self) -> dict[str, Any]:
        return schema_defaults(self.options)

    def complete_options(self, given: dict[str, Any]) -> dict[str, Any]:
        """`given` with the defaults of the options it leaves out, each given number as its
        default's type (a config.json may write 2.0 for 2); ValueError on a key the variant does
        not have or a value that is no such number."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ValueError(
                f"variant {self.name} has no option {unknown} (its options: {list(self.options)})"
            )
        defaults = self.default_options()
        return {**defaults, **{k: _as_type_of(defaults[k], v) for k, v in given.items()}}

    def options_from(self, section: Any) -> dict[str, Any]:
        """The variant's options as set in a drafter config section."""
        return {k: getattr(section, k) for k in self.options}

    def check(self, cfg: DrafterShape) -> None:
        """ValueError naming the option when `cfg` (a DFlashConfig) cannot be built."""

    def layer_parts(self, cfg: DrafterShape) -> dict[str, tuple[str, nn.Module]]:
        """{"attention" | "mlp": (attribute name, SublayerWrap module)} for one decoder layer."""
        return {}

    def drafter_parts(self, cfg: DrafterShape) -> dict[str, nn.Module]:
        """{attribute name: module} the drafter holds once."""
        return {}

    @torch.no_grad()
    def reset_parts(self, drafter: nn.Module, generator: torch.Generator | None = None) -> None:
        """The variant's parts to their neutral start."""

    def propose(
        self,
        drafter: nn.Module,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Draft tokens [B, L] from the slots' hidden states [B, L, H] and logits [B, L, V]
        (anchor_ids [B]: slot 0's token). DFlash: each slot's argmax, independently."""
        return pick(logits, temperature, generator)

    def objective_terms(self, section: ObjectiveConfig, cfg: DrafterShape) -> ObjectiveTerms | None:
        """Terms added to the block loss, from the objective config section (`objective_options`)
        and the drafter's DFlashConfig (`options`); None = none."""
        return None

    def tensor_names(self, num_layers: int) -> list[str]:
        """The published names of the tensors this variant adds to DFlash's."""
        return []
