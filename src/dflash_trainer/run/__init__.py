"""One training run: `build` turns the config into parts, `trainer.Trainer` wires and runs them,
`distributed` runs one rank's cell of a torchrun job.

`train(cfg, ...)` is the library entry point (the demo, benchmarks and tests call it with their
own target or dataset).
"""

from dflash_trainer.run.trainer import TrainResult, train

__all__ = ["TrainResult", "train"]
