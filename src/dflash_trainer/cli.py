"""`dflash-trainer` command line: parse, build the Config, hand it to one command; nothing else.

Every command accepts `--preset NAME`, `--config FILE.toml` and `--section.field=VALUE` overrides.
Each command is one module of dflash_trainer.commands with `run(cfg, args) -> int`, imported
only when it runs so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trainer.config import Config, ConfigError
from dflash_trainer.config_io import help_text, list_presets, load_config
from dflash_trainer.errors import UserError
from dflash_trainer.files import cache_root
from dflash_trainer.layout import RunLayout


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("report_run_dir", metavar="RUN_DIR", help="a run directory")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "export_source",
        metavar="CHECKPOINT_DIR",
        nargs="?",
        default=None,
        help="the same as --export.source: a checkpoint (RUN_DIR/checkpoints/step-N), a run "
        "directory (its latest checkpoint) or an export directory",
    )


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        dest="drafter_path",
        default=None,
        help="exported drafter dir (default: RUN_DIR/export); its training.json names "
        "the target and the training config, so no preset is needed",
    )
    p.add_argument("--output", default=None, help="JSON result file")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="launch this many processes with torchrun (0 = this process)",
    )


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the resolved config as TOML")


@dataclass(frozen=True)
class Command:
    """One command: dflash_trainer.commands.<name>.run(cfg, args) -> exit code. Its settings are
    config keys; `add_args` adds only what is not one (positionals, the torchrun launcher)."""

    help: str
    add_args: Callable[[argparse.ArgumentParser], None] | None = None


COMMANDS = {
    "config": Command("show the resolved config", _config_args),
    "train": Command("train a drafter online (target in the loop)", _train_args),
    "demo": Command(
        "end to end on the embedded default: setup, regenerate, train, evaluate, export"
    ),
    "generate": Command("regenerate assistant responses with the target (resumable JSONL)"),
    "eval": Command(
        "speculative decoding with a drafter: acceptance length and speedup", _eval_args
    ),
    "report": Command("plots (PNG + HTML) of a run's metrics.jsonl", _report_args),
    "bench": Command("run every benchmark under bench/ and write one table"),
    "export": Command(
        "write a checkpoint's drafter in the published DFlash format (+ training.json)",
        _export_args,
    ),
}

# Positionals that stand for a config key (the key wins when both are given: it is explicit).
POSITIONAL_KEYS = {"export_source": "export.source"}

# Flags these commands took before their settings became config sections, and the key each is
# now: using one is an error that names the key (as config.RENAMED does for renamed keys).
RETIRED_FLAGS = {
    "generate": {
        f"--{old}": f"generate.{new}"
        for old, new in [
            ("prompts", "prompts"),
            ("output", "out"),
            ("max-new-tokens", "max_new_tokens"),
            ("batch-size", "batch_size"),
            ("temperature", "sampling.temperature"),
            ("top-p", "sampling.top_p"),
            ("limit", "limit"),
            ("engine", "engine"),
        ]
    },
    "export": {"--out": "export.out", "--dtype": "export.dtype"},
    "bench": {"--quick": "bench.quick", "--only": "bench.only"},
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
    for name, command in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=command.help,
            description=command.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=epilog,
        )
        _add_common(p)
        if command.add_args is not None:
            command.add_args(p)
    return parser


def config_overrides(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """The `--section.field=VALUE` overrides of this command line: the unparsed rest, a retired
    flag refused naming its key, and the positionals that stand for a key."""
    retired = RETIRED_FLAGS.get(args.command, {})
    for a in rest:
        flag = a.split("=", 1)[0]
        if flag in retired:
            section, _, field = retired[flag].partition(".")
            raise ConfigError(
                f"'{flag}' of `{args.command}` is now the config key '--{retired[flag]}': "
                f"--{retired[flag]}=VALUE, or {field} under [{section}] in a TOML file."
            )
    given = ((key, getattr(args, dest, None)) for dest, key in POSITIONAL_KEYS.items())
    return [f"--{key}={v}" for key, v in given if v] + list(rest)


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


def _write_traceback(cfg: Config | None, exc: BaseException) -> Path:
    """Full traceback (and a failed stage's own traceback) into the run log, never the console."""
    run_dir = Path(cfg.run_dir) if cfg is not None else None
    if getattr(exc, "keep_out_of_run_dir", False):  # run_dir holds another run's log
        run_dir = None
    path = (
        RunLayout(run_dir).log()
        if run_dir is not None and run_dir.is_dir()
        else cache_root(cfg.target.cache_dir if cfg is not None else "") / "last-error.log"
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
    _setup_console_logging()
    cfg = None
    try:
        # a command may rebuild its config on another base (eval)
        args.overrides = config_overrides(args, rest)
        cfg = load_config(args.preset, args.config_file, args.overrides)
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
