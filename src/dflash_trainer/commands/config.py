"""`dflash-trainer config show`: the resolved config (defaults < preset < file < overrides) as
TOML."""

from __future__ import annotations

import sys

from dflash_trainer.config import Config
from dflash_trainer.config_io import to_toml


def run(cfg: Config, args) -> int:
    sys.stdout.write(to_toml(cfg))
    return 0
