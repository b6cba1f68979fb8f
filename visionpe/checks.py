"""Argument checks shared by every scheme: one wording for "what was expected, what was given".

Each check returns the value (converted where it says so) or raises:

- :class:`ArgumentTypeError` when the value has the wrong type (a bool is not an int, nor a number). It is a
  :class:`TypeError`, and also a :class:`ValueError`, so that callers written when these checks raised ValueError
  for every bad argument keep catching it;
- :class:`ValueError` when the type is right but the value is not (out of range, NaN, not one of the choices).

Messages name the argument, what was expected and what was given::

    <name> must be <expected>, got <type> (<repr>)      wrong type
    <name> must be <expected>, got <repr>               bad value

``expected`` has a default built from the constraints (``"a positive int"``, ``"a number in (0, 360]"``); a caller
may pass its own phrase, and ``type_expected`` for a different phrase in the wrong-type message (e.g. ``"a number"``
when the value message says ``"positive and finite"``).

The checks cost a few ``isinstance`` tests and format their messages only on failure, so they also run on the
per-block paths and under ``torch.compile``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch

__all__ = [
    "ArgumentTypeError",
    "check_bool",
    "check_choice",
    "check_float",
    "check_instance",
    "check_int",
    "check_positive",
    "check_tensor",
    "describe",
    "is_int",
    "is_number",
]

_MAX_REPR = 80


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError that is also a ValueError (see the module docstring)."""


def describe(value: Any) -> str:
    """``type (repr)`` of a value, the "given" part of a wrong-type message; long reprs are shortened.

    Example:
        >>> describe(2.5), describe("64"), describe(True)
        ('float (2.5)', "str ('64')", 'bool (True)')
        >>> describe(torch.zeros(2, 3, dtype=torch.int64))
        'Tensor (shape (2, 3), dtype torch.int64)'
    """
    if isinstance(value, torch.Tensor):
        return f"Tensor (shape {tuple(value.shape)}, dtype {value.dtype})"
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 3] + "..."
    return f"{type(value).__name__} ({text})"


def _type_error(name: str, expected: str, value: Any) -> ArgumentTypeError:
    return ArgumentTypeError(f"{name} must be {expected}, got {describe(value)}")


