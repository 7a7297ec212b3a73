"""Argument checks the Python layer shares: numbers as callers pass them (Python or numpy
scalars, never bools) and the :class:`InputError` a bad setting raises."""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from .errors import InputError


def show(value: object, limit: int = 80) -> str:
    """``repr(value)``, shortened to ``limit`` characters for messages."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def as_int(value: object) -> Optional[int]:
    """``value`` as a Python int if it is an integer (numpy integers too; bools are not),
    otherwise None."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def as_number(value: object) -> Optional[float]:
    """``value`` as a Python float if it is a real number (ints, floats, numpy scalars;
    bools are not), otherwise None."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return float(value)
    return None


def refuse(name: str, rule: str, value: object) -> InputError:
    """The error for a setting that breaks its rule: ``"{name} must be {rule}, got {value!r}"``."""
    return InputError(f"{name} must be {rule}, got {show(value)}")


def check_int(name: str, value: object, *, minimum: int, rule: str) -> int:
    """``value`` as a Python int if it is an integer >= ``minimum``.

    Raises:
        InputError: otherwise, naming ``name``, ``rule`` and the value.
    """
    n = as_int(value)
    if n is None or n < minimum:
        raise refuse(name, rule, value)
    return n


def check_number(name: str, value: object, *, allowed: Callable[[float], bool], rule: str) -> float:
    """``value`` as a Python float if it is a finite real number for which ``allowed`` holds.

    Raises:
        InputError: otherwise, naming ``name``, ``rule`` and the value.
    """
    x = as_number(value)
    if x is None or not math.isfinite(x) or not allowed(x):
        raise refuse(name, rule, value)
    return x


def int_arg(value: object, name: str) -> int:
    """``value`` (an int or numpy integer, not a bool) as a Python int.

    Raises:
        TypeError: otherwise, naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def bool_arg(value: object, name: str) -> bool:
    """``value`` (a bool or numpy bool) as a Python bool: a flag given as anything else
    (``quantized="no"`` is truthy) raises rather than being taken for its truth value.

    Raises:
        TypeError: otherwise, naming ``name``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {show(value)}")
    return bool(value)
