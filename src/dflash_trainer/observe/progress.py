"""Progress bars: the one way every long loop shows one (training steps, tokenization,
generation, evaluation), and console log lines routed above a shown bar.

A bar is drawn on stderr only when the caller wants it (`metrics.console` for commands and
training) and stderr is a terminal: in a log file or a pipe every redraw would be text. Loops
that run inside training's step path never draw one (periodic evaluation passes enabled=False).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm


def progress_bar(
    total: int | None = None, *, desc: str, unit: str, enabled: bool = True, initial: int = 0
) -> tqdm:
    """A tqdm bar on stderr counting `unit`s; a no-op bar (`.disable` set) when `enabled` is
    False or stderr is not a terminal. leave=None: a bar drawn under another (the end-of-run
    evaluation under the training bar) is erased when done, a bar on its own stays."""
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
        if type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr)
    ]
    if bar is None or bar.disable or not console:
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