def is_int(value: Any) -> bool:
    """True for a Python int that is not a bool: the test inside :func:`check_int`, for combined conditions.

    Example:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a Python int or float that is not a bool: the type test inside :func:`check_float`.

    Example:
        >>> is_number(0.5), is_number(2), is_number(False), is_number("1")
        (True, True, False, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_instance(value: Any, name: str, types: type | tuple[type, ...], *, expected: str) -> Any:
    """``value`` if it is an instance of ``types``; a bool passes only when ``bool`` is listed (not for ``int``).

    Example:
        >>> check_instance("rope_axial", "scheme name", str, expected="a str")
        'rope_axial'
        >>> check_instance(5, "allocation", (str, dict), expected="a name or a dict")
        Traceback (most recent call last):
        ...
        visionpe.checks.ArgumentTypeError: allocation must be a name or a dict, got int (5)
    """
    listed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, listed) or (isinstance(value, bool) and bool not in listed):
        raise _type_error(name, expected, value)
    return value


def check_bool(value: Any, name: str, *, expected: str = "a bool") -> bool:
    """``value`` if it is a bool (not an int such as 0 or 1, nor a NumPy or tensor bool).

    Example:
        >>> check_bool(True, "shared_heads")
        True
        >>> check_bool(1, "shared_heads")
        Traceback (most recent call last):
        ...
        visionpe.checks.ArgumentTypeError: shared_heads must be a bool, got int (1)
    """
    if not isinstance(value, bool):
        raise _type_error(name, expected, value)
    return value


def _int_phrase(min: int | None, max: int | None) -> str:
    if min is not None and max is not None:
        return f"an int in [{min}, {max}]"
    if min == 1:
        return "a positive int"
    if min == 0:
        return "a non-negative int"
    if min is not None:
        return f"an int >= {min}"
    return "an int" if max is None else f"an int <= {max}"


def check_int(
    value: Any,
    name: str,
    *,
    min: int | None = None,
    max: int | None = None,
    expected: str | None = None,
    type_expected: str | None = None,
) -> int:
    """``value`` if it is a Python int (not a bool) in ``[min, max]`` (either bound may be None).

    Args:
        value: the argument to check.
        name: its name in the message, e.g. ``"num_heads"`` or ``"head_slopes[3]"``.
        min, max: inclusive bounds.
        expected: the phrase after "must be"; by default built from the bounds (``min=1``: "a positive int",
            ``min=0``: "a non-negative int", both: "an int in [min, max]").
        type_expected: the phrase of the wrong-type message, ``expected`` by default.

    Example:
        >>> check_int(6, "num_heads", min=1)
        6
        >>> check_int(0, "num_heads", min=1)
        Traceback (most recent call last):
        ...
        ValueError: num_heads must be a positive int, got 0
        >>> check_int(2.0, "depth", min=1)
        Traceback (most recent call last):
        ...
        visionpe.checks.ArgumentTypeError: depth must be a positive int, got float (2.0)
    """
    if not is_int(value):
        raise _type_error(name, type_expected or expected or _int_phrase(min, max), value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise ValueError(f"{name} must be {expected or _int_phrase(min, max)}, got {value!r}")
    return value


def _float_phrase(min: float | None, max: float | None, min_open: bool, max_open: bool, finite: bool) -> str:
    if min == 0 and min_open and max is None:
        return "a positive finite number" if finite else "a positive number"
    if min is not None and max is not None:
        return f"a number in {'(' if min_open else '['}{min}, {max}{')' if max_open else ']'}"
    what = "a finite number" if finite else "a number"
    if min is not None:
        return f"{what} {'>' if min_open else '>='} {min}"
    if max is not None:
        return f"{what} {'<' if max_open else '<='} {max}"
    return what


def check_float(
    value: Any,
    name: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    max_open: bool = False,
    finite: bool = True,
    expected: str | None = None,
    type_expected: str | None = None,
) -> float:
    """``value`` as a float if it is a real number (int or float, not a bool) within the bounds; NaN never passes,
    and inf only with ``finite=False``.

    Args:
        value: the argument to check.
        name: its name in the message.
        min, max: bounds, inclusive unless ``min_open`` / ``max_open``.
        finite: reject +-inf (default).
        expected: the phrase after "must be"; by default built from the bounds ("a finite number",
            "a positive finite number" for ``min=0, min_open=True``, "a number in (0, 360]").
        type_expected: the phrase of the wrong-type message, ``expected`` by default.

    Example:
        >>> check_float(3, "fov", min=0, max=360, min_open=True)
        3.0
        >>> check_float(float("nan"), "gamma", min=0, min_open=True)
        Traceback (most recent call last):
        ...
        ValueError: gamma must be a positive finite number, got nan
        >>> check_float("2", "tokens_per_second", min=0, min_open=True, type_expected="a number")
        Traceback (most recent call last):
        ...
        visionpe.checks.ArgumentTypeError: tokens_per_second must be a number, got str ('2')
    """
    if not is_number(value):
        phrase = type_expected or expected or _float_phrase(min, max, min_open, max_open, finite)
        raise _type_error(name, phrase, value)
    ok = not math.isnan(value) and (not finite or math.isfinite(value))
    if ok and min is not None:
        ok = value > min if min_open else value >= min
    if ok and max is not None:
        ok = value < max if max_open else value <= max
    if not ok:
        raise ValueError(
            f"{name} must be {expected or _float_phrase(min, max, min_open, max_open, finite)}, got {value!r}"
        )
    return float(value)


def check_positive(value: Any, name: str, *, expected: str | None = None, type_expected: str | None = None) -> float:
    """``value`` as a float if it is a positive finite number (int or float, not a bool).

    Example:
        >>> check_positive(2, "ratio")
        2.0
        >>> check_positive(float("inf"), "global_slope")
        Traceback (most recent call last):
        ...
        ValueError: global_slope must be a positive finite number, got inf
    """
    return check_float(value, name, min=0, min_open=True, expected=expected, type_expected=type_expected)


def check_choice(value: Any, name: str, choices: Collection[Any], *, expected: str | None = None) -> Any:
    """``value`` if it is one of ``choices`` (``value in choices``), else a ValueError listing them.

    Example:
        >>> check_choice("90", "LookHere variant", ("180", "90", "45"))
        '90'
        >>> check_choice("60", "LookHere variant", ("180", "90", "45"))
        Traceback (most recent call last):
        ...
        ValueError: LookHere variant must be one of ('180', '90', '45'), got '60'
    """
    options = tuple(choices)
    try:
        found = value in options
    except (TypeError, ValueError, RuntimeError):  # e.g. a multi-element tensor or array
        found = False
    if not found:
        raise ValueError(f"{name} must be {expected or f'one of {options}'}, got {value!r}")
    return value


_DTYPE_KINDS = {
    None: ("a torch.Tensor", lambda t: True),
    "floating": ("a floating-point tensor", lambda t: t.is_floating_point()),
    "real": ("a real (integer or floating-point) tensor", lambda t: not (t.is_complex() or t.dtype == torch.bool)),
    "integer": (
        "an integer tensor",
        lambda t: not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool),
    ),
}


def check_tensor(value: Any, name: str, *, dtype: str | None = None, expected: str | None = None) -> torch.Tensor:
    """``value`` if it is a tensor whose dtype is of the kind ``dtype``.

    Args:
        value: the argument to check.
        name: its name in the message.
        dtype: None (any), ``"floating"``, ``"real"`` (integer or floating point; not bool or complex) or
            ``"integer"`` (not bool).
        expected: the phrase after "must be" in both messages (not a tensor: ``got <type> (<repr>)``; wrong
            dtype: ``got dtype <dtype>``), by default "a torch.Tensor", "a floating-point tensor", ...

    Example:
        >>> check_tensor(torch.zeros(2), "x", dtype="floating").shape
        torch.Size([2])
        >>> check_tensor(torch.arange(3), "x", dtype="floating")
        Traceback (most recent call last):
        ...
        visionpe.checks.ArgumentTypeError: x must be a floating-point tensor, got dtype torch.int64
    """
    if dtype not in _DTYPE_KINDS:
        raise ValueError(f"dtype must be one of {tuple(_DTYPE_KINDS)}, got {dtype!r}")
    phrase, fits = _DTYPE_KINDS[dtype]
    if not isinstance(value, torch.Tensor):
        raise _type_error(name, expected or phrase, value)
    if not fits(value):
        raise ArgumentTypeError(f"{name} must be {expected or phrase}, got dtype {value.dtype}")
    return value


def check_block_tokens(
    tokens: Any, scheme: str, num_tokens: int, dim: int, *, batch: int | None = None
) -> torch.Tensor:
    """``tokens`` if it is the floating-point (B, ``num_tokens``, ``dim``) input of a block, which a bias computed
    from content (``scheme`` names it in the message) reads; B must equal ``batch`` where given.

    Example:
        >>> check_block_tokens(torch.zeros(2, 5, 8), "Cable", 5, 8, batch=2).shape
        torch.Size([2, 5, 8])
        >>> check_block_tokens(None, "Cable", 5, 8)
        Traceback (most recent call last):
        ...
        ValueError: Cable computes its bias from the block's tokens: pass tokens=(B, 5, 8)
    """
    if tokens is None:
        raise ValueError(f"{scheme} computes its bias from the block's tokens: pass tokens=(B, {num_tokens}, {dim})")
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a tensor, got {type(tokens).__name__}")
    shape_ok = tokens.ndim == 3 and tokens.shape[1:] == (num_tokens, dim)
    if not shape_ok or (batch is not None and tokens.shape[0] != batch) or not tokens.is_floating_point():
        raise ValueError(
            f"tokens must be a floating-point (B={'B' if batch is None else batch}, {num_tokens}, {dim}) tensor, "
            f"got shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
        )
    return tokens
