"""Errors that reach the user as one clear message (what, where, what to do) and exit code 2.

Anything else is a bug or a fault: the CLI prints a short line and writes the traceback to the
run's log file.
"""


class UserError(Exception):
    """Bad input: data files, paths, checkpoints, models. The message names the file/line/field."""


class DataError(UserError):
    """A malformed data record or file."""
