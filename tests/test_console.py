"""Console log lines never collide with the training progress bar: while it is shown they go
through tqdm.write, at the console handler's level; afterwards the handlers are as before."""

import io
import logging
import sys

from tqdm import tqdm

from dflash_trainer.run import train
from dflash_trainer.run.trainer import console_above_bar
from tiny import tiny_config, tiny_dataset, tiny_target


def _console(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.INFO)
    h.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h])
    monkeypatch.setattr(root, "level", logging.DEBUG)
    return err, h, root


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
    lines = [l for l in out.replace("\r", "\n").split("\n") if "checkpoint written" in l]
    assert lines == ["LOG checkpoint written"], out


def test_no_bar_no_change(monkeypatch):
    _, h, root = _console(monkeypatch)
    stack = console_above_bar(None)
    assert root.handlers == [h]
    stack.close()


def test_training_with_the_bar_restores_the_handlers(tmp_path, monkeypatch):
    err, h, root = _console(monkeypatch)
    cfg = tiny_config(tmp_path, **{"metrics.console": True, "optim.max_steps": 3})
    train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert root.handlers == [h]
    assert "train" in err.getvalue()
