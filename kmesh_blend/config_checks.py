"""Validation of single ``kmesh.*`` values: each check names the key, the bad value and what is
valid (the settings themselves, and their defaults, live in `kmesh_blend.config`)."""

from __future__ import annotations

from typing import NoReturn

from kmesh_blend.rules import ratio_problem

STORE_VALID = "'cpu', 'disk:///ABS/PATH', 'lm://HOST:PORT' or 'redis://HOST:PORT'"
_RATIO_VALID = "a number in [0, 1] (float, or int 0/1; not bool)"
_LAYERS_VALID = (
    "a non-empty, strictly increasing list of distinct non-negative ints (or a string like '1,3')"
)


class ConfigError(ValueError):
    """A bad kmesh setting; the message names the key, the bad value and what is valid."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


def fail(key: str, value: object, reason: str, valid: str) -> NoReturn:
    """Raise the :class:`ConfigError` for ``key``."""
    raise ConfigError(f"invalid {key}={value!r}: {reason}; valid: {valid}", key=key)


def parse_host_port(value: str, rest: str) -> tuple[str, int]:
    """``HOST:PORT`` of a ``kmesh.store`` address (``value`` is the whole address)."""
    host, sep, port = rest.rpartition(":")
    if not sep:
        fail("kmesh.store", value, "missing ':PORT'", STORE_VALID)
    if not host or "/" in host or any(c.isspace() for c in host):
        fail("kmesh.store", value, "host must be non-empty", STORE_VALID)
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        fail("kmesh.store", value, "port must be an int in 1..65535", STORE_VALID)
    return host, int(port)


def check_ratio(value: object) -> float:
    """``kmesh.recompute_ratio`` as a float in [0, 1]."""
    problem = ratio_problem(value)
    if problem is not None:
        fail("kmesh.recompute_ratio", value, problem, _RATIO_VALID)
    return float(value)  # type: ignore[arg-type]


def check_layers(value: object) -> tuple[int, ...]:
    """``kmesh.check_layers`` from a list or a ``'1,3'`` string."""
    key = "kmesh.check_layers"
    items: list[object]
    if isinstance(value, str):
        try:
            items = [int(part) for part in value.split(",")] if value.strip() else []
        except ValueError:
            fail(key, value, "not a comma-separated list of ints", _LAYERS_VALID)
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        fail(key, value, "not a list", _LAYERS_VALID)
    if not items:
        fail(key, value, "empty", _LAYERS_VALID)
    layers: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            fail(key, value, f"entry {item!r} is not a non-negative int", _LAYERS_VALID)
        layers.append(item)
    if len(set(layers)) != len(layers):
        fail(key, value, "duplicate layers", _LAYERS_VALID)
    if layers != sorted(layers):
        fail(key, value, "not strictly increasing", _LAYERS_VALID)
    return tuple(layers)


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        fail(key, value, "unknown choice", "one of " + ", ".join(repr(c) for c in choices))
    return value


def check_int(key: str, value: object, minimum: int) -> None:
    """An int (not bool) ≥ ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(key, value, f"not an int ≥ {minimum}", f"an int ≥ {minimum}")


def check_bool(key: str, value: object) -> None:
    """A real bool (``1`` or ``"true"`` are refused: a typo should not turn a feature on)."""
    if not isinstance(value, bool):
        fail(key, value, "not a bool", "true or false")


def check_seconds(key: str, value: object) -> float:
    """A positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        fail(key, value, "not a positive number", "seconds > 0")
    return float(value)


def check_separator(value: object) -> tuple[int, ...]:
    """``kmesh.separator`` token ids from a list or a ``'1,2'`` string; empty = off."""
    key, valid = "kmesh.separator", "a list of token ids (non-negative ints), or '' / [] for off"
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split(",")] if value.strip() else []
        except ValueError:
            fail(key, value, "not a comma-separated list of ints", valid)
    if not isinstance(value, list | tuple):
        fail(key, value, "not a list", valid)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            fail(key, value, f"entry {item!r} is not a token id", valid)
    return tuple(value)
