"""`dflash-trainer` command line: parse, build the Config, hand it to one command; nothing else.

Every command accepts `--preset NAME`, `--config FILE.toml` and `--section.field=VALUE` overrides.
Each command is one module of dflash_trainer.commands with `run(cfg, args) -> int`, imported
only when it runs so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from pathlib import Path

from dflash_trainer.config import ConfigError
from dflash_trainer.config_io import help_text, list_presets, load_config
from dflash_trainer.errors import UserError

# name -> one-line help; the command is dflash_trainer.commands.<name>.run(cfg, args) -> exit code.
COMMANDS = {
    "train": "train a drafter online (target in the loop)",
    "demo": "end to end on the embedded default: setup, regenerate, train, evaluate, export",
    "generate": "regenerate assistant responses with the target (resumable JSONL)",
    "eval": "speculative decoding with a drafter: acceptance length and speedup",
    "report": "plots (PNG + HTML) of a run's metrics.jsonl",
    "bench": "run every benchmark under bench/ and write one table",
    "export": "write a checkpoint's drafter in the published DFlash format (+ training.json)",
}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=None,
        help=f"named preset ({', '.join(list_presets()) or 'none installed'})",
    )
    p.add_argument("--config", dest="config_file", default=None, help="TOML file of overrides")


def build_parser() -> argparse.ArgumentParser:
    epilog = "Config fields (override any with --section.field=VALUE):\n" + help_text()
    parser = argparse.ArgumentParser(
        prog="dflash-trainer",
        description="Train DFlash drafters for Hugging Face targets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cfg_p = sub.add_parser(
        "config",
        help="show the resolved config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog,
    )
    cfg_p.add_argument("action", choices=["show"], help="show: print the resolved config as TOML")
    _add_common(cfg_p)

    for name, help_line in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_line,
            description=help_line,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=epilog,
        )
        _add_common(p)
        if name == "report":
            p.add_argument("report_run_dir", metavar="RUN_DIR", help="a run directory")
        if name == "export":
            p.add_argument(
                "export_source",
                metavar="CHECKPOINT_DIR",
                help="a checkpoint (RUN_DIR/checkpoints/step-N), a run directory (its latest "
                "checkpoint) or an export directory",
            )
            p.add_argument("--out", dest="export_out", required=True, help="output directory")
            p.add_argument(
                "--dtype",
                dest="export_dtype",
                default="bfloat16",
                choices=["bfloat16", "float32", "float16", "as_stored"],
                help="weights dtype (default bfloat16, which every engine runs; as_stored = the "
                "source's dtype)",
            )
        if name == "eval":
            p.add_argument(
                "--drafter",
                dest="drafter_path",
                default=None,
                help="exported drafter dir (default: RUN_DIR/export); its training.json names "
                "the target and the training config, so no preset is needed",
            )
            p.add_argument("--output", default=None, help="JSON result file")
        if name == "generate":
            p.add_argument(
                "--prompts",
                default="embedded",
                help="prompt source: 'embedded' (MT-Bench + HumanEval) or a "
                "conversation file whose assistant turns are regenerated",
            )
            p.add_argument("--output", default=None, help="output JSONL (appended, resumable)")
            p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per response")
            p.add_argument("--batch-size", type=int, default=16, help="prompts per batch")
            p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
            p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
            p.add_argument("--limit", type=int, default=0, help="only the first N prompts (0=all)")
            p.add_argument(
                "--engine",
                default="auto",
                choices=["auto", "hf", "vllm"],
                help="hf = the project's batched decode loop; vllm = vLLM's offline engine (its "
                "own venv: make vllm; --eval.vllm_python), sampling parameters recorded in each "
                "record's provenance; auto = vllm where installed (bf16/fp16 targets, jobs of "
                ">= 2048 prompts x tokens), else hf",
            )
        if name == "train":
            p.add_argument(
                "--nproc",
                type=int,
                default=0,
                help="launch this many processes with torchrun (0 = this process)",
            )
        if name == "bench":
            p.add_argument("--quick", action="store_true", help="fewer repeats")
            p.add_argument(
                "--only",
                action="append",
                metavar="SCRIPT",
                help="run only this bench/ script (repeatable); other rows are kept",
            )
    return parser


class _ConsoleHandler(logging.StreamHandler):
    """The console handler main() installs (once per process)."""


def _setup_console_logging() -> None:
    """Console: INFO one-liners. Tracebacks and DEBUG detail go only to the run's log file
    (trainer.setup_run_logging) or, before a run dir exists, to the fallback error log."""
    root = logging.getLogger()
    if not any(isinstance(h, _ConsoleHandler) for h in root.handlers):
        h = _ConsoleHandler(sys.stderr)
        h.setLevel(logging.INFO)
        h.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(message)s", "%H:%M:%S"))
        root.addHandler(h)
    root.setLevel(logging.INFO)
    logging.getLogger("dflash_trainer").setLevel(logging.DEBUG)


def _write_traceback(cfg, exc: BaseException) -> Path:
    """Full traceback (and a failed stage's own traceback) into the run log, never the console."""
    run_dir = Path(cfg.run_dir) if cfg is not None else None
    if getattr(exc, "keep_out_of_run_dir", False):  # run_dir holds another run's log
        run_dir = None
    path = (
        (run_dir / "train.log")
        if run_dir is not None and run_dir.is_dir()
        else Path(os.environ.get("DFLASH_TRAINER_CACHE", Path.home() / ".cache" / "dflash-trainer"))
        / "last-error.log"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(traceback.format_exception(exc)))
        stage_tb = getattr(exc, "tb", "")
        if stage_tb:
            f.write("--- traceback of the failed stage ---\n" + stage_tb)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.overrides = list(rest)  # a command may rebuild its config on another base (eval)
    _setup_console_logging()
    cfg = None
    try:
        cfg = load_config(args.preset, args.config_file, rest)
        command = importlib.import_module(f"dflash_trainer.commands.{args.command}")
        return int(command.run(cfg, args) or 0)
    except ConfigError as e:
        print(f"dflash-trainer: config error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        log_path = _write_traceback(cfg, e)
        print(f"dflash-trainer: error: {e}\n(details: {log_path})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-trainer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line; the traceback goes to the log file
        log_path = _write_traceback(cfg, e)
        print(
            f"dflash-trainer: failed: {type(e).__name__}: {e}\n(full traceback: {log_path})",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
