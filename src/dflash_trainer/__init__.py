"""dflash-trainer: online, pipelined training of DFlash drafters."""

__version__ = "0.1.0"
