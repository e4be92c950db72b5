"""DFlash (dflash-method.md): the backbone as it is, each slot drafted by its own argmax."""

from __future__ import annotations

from dflash_trainer.models.variants.base import DrafterVariant


class DFlash(DrafterVariant):
    pass


DFLASH = DFlash()
