"""attrs validators of the library's configs: a bad value raises :class:`ConfigError`.

One error type for one kind of misuse, whichever config it is (``ConfigError`` is a
``ValueError``, so ``except ValueError`` keeps working). Messages name the field and the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection
from typing import Any

import attrs

from ._errors import ConfigError

__all__ = [
    "COMPRESSION_SCHEMES",
    "at_least",
    "compression_scheme",
    "in_range",
    "non_negative",
    "non_negative_or_none",
    "one_of",
    "positive",
    "positive_or_none",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _is_number(value: object) -> bool:
    # numpy's scalars count; True and False do not.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """A number > 0."""
    if not (_is_number(value) and value > 0):
        raise ConfigError(f"{attribute.name} must be positive, got {value!r}")


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """A finite number >= 0."""
    if not (_is_number(value) and 0 <= value < math.inf):
        raise ConfigError(f"{attribute.name} must be a number >= 0, got {value!r}")


def positive_or_none(
    instance: object, attribute: attrs.Attribute[Any], value: float | None
) -> None:
    """None, or a number > 0."""
    if value is not None and not (_is_number(value) and value > 0):
        raise ConfigError(f"{attribute.name} must be > 0 or None, got {value!r}")


def non_negative_or_none(
    instance: object, attribute: attrs.Attribute[Any], value: float | None
) -> None:
    """None, or a finite number >= 0."""
    if value is not None:
        non_negative(instance, attribute, value)


def at_least(minimum: float) -> Validator:
    """A number >= ``minimum``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not (_is_number(value) and value >= minimum):
            raise ConfigError(f"{attribute.name} must be >= {minimum}, got {value!r}")

    return check


def in_range(minimum: float, maximum: float) -> Validator:
    """A number in ``[minimum, maximum]``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not (_is_number(value) and minimum <= value <= maximum):
            raise ConfigError(
                f"{attribute.name} must be >= {minimum} and <= {maximum}, got {value!r}"
            )

    return check


def one_of(choices: Collection[object]) -> Validator:
    """One of ``choices``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ConfigError(
                f"{attribute.name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
            )

    return check


#: How tensors may travel compressed (``petals_core.transport.SCHEMES``), and None: as they are.
COMPRESSION_SCHEMES = ("float16", "blockwise8")


def compression_scheme(value: object) -> str | None:
    """A config's ``compression`` (attrs converter): None or ``"none"`` (as they are),
    ``"float16"`` or ``"blockwise8"``; :class:`ConfigError` for anything else."""
    if value is None or value == "none":
        return None
    if value not in COMPRESSION_SCHEMES:
        raise ConfigError(
            f"compression is one of none, {', '.join(COMPRESSION_SCHEMES)}, not {value!r}"
        )
    return str(value)
