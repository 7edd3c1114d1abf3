"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a file, a config value, a model path.

    The message says what is wrong, where, and how to fix it; no traceback is shown.
    """

    exit_code = 2


class DataError(UserError):
    """A dataset file is malformed: names the file and the 1-based line number."""

    def __init__(self, path: object, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {problem}")
        self.path, self.line, self.problem = path, line, problem


class ConfigError(UserError):
    """A config file or override is invalid (unknown key, wrong type, bad value)."""
