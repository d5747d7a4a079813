"""Errors a user can act on.

`MempoError` carries where the problem is (file, row, field) so the CLI prints one clear
line and exits non-zero; `--verbose` shows the traceback.
"""

from __future__ import annotations

from pathlib import Path


class MempoError(Exception):
    """A problem with the user's input or environment, reported as one line.

    Args:
        message: what is wrong and, if possible, what to do about it.
        path: the file involved.
        row: 1-based line or row number in that file.
        field: the field or key involved.
    """

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        row: int | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.path = None if path is None else str(path)
        self.row = row
        self.field = field
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = []
        if self.path is not None:
            where.append(self.path if self.row is None else f"{self.path}:{self.row}")
        elif self.row is not None:
            where.append(f"row {self.row}")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        prefix = " ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message


class DataError(MempoError):
    """Malformed input data (a corpus line, a QA row, a parquet column)."""


class ConfigError(MempoError):
    """An invalid params.yaml key, type or value, or a bad CLI override."""


class ValidationFailed(MempoError):
    """A data contract (Great Expectations suite) failed; nothing downstream may run."""

    exit_code = 3
