"""The drafter variants, by name (models/variants/base.py says what a variant is). A new variant
is one file in this package and one line here."""

from __future__ import annotations

from dflash_trainer.models.variants.base import DrafterVariant
from dflash_trainer.models.variants.dflash import DFLASH
from dflash_trainer.models.variants.dflash2 import DFLASH2

REGISTRY: dict[str, DrafterVariant] = {v.name: v for v in (DFLASH, DFLASH2)}


def get(name: str) -> DrafterVariant:
    """The variant called `name`; ValueError listing the registered ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"variant={name!r} is not one of {sorted(REGISTRY)}") from None


def by_architecture(architecture: str) -> DrafterVariant | None:
    """The variant a config.json `architectures` entry names, or None."""
    return next((v for v in REGISTRY.values() if v.architecture == architecture), None)
