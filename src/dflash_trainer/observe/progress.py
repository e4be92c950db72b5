"""Progress bars: the one way every long loop shows one (training steps, tokenization,
generation, evaluation), and console log lines routed above a shown bar.

A bar is drawn on stderr only when the caller wants it (`metrics.console` for commands and
training) and stderr is a terminal. In a log file or a pipe every redraw would be text, so there
the same progress becomes a log line at most every `LINE_EVERY_S` seconds (count, elapsed, time
left, rate) and one when a loop that logged finishes: a demo piped to a file is never silent for
minutes. Loops that run inside training's step path show neither (periodic evaluation passes
enabled=False); training itself logs its own lines (observe/monitor.py), so its bar asks for none.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

log = logging.getLogger(__name__)

# Where stderr is not a terminal: a progress line at most this often (and one at the end).
LINE_EVERY_S = 30.0


class _Discard:
    """The file of a bar that draws nothing (tqdm still ends a closed bar with a newline)."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class LogLines(tqdm):
    """A bar that draws nothing: when it advances, its state goes to the log as one line at
    most every `interval` seconds, and a last line when it closes if it logged before."""

    monitor_interval = 0  # no tqdm monitor thread: nothing is redrawn

    def __init__(self, *args, interval: float, initial: int = 0, **kwargs):
        self._interval, self._logged, self._closing = interval, 0, False
        self._line_t, self._line_n = time.monotonic(), initial
        kwargs.update(file=_Discard(), mininterval=0, miniters=1, leave=True)
        super().__init__(*args, initial=initial, **kwargs)

    def display(self, msg=None, pos=None) -> bool:
        """tqdm's redraw (each update and postfix): a line when due."""
        due = time.monotonic() - self._line_t >= self._interval
        if not self._closing and self.n != self._line_n and due:
            self._line()
        return True

    def close(self) -> None:
        if not self._closing and self._logged and self.n != self._line_n:
            self._line()
        self._closing = True
        super().close()

    def _line(self) -> None:
        d = self.format_dict
        shape = (
            "{desc}: {n_fmt}/{total_fmt} {unit}s [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
            if d["total"]
            else "{desc}: {n_fmt} {unit}s [{elapsed}, {rate_fmt}{postfix}]"
        )
        log.info(self.format_meter(**{**d, "bar_format": shape}))
        self._logged += 1
        self._line_t, self._line_n = time.monotonic(), self.n


def progress_bar(
    total: int | None = None,
    *,
    desc: str,
    unit: str,
    enabled: bool = True,
    initial: int = 0,
    lines: bool = True,
) -> tqdm:
    """A tqdm bar on stderr counting `unit`s when `enabled` and stderr is a terminal; elsewhere,
    if `enabled` and `lines`, a LogLines bar (a log line every LINE_EVERY_S seconds); otherwise
    a no-op bar (`.disable` set). leave=None: a bar drawn under another (the end-of-run
    evaluation under the training bar) is erased when done, a bar on its own stays."""
    if enabled and lines and not _terminal():
        return LogLines(total=total, initial=initial, desc=desc, unit=unit, interval=LINE_EVERY_S)
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=sys.stderr,  # looked up per call: a redirected stderr is the one used
        dynamic_ncols=True,
        leave=None,
        disable=None if enabled else True,  # None: tqdm disables it when file is not a TTY
    )


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def console_above_bar(bar) -> contextlib.ExitStack:
    """While `bar` is shown, console log lines go through tqdm.write: printed above the bar,
    never through it (tqdm's logging_redirect_tqdm, at the console handlers' own level so DEBUG
    stays in the run log). File handlers are untouched. Close the returned stack to restore.

    Nothing changes when no bar is shown, or when the console handlers are already redirected
    (a bar opened while the training bar is shown: the handler in place is tqdm's)."""
    stack = contextlib.ExitStack()
    root = logging.getLogger()
    console = [
        h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
    ]
    if bar is None or bar.disable or isinstance(bar, LogLines) or not console:
        return stack
    from tqdm.contrib.logging import logging_redirect_tqdm

    before = list(root.handlers)
    stack.enter_context(logging_redirect_tqdm(tqdm_class=type(bar)))
    for h in root.handlers:
        if h not in before:
            h.setLevel(min(c.level for c in console))
    return stack


@contextlib.contextmanager
def showing_progress(
    total: int | None = None, *, desc: str, unit: str, enabled: bool = True, initial: int = 0
) -> Iterator[tqdm]:
    """`progress_bar` with console log lines above it for the duration; closed on exit."""
    bar = progress_bar(total, desc=desc, unit=unit, enabled=enabled, initial=initial)
    with console_above_bar(bar), contextlib.closing(bar):
        yield bar


class Phases:
    """Wall seconds per phase of a long command (the demo, `make quality`), in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.monotonic()

    def end(self, name: str) -> float:
        """Phase `name` ran from the previous end until now."""
        now = time.monotonic()
        self.seconds[name] = round(now - self._t, 1)
        self._t = now
        return self.seconds[name]

    def carve(self, name: str, seconds: float, out_of: str) -> float:
        """`seconds` of phase `out_of` become phase `name` (train() ran the end-of-run
        evaluation: its seconds, from the eval/* record, move to their own phase)."""
        self.seconds[name] = round(float(seconds), 1)
        self.seconds[out_of] = round(self.seconds[out_of] - self.seconds[name], 1)
        return self.seconds[name]
