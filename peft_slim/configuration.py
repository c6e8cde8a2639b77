"""Small checks the config dataclasses call in their ``__post_init__`` (each takes the field's name as the user sees
it and the value, returns the value, numpy numbers as Python's, or raises ``ValueError`` naming field, value and what
works); reading a saved config's fields; writing JSON atomically."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
import tempfile
import warnings
from typing import Any

from packaging.version import InvalidVersion, Version

from ._version import __version__

VERSION_KEY = "peft_slim_version"


def nearest(name: str, valid: list[str]) -> str:
    """' (did you mean `x`?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def fail(where: str, value: Any, expected: str, optional: bool = False, hint: str = ""):
    raise ValueError(f"{where} must be {expected}{' or None' if optional else ''}, got {value!r}{hint}.")


def check_int(
    where: str,
    value: Any,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
    multiple_of: int = 1,
) -> int | None:
    """An exact integer (numpy's too) in [low, high]: 4.0 or True is a mistake more often than an int."""
    if value is None and optional:
        return None
    what = "an int" if multiple_of == 1 else f"a multiple of {multiple_of}"
    expected = f"{what} in [{low}, {high}]" if high is not None else f"{what} >= {low}" if low is not None else what
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(where, value, expected, optional)
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high) or number % multiple_of:
        fail(where, value, expected, optional)
    return number


def check_float(
    where: str,
    value: Any,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> float | None:
    """A real number (not a bool; NaN and inf refused) in the interval from ``low`` to ``high``, as a float."""
    if value is None and optional:
        return None
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    sign = ">" if low_open else ">="
    expected = f"a finite float {sign} {low:g}" if math.isinf(high) else f"a float in {left}{low:g}, {high:g}{right}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        fail(where, value, expected, optional)
    number = float(value)
    if not (number > low if low_open else number >= low) or not (number < high if high_open else number <= high):
        fail(where, value, expected, optional)
    return number


def check_bool(where: str, value: Any) -> bool:
    if type(value).__name__ == "bool_" and hasattr(value, "item"):  # numpy's bool
        return bool(value.item())
    return value if isinstance(value, bool) else fail(where, value, "True or False")


def check_choice(where: str, value: Any, choices: tuple, optional: bool = False) -> Any:
    """One of ``choices`` (strings or ints; an int choice is not matched by a float or a bool)."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    if isinstance(value, (str, int)) and not isinstance(value, bool) and value in choices:
        return value
    hint = nearest(value, [str(c) for c in choices]) if isinstance(value, str) else ""
    fail(where, value, f"one of {choices}", optional, hint)


def check_names(
    where: str, value: Any, regex: bool = True, expected: str = "a list of module names"
) -> list[str] | str | None:
    """Module names: a list (a set is sorted) of non-empty strings, or None. A single string is one regex (full
    match, as LoRA's ``target_modules``) where ``regex``, else one name."""
    if value is None:
        return None
    if isinstance(value, str) and regex:
        return _compiled(where, value)
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    expected += " or one regex string" if regex else ""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        fail(where, value, expected, optional=True, hint=" (entries must be non-empty strings)")
    return list(value)


def check_regexes(where: str, value: Any) -> list[str] | None:
    """A non-empty list of regexes (a single string is one), or None."""
    names = check_names(where, value, regex=False, expected="a non-empty list of regexes")
    return None if names is None else [_compiled(where, pattern) for pattern in names]


def check_subset(where: str, value: Any, choices: tuple) -> list[str]:
    """A non-empty list drawn from ``choices`` (a single string is one entry), returned sorted and unique."""
    expected = f"a non-empty list of {choices}"
    values = [value] if isinstance(value, str) else value
    if (
        not isinstance(values, (list, tuple, set, frozenset))
        or not values
        or not all(isinstance(v, str) for v in values)
    ):
        fail(where, value, expected)
    unknown = [v for v in values if v not in choices]
    if unknown:
        fail(where, value, expected, hint=nearest(unknown[0], list(choices)))
    return sorted(set(values))


def _compiled(where: str, pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{where}: {pattern!r} is not a valid regular expression ({error}).") from None
    return pattern


def nested(where: str, value: Any, cls: type) -> Any:
    """A nested config: an instance of ``cls``, its dict (from JSON; an unknown key refused), or None."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        fail(where, value, f"a {cls.__module__.split('.')[0]}.{cls.__name__} or its dict", optional=True)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [key for key in value if key not in valid]
    if unknown:
        raise ValueError(
            f"{where} has no field {unknown[0]!r}{nearest(str(unknown[0]), valid)}; its fields: {', '.join(valid)}."
        )
    try:
        return cls(**value)
    except ValueError as error:  # say where the dict was given, e.g. "SlimFitConfig.activation_compression"
        message = str(error)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None


def saved_fields(cls: type, values: dict[str, Any], version: Any, nested_types: dict[str, type]) -> dict[str, Any]:
    """The entries of a saved config's ``values`` that are fields of ``cls``; an unknown key (nested too) is dropped
    with a warning naming ``version``, the peft_slim that saved it."""
    valid = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(key for key in values if key not in valid)
    if unknown:
        try:
            newer = Version(str(version)) > Version(__version__)
        except InvalidVersion:
            newer = True  # no version, or not one we can read: most likely a newer file
        saved_by = f"peft_slim {version}" if version else "another version of peft_slim"
        advice = "upgrade peft_slim to use them." if newer else "this version no longer uses them."
        warnings.warn(
            f"{cls.__name__}: the saved config has field(s) {unknown} that this version of peft_slim ({__version__}) "
            f"does not know; they are ignored. It was written by {saved_by}: {advice}",
            stacklevel=3,
        )
    known = {key: value for key, value in values.items() if key in valid}
    for name, nested_cls in nested_types.items():
        if isinstance(known.get(name), dict):
            known[name] = saved_fields(nested_cls, known[name], version, {})
    return known


def to_json_value(value: Any) -> Any:
    """``value`` as JSON-ready data: nested configs as dicts, sets as sorted lists, enums as their value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json_value(value.to_dict() if hasattr(value, "to_dict") else dataclasses.asdict(value))
    if isinstance(value, (set, frozenset)):
        return sorted((to_json_value(v) for v in value), key=str)
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {key: to_json_value(item) for key, item in value.items()}
    if isinstance(value, str):  # str-valued enums such as PeftType and TaskType
        return str(value.value) if hasattr(value, "value") else value
    return value


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a failure leaves any existing file as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
