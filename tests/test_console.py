"""Progress bars and the console (observe/progress.py): a bar is drawn only when stderr is a
terminal and the caller wants it; while it is shown, console log lines go through tqdm.write at
the console handler's level; afterwards the handlers are as before. The long loops
(tokenization, evaluation, tau_sim, the reference loop) draw one without changing their
results; periodic evaluation during training never does."""

import io
import logging
import re
import sys
import threading

import pytest
import torch
from tqdm import tqdm

from dflash_trainer.data.chat import Rendering, build_dataset
from dflash_trainer.eval import evaluation as ev
from dflash_trainer.eval.reference import reference_tau
from dflash_trainer.eval.tau_sim import TauSim
from dflash_trainer.models.export import export_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe import progress
from dflash_trainer.observe.progress import (
    LogLines,
    console_above_bar,
    progress_bar,
    showing_progress,
)
from dflash_trainer.run import evaluation, train
from dflash_trainer.run.build import build_drafter
from test_chat import _convs
from test_specdecode import FakeTokenizer, _real_drafter, ar_generate, random_prompt, side
from test_specdecode import tiny_target as hf_target
from tiny import tiny_config, tiny_dataset, tiny_target


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm draws bars only on one)."""

    def isatty(self) -> bool:
        return True


def _console(monkeypatch, terminal: bool = True):
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.INFO)
    h.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h])
    monkeypatch.setattr(root, "level", logging.DEBUG)
    return err, h, root


def _drawn(out: str, desc: str, unit: str) -> bool:
    """A rendering of bar `desc` counting `unit`s, e.g. 'eval: 100%|###| 2/2 [.., 3.1prompt/s]'."""
    return re.search(rf"{re.escape(desc)}: .*\d+/\d+ \[.*{unit}", out) is not None


def _any_bar(out: str) -> bool:
    return re.search(r"\d+/\d+ \[", out) is not None


def _lines_with(out: str, text: str) -> list[str]:
    return [line for line in out.replace("\r", "\n").split("\n") if text in line]


# ------------------------------------------------------------------------ the shared helper


def test_log_lines_go_above_the_bar_at_the_console_level(monkeypatch):
    err, h, root = _console(monkeypatch)
    bar = tqdm(total=10, file=sys.stderr, desc="train", dynamic_ncols=False, ncols=60)
    bar.update(3)
    stack = console_above_bar(bar)
    assert h not in root.handlers  # replaced by a tqdm.write handler
    log = logging.getLogger("dflash_trainer.test")
    log.info("checkpoint written")
    log.debug("debug detail")  # the console shows INFO and above, as before
    bar.update(1)
    bar.close()
    stack.close()
    assert root.handlers == [h]
    out = err.getvalue()
    assert "debug detail" not in out
    # the message is a line of its own: never glued to a bar rendering
    assert _lines_with(out, "checkpoint written") == ["LOG checkpoint written"], out


def test_the_commands_console_handler_goes_above_the_bar_too(monkeypatch):
    err, h, root = _console(monkeypatch)

    class Console(logging.StreamHandler):  # cli.py installs a subclass of its own
        pass

    mine = Console(sys.stderr)
    mine.setLevel(logging.INFO)
    monkeypatch.setattr(root, "handlers", [mine])
    with showing_progress(3, desc="work", unit="item") as bar:
        assert mine not in root.handlers
        bar.update(1)
    assert root.handlers == [mine]


def test_no_bar_no_change(monkeypatch):
    _, h, root = _console(monkeypatch)
    stack = console_above_bar(None)
    assert root.handlers == [h]
    stack.close()


def test_a_bar_is_drawn_on_a_terminal_when_asked(monkeypatch):
    err, _, _ = _console(monkeypatch)
    bar = progress_bar(4, desc="work", unit="item")
    assert not bar.disable
    bar.update(2)
    bar.close()
    assert _drawn(err.getvalue(), "work", "item"), err.getvalue()
    err, _, _ = _console(monkeypatch)
    bar = progress_bar(4, desc="work", unit="item", enabled=False)  # the caller says no
    bar.update(2)
    bar.close()
    assert bar.disable and err.getvalue() == ""
    err, _, _ = _console(monkeypatch, terminal=False)  # a log file or a pipe: no redraws
    bar = progress_bar(4, desc="work", unit="item")
    bar.update(2)
    bar.close()
    assert isinstance(bar, LogLines) and err.getvalue() == ""  # no line due within 30 s


def test_in_a_pipe_progress_is_a_log_line_when_due_and_one_at_the_end(monkeypatch):
    err, h, root = _console(monkeypatch, terminal=False)
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with showing_progress(3, desc="generate", unit="prompt") as bar:
        assert root.handlers == [h]  # nothing to route around: no bar is drawn
        clock[0] = 10.0
        bar.update(1)  # not due: 10 s of 30
        clock[0] = 31.0
        bar.update(1)
        bar.set_postfix(tok_s="216")  # a redraw without progress: no second line
        clock[0] = 40.0
        bar.update(1)  # 9 s after the last line: not due
    lines = err.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == [
        "LOG generate: 2/3 prompts",
        "LOG generate: 3/3 prompts",  # closing: the loop had logged, so its end is logged too
    ], lines
    assert "<" in lines[0] and "tok_s=216" in lines[1], lines  # time left; the postfix
    # not due yet: nothing until the interval has passed, and then no closing line either
    err, _, _ = _console(monkeypatch, terminal=False)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 3600.0)
    with showing_progress(None, desc="tau_sim", unit="prompt") as bar:
        bar.update(5)
    assert err.getvalue() == ""
    # training logs its own lines: its bar asks for none
    err, _, _ = _console(monkeypatch, terminal=False)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    bar = progress_bar(None, desc="train", unit="step", lines=False)
    bar.update(2)
    bar.close()
    assert bar.disable and err.getvalue() == ""


def test_showing_progress_prints_log_lines_above_the_bar_then_restores(monkeypatch):
    err, h, root = _console(monkeypatch)
    log = logging.getLogger("dflash_trainer.test")
    with showing_progress(3, desc="work", unit="item") as bar:
        assert h not in root.handlers
        bar.update(1)
        log.info("halfway there")
        bar.update(2)
    assert root.handlers == [h] and bar.disable  # closed
    out = err.getvalue()
    assert _drawn(out, "work", "item"), out
    assert _lines_with(out, "halfway there") == ["LOG halfway there"], out


def test_no_terminal_no_bar_and_the_handlers_untouched(monkeypatch):
    err, h, root = _console(monkeypatch, terminal=False)
    with showing_progress(3, desc="work", unit="item") as bar:
        assert root.handlers == [h]
        bar.update(3)
        logging.getLogger("dflash_trainer.test").info("plain line")
    assert err.getvalue() == "LOG plain line\n"


def test_training_with_the_bar_restores_the_handlers(tmp_path, monkeypatch):
    err, h, root = _console(monkeypatch)
    cfg = tiny_config(tmp_path, **{"metrics.console": True, "optim.max_steps": 3})
    train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert root.handlers == [h]
    assert _drawn(err.getvalue(), "train", "step"), err.getvalue()


# ------------------------------------------------------------------------ the long loops


def test_tokenization_bar_counts_conversations_and_changes_nothing(
    monkeypatch, chatml_tokenizer, tmp_path
):
    from dflash_trainer.config import DataConfig

    cfg = DataConfig(max_length=64, overlong="truncate", min_supervised=2)
    err, _, _ = _console(monkeypatch)
    shown = build_dataset(cfg, chatml_tokenizer, _convs(12), cache_dir=tmp_path / "a")
    assert _drawn(err.getvalue(), "tokenize", "conversation"), err.getvalue()
    assert "12/12" in err.getvalue() and f"tokens={shown.stats['tokens']}" in err.getvalue()
    err, _, _ = _console(monkeypatch)
    quiet = build_dataset(
        cfg, chatml_tokenizer, _convs(12), cache_dir=tmp_path / "b", progress=False
    )
    assert not _any_bar(err.getvalue())
    assert quiet.ids == shown.ids and quiet.stats == shown.stats
    assert all((a == b).all() for a, b in zip(quiet.input_ids, shown.input_ids))
    assert all((a == b).all() for a, b in zip(quiet.loss_mask, shown.loss_mask))


def _decoded(summary) -> list:
    return [(r.tokens, r.acceptance_lengths) for r in summary.spec_results + summary.ar_results]


@pytest.mark.usefixtures("one_thread")
def test_evaluation_bars_leave_the_results_unchanged(monkeypatch):
    model = hf_target("llama", seed=4)
    t = side(model)
    drafter = _real_drafter(model, block_size=4)
    g = torch.Generator().manual_seed(3)
    prompts = [random_prompt(g, 4, 10) for _ in range(3)]
    seqs = [
        (f"r{i}", p[0].tolist() + ar_generate(model, p, 10).tokens, p.shape[1])
        for i, p in enumerate(prompts)
    ]

    def run_all():
        s = ev.evaluate(t, drafter, prompts, 10, 4, progress=progress)
        sim = TauSim(t, seqs).run(drafter, 10, 4, progress=progress)
        return _decoded(s), s.tau, sim.acceptance_lengths, sim.keys

    progress = True
    err, _, _ = _console(monkeypatch)
    shown = run_all()
    out = err.getvalue()
    assert _drawn(out, "eval", "prompt") and _drawn(out, "tau_sim", "prompt"), out
    progress = False
    err, _, _ = _console(monkeypatch)
    assert run_all() == shown and not _any_bar(err.getvalue())
    assert shown[3] == ["r0", "r1", "r2"]  # tau_sim's keys follow its acceptance lengths


@pytest.mark.usefixtures("one_thread")
def test_conversation_bar_counts_conversations_and_changes_nothing(monkeypatch):
    model = hf_target("llama", seed=2)
    target = TargetModel.from_hf(model, FakeTokenizer(), [0, 2])
    drafter = _real_drafter(model, block_size=4)
    convs = [
        ("a", [{"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]),
        ("b", [{"role": "user", "content": "hello"}]),
    ]
    err, _, _ = _console(monkeypatch)
    shown = ev.run_conversations(target, drafter, convs, 6, 4, None, Rendering(), desc="eval x")
    out = err.getvalue()
    # one bar over conversations (2), none per turn (3 turns)
    assert _drawn(out, "eval x", "conversation") and "2/2" in out and "/1 [" not in out, out
    err, _, _ = _console(monkeypatch)
    quiet = ev.run_conversations(target, drafter, convs, 6, 4, None, Rendering(), progress=False)
    assert not _any_bar(err.getvalue()) and _decoded(quiet) == _decoded(shown)


@pytest.mark.usefixtures("one_thread")
def test_reference_loop_bar(monkeypatch, tmp_path):
    pytest.importorskip("dflash.model")
    model = hf_target("llama", seed=5)
    drafter = _real_drafter(model, block_size=4)
    out_dir = export_drafter(drafter, tmp_path / "export")
    g = torch.Generator().manual_seed(1)
    prompts = [random_prompt(g, 4, 10)[0].tolist() for _ in range(2)]
    err, _, _ = _console(monkeypatch)
    shown = reference_tau(out_dir, model, prompts, 8, 4)
    assert _drawn(err.getvalue(), "reference", "prompt"), err.getvalue()
    err, _, _ = _console(monkeypatch)
    assert reference_tau(out_dir, model, prompts, 8, 4, progress=False) == shown
    assert not _drawn(err.getvalue(), "reference", "prompt")  # (transformers draws its own)


@pytest.mark.usefixtures("one_thread")
def test_periodic_evaluation_draws_no_bar_the_final_one_does(monkeypatch, tmp_path):
    """Periodic evaluation runs between training steps, under the training bar: no bar. The
    end-of-run one follows metrics.console."""
    cfg = tiny_config(
        tmp_path, **{"metrics.console": True, "eval.max_new_tokens": 4, "eval.periodic_prompts": 2}
    )
    target = tiny_target()
    ev = evaluation.PeriodicEval(
        cfg,
        target,
        build_drafter(cfg, target, "cpu"),
        tiny_dataset(n=8, max_len=40),
        tmp_path,
        threading.Lock(),
    )
    assert ev.periodic and ev.report
    err, _, _ = _console(monkeypatch)
    assert ev.run(1)["eval/set"] == "validation"
    assert not _any_bar(err.getvalue())
    assert ev.final(1)["eval/set"] == "heldout"
    out = err.getvalue()
    assert _drawn(out, "eval", "prompt") and _drawn(out, "tau_sim", "prompt"), out
    cfg.metrics.console = False
    err, _, _ = _console(monkeypatch)
    ev.final(1)
    assert not _any_bar(err.getvalue())
