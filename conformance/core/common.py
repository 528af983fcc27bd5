"""Small helpers that several areas need, written once: one-line error text, id lookups, remembered results."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when the message is empty: errors
    and report cells stay on one line whatever the library raised."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def by_id(items: Iterable[T], what: str) -> dict[str, T]:
    """`item.id -> item`; ids appear in test ids and reports, so a repeated one is an error at import."""
    out: dict[str, T] = {}
    for item in items:
        if item.id in out:
            raise ValueError(f"{what} ids must be unique: {item.id!r} appears twice")
        out[item.id] = item
    return out


def remembered(memo: dict, key, compute: Callable[[], T], kept: type[BaseException] | tuple = ()) -> T:
    """`compute()` once per key: its result, or the exception of a `kept` class it raised, raised again on every
    later call (a refusal is as much a finding as a result, and as costly to observe again)."""
    if key not in memo:
        try:
            memo[key] = compute()
        except kept as exc:
            memo[key] = exc
    result = memo[key]
    if kept and isinstance(result, kept):
        raise result
    return result
