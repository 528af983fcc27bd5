"""One-line input errors and the typed JSON reader every checkpoint and input parser uses.

Bad input is a CheckpointError: one line, naming the file and the field (conftest turns it into a
usage error, exit code 4). A knob a format cannot express is a ConversionError, never dropped.
"""
from __future__ import annotations

import json
import math
import reprlib
from pathlib import Path

# The largest integer a config field may hold: no dimension, count or context of a model comes near it, and
# larger ones overflow the int64 a tensor shape or index is.
MAX_INT = 2 ** 31 - 1


class CheckpointError(ValueError):
    """Bad input: one line naming the file and the field."""

    def __init__(self, file: str | Path, field: str, problem: str):
        self.file, self.field, self.problem = str(file), field, problem
        super().__init__(f"{self.file}: {field}: {problem}")


class ConversionError(ValueError):
    """A knob the target format cannot express (raised instead of dropping it silently)."""


class _NotANumber:
    """Where Python's JSON reader met NaN, Infinity or -Infinity: not JSON, and no implementation can use it."""

    def __init__(self, text: str):
        self.text = text


def parse_json(text: str, path: Path, line: int | None = None):
    """json.loads, with every way it can refuse a text as one CheckpointError naming the file and the line
    (`line`: the text's line in the file, for one JSONL line) or, for NaN / Infinity, the field."""
    try:
        value = json.loads(text, parse_constant=_NotANumber)
    except json.JSONDecodeError as exc:
        at = line if line is not None else exc.lineno
        column = f" at column {exc.colno}" if line is not None else ""
        raise CheckpointError(path, f"line {at}", f"not valid JSON ({exc.msg}{column})") from None
    except RecursionError:   # json's C scanner recurses once per nesting level
        raise CheckpointError(path, f"line {line or 1}", "not valid JSON here (nested too deeply)") from None
    found = _not_a_number(value)
    if found is not None:
        field, constant = found
        problem = f"{constant} is not a JSON number (no implementation can use it)"
        if line is not None:   # one JSONL line: the line, then the field in it
            raise CheckpointError(path, f"line {line}", f"{field}: {problem}" if field else problem)
        raise CheckpointError(path, f"field {field}" if field else "line 1", problem)
    return value


def _not_a_number(value) -> tuple[str, str] | None:
    """(dotted field, NaN / Infinity) of the first non-JSON number in a parsed value, else None."""
    todo = [("", value)]
    while todo:   # depth first, without recursion: the parsed value may be deep
        where, node = todo.pop()
        if isinstance(node, _NotANumber):
            return where, node.text
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        todo += reversed([(f"{where}.{k}" if where else str(k), v) if isinstance(node, dict)
                          else (f"{where}[{k}]", v) for k, v in items])
    return None


def load_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(path, "file", "missing")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise CheckpointError(path, "file", "empty file")
    raw = parse_json(text, path)
    if not isinstance(raw, dict):
        raise CheckpointError(path, "file", f"expected a JSON object, got {type(raw).__name__}")
    return raw


# The deepest target layer an aux id may name: no model has this many layers (a tiny target for the draft's
# inputs is built that deep, conformance/checkpoints/hidden_states.py).
MAX_LAYER = 1024


_REPR = reprlib.Repr()   # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 4, 40, 40


def short(value) -> str:
    """A value as an error message quotes it: its repr, bounded in depth and length (a parsed value can be
    long, or nested as deep as the JSON reader allows), on one line."""
    text = _REPR.repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


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

    def int(self, key: str, default=None, minimum: int = 1, maximum: int = MAX_INT):
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._err(key, f"expected an integer >= {minimum}, got {short(value)}")
        if value > maximum:
            raise self._err(key, f"{short(value)} is absurdly large (at most {maximum})")
        return value

    def number(self, key: str, default=None, zero: bool = False):
        """A positive (`zero`: non-negative) finite number."""
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero):
            raise self._err(key, f"expected a {'non-negative' if zero else 'positive'} number, got {short(value)}")
        if not math.isfinite(value):   # 1e999 reads as inf
            raise self._err(key, f"{value!r} is not a finite number")
        return value

    def optional_number(self, key: str, zero: bool = False):
        return self.number(key, zero=zero) if self.has(key) else None

    def string(self, key: str, default: str | None = None) -> str:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if not isinstance(value, str):
            raise self._err(key, f"expected a string, got {short(value)}")
        return value

    def strings(self, key: str) -> list[str] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._err(key, f"expected a list of strings, got {short(value)}")
        return value

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._err(key, f"expected true or false, got {value!r}")
        return value

    def ids(self, key: str, minimum: int = 0, maximum: int = MAX_LAYER):
        """A non-empty list of layer ids, each in [minimum, maximum]."""
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not value or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise self._err(key, f"expected a non-empty list of integers, got {short(value)}")
        if not all(minimum <= i <= maximum for i in value):
            bad = next(i for i in value if not minimum <= i <= maximum)
            raise self._err(key, f"layer id {bad} is outside [{minimum}, {maximum}]")
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
