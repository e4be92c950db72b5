"""`dflash-trainer report RUN_DIR`: plots (PNG + HTML) of a run's metrics.jsonl."""

from __future__ import annotations

from dflash_trainer.config import Config
from dflash_trainer.observe.report import write_report


def run(cfg: Config, args) -> int:
    html_path = write_report(args.report_run_dir, getattr(args, "report_out", None))
    print(f"report written to {html_path}")
    return 0
