"""One-line input errors and the typed JSON reader every checkpoint and input parser uses.

Bad input is a CheckpointError: one line, naming the file and the field (conftest turns it into a
usage error, exit code 4). A knob a format cannot express is a ConversionError, never dropped.
"""
from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """Bad input: one line naming the file and the field."""

    def __init__(self, file: str | Path, field: str, problem: str):
        self.file, self.field, self.problem = str(file), field, problem
        super().__init__(f"{self.file}: {field}: {problem}")


class ConversionError(ValueError):
    """A knob the target format cannot express (raised instead of dropping it silently)."""


def load_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(path, "file", "missing")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise CheckpointError(path, "file", "empty file")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(path, f"line {exc.lineno}", f"not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, "file", f"expected a JSON object, got {type(raw).__name__}")
    return raw


class Fields:
    """Typed lookups in one JSON object, with errors that name the file and the dotted field."""

    def __init__(self, raw: dict, file: Path, prefix: str = ""):
        self.raw, self.file, self.prefix = raw, file, prefix

    def _err(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(self.file, f"field {self.prefix}{key}", problem)

    def _missing(self, key: str) -> CheckpointError:
        return CheckpointError(self.file, f"missing field {self.prefix}{key}", "required")

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def int(self, key: str, default=None, minimum: int = 1):
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._err(key, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str, default=None):
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self._err(key, f"expected a positive number, got {value!r}")
        return value

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._err(key, f"expected true or false, got {value!r}")
        return value

    def ids(self, key: str):
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not value or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise self._err(key, f"expected a non-empty list of integers, got {value!r}")
        return value

    def sub(self, key: str, required: bool = False) -> "Fields | None":
        value = self.raw.get(key)
        if value is None:
            if required:
                raise self._missing(key)
            return None
        if not isinstance(value, dict):
            raise self._err(key, f"expected an object, got {value!r}")
        return Fields(value, self.file, f"{self.prefix}{key}.")
