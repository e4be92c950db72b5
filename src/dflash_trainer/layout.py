"""Where a run keeps what it writes: the one place the run directory's names are spelled.

RUN_DIR/
  metrics.jsonl          every logged scalar (observe/sinks.py)
  ledger.jsonl           one line per batch trained, tagged with its checkpoint (checkpoint.py)
  train.log              the run's log (train.rank<R>.log on other ranks)
  checkpoints/           step-NNNNNNN/ and `latest` (checkpoint.py)
  export/                the published-format drafter of the last step (models/export.py)
  best/                  the export at the best periodic evaluation (run/evaluation.py)
  heldout.jsonl          the reported held-out prompts; validation.jsonl, train_ids.json
  eval.json              `dflash-trainer eval`'s summary; generated.jsonl `generate`'s answers
  demo_summary.json      the demo's phases and figures
  tb/ wandb/ report/     TensorBoard events, the W&B run, plots (observe/report.py)
  ranks/<R>/             a DDP rank's own directory (run/distributed.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @classmethod
    def of(cls, run_dir: str | Path) -> RunLayout:
        return cls(Path(run_dir))

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    def log(self, rank: int = 0) -> Path:
        return self.root / ("train.log" if rank == 0 else f"train.rank{rank}.log")

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def best(self) -> Path:
        return self.root / "best"

    @property
    def heldout(self) -> Path:
        return self.root / "heldout.jsonl"

    @property
    def validation(self) -> Path:
        return self.root / "validation.jsonl"

    @property
    def train_ids(self) -> Path:
        return self.root / "train_ids.json"

    @property
    def eval_summary(self) -> Path:
        return self.root / "eval.json"

    @property
    def generated(self) -> Path:
        return self.root / "generated.jsonl"

    @property
    def demo_summary(self) -> Path:
        return self.root / "demo_summary.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def report(self) -> Path:
        return self.root / "report"

    def rank(self, rank: int) -> Path:
        return self.root / "ranks" / str(rank)

    @property
    def run_files(self) -> tuple[Path, ...]:
        """What marks a directory as holding a run (run/rundir.py)."""
        return (self.metrics, self.ledger, self.export, self.best)
