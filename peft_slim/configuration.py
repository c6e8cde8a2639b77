"""One path for every peft_slim config: field checks, coercion, unknown keys and (de)serialisation.

Each config field is declared by :func:`setting` with its help and check (``metadata={"help", "check"}``);
:func:`validate` runs the checks of every field (coercing, e.g. ``np.int64`` to ``int``), then the config's
cross-field ``_check()``. Nested configs are checked the same way, by :class:`Nested`. The contract, kept in one place:

* a wrong value is a ``ValueError`` naming ``Class.field``, what was given and what would work;
* an unknown key given by the user is a ``TypeError``/``ValueError`` naming it and the nearest valid field;
* an unknown key in a saved ``adapter_config.json`` (written by a newer version) is a warning naming it and
  the version that saved it, and is dropped;
* ``to_dict()`` is JSON-ready (nested configs as dicts, sets as sorted lists) and records the saving version.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

from packaging.version import InvalidVersion, Version
from peft import LoraConfig

from ._version import __version__

VERSION_KEY = "peft_slim_version"


class SavedDict(dict):
    """A nested config dict read from a saved ``adapter_config.json``: unknown keys warn instead of raising."""


def nearest(name: str, valid: list[str]) -> str:
    """' (did you mean `x`?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def unknown_keys_message(cls: type, unknown: list[str]) -> str:
    valid = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    hints = "".join(f"\n  `{key}`{nearest(key, valid)}" for key in unknown)
    return f"{cls.__name__} has no field(s):{hints}\nValid fields: {', '.join(valid)}."


def known_fields(cls: type, values: dict[str, Any], saved: bool, where: str | None) -> dict[str, Any]:
    """The entries of ``values`` that are fields of ``cls``; an unknown key raises (``saved``: warns, then is
    dropped). A saved file's unknown fields come from a newer release (upgrade to use them) or an older build of this
    version or earlier (fields since dropped)."""
    valid = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(key for key in values if key not in valid)
    if unknown and not saved:
        raise ValueError((f"{where}: " if where else "") + unknown_keys_message(cls, unknown))
    if unknown:
        version = values.get(VERSION_KEY)
        try:
            newer = Version(str(version)) > Version(__version__)
        except InvalidVersion:
            newer = True  # no version, or not one we can read: most likely a newer file
        saved_by = f"peft_slim {version}" if version else "another version of peft_slim"
        advice = "upgrade peft_slim to use them." if newer else "this version no longer uses them."
        warnings.warn(
            f"{cls.__name__}: the saved config has field(s) {unknown} that this version of peft_slim "
            f"({__version__}) does not know; they are ignored. It was written by {saved_by}: {advice}",
            stacklevel=3,
        )
    return {key: value for key, value in values.items() if key in valid}


# ---------------------------------------------------------------------------------------------- field checks


class Check:
    """A field check: ``check(value, where)`` returns the (coerced) value or raises ``ValueError``."""

    optional: bool = False
    expected: str = ""

    def __call__(self, value: Any, where: str) -> Any:
        if value is None and self.optional:
            return None
        return self.coerce(value, where)

    def coerce(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def fail(self, value: Any, where: str, hint: str = ""):
        none = " or None" if self.optional else ""
        raise ValueError(f"{where} must be {self.expected}{none}, got {value!r}{hint}.")


@dataclasses.dataclass
class Integer(Check):
    low: int | None = None
    high: int | None = None
    optional: bool = False
    multiple_of: int = 1

    @property
    def expected(self) -> str:
        what = "an int" if self.multiple_of == 1 else f"a multiple of {self.multiple_of}"
        if self.low is not None and self.high is not None:
            return f"{what} in [{self.low}, {self.high}]"
        return f"{what} >= {self.low}" if self.low is not None else what

    def coerce(self, value: Any, where: str) -> int:
        # Exact integers only (numpy ints included): 4.0 or True is a mistake more often than an int.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            self.fail(value, where)
        value = int(value)
        too_low, too_high = self.low is not None and value < self.low, self.high is not None and value > self.high
        if too_low or too_high or value % self.multiple_of:
            self.fail(value, where)
        return value


@dataclasses.dataclass
class Real(Check):
    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    keep_int: bool = False  # an int given stays an int (as PEFT writes LoRA's lora_alpha)

    @property
    def expected(self) -> str:
        if math.isinf(self.high):
            return f"a finite float {'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"a float in {left}{self.low:g}, {self.high:g}{right}"

    def coerce(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            self.fail(value, where)
        number = float(value)
        above = number > self.low if self.low_open else number >= self.low
        below = number < self.high if self.high_open else number <= self.high
        if not (math.isfinite(number) or (number == self.high and not self.high_open)) or not (above and below):
            self.fail(value, where)
        return int(value) if self.keep_int and isinstance(value, numbers.Integral) else number


@dataclasses.dataclass
class Boolean(Check):
    expected: str = "True or False"

    def coerce(self, value: Any, where: str) -> bool:
        if type(value).__name__ == "bool_" and hasattr(value, "item"):  # numpy's bool
            return bool(value.item())
        return value if isinstance(value, bool) else self.fail(value, where)


@dataclasses.dataclass
class BooleanOrName(Check):
    """True, False or a non-empty string (as LoRA's ``init_lora_weights``: PEFT checks the names itself)."""

    expected: str = "True, False or an initialisation's name (e.g. 'gaussian', 'pissa', 'olora', 'loftq', 'corda')"

    def coerce(self, value: Any, where: str) -> bool | str:
        if isinstance(value, bool) or (isinstance(value, str) and value):
            return value
        self.fail(value, where)


@dataclasses.dataclass
class OneOf(Check):
    """One of ``choices`` (strings or ints; an int choice is not matched by a float or a bool)."""

    choices: tuple
    optional: bool = False

    @property
    def expected(self) -> str:
        return f"one of {self.choices}"

    def coerce(self, value: Any, where: str) -> Any:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif not isinstance(value, str):
            self.fail(value, where)
        if value not in self.choices:
            self.fail(value, where, nearest(value, [str(c) for c in self.choices]) if isinstance(value, str) else "")
        return value


def _string_list(value: Any, where: str, what: str, allow_empty: bool = False) -> list[str]:
    """A list of strings from a list, tuple or set; a single string is refused where it would be ambiguous."""
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be {what}, got {value!r}.")
    bad = [item for item in value if not isinstance(item, str) or not item]
    if bad or (not value and not allow_empty):
        raise ValueError(f"{where} must be {what}; got {value!r} (entries must be non-empty strings).")
    return list(value)


def _compiled(pattern: str, where: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{where}: {pattern!r} is not a valid regular expression ({error}).") from None
    return pattern


@dataclasses.dataclass
class ModuleNames(Check):
    """Module names (list, suffix match) or one regex (a string, full match), as LoRA's ``target_modules``."""

    optional: bool = True
    expected: str = "a list of module names or one regex string"
    allow_empty: bool = False

    def coerce(self, value: Any, where: str) -> list[str] | str:
        if isinstance(value, str):
            return _compiled(value, where)
        return _string_list(value, where, self.expected, self.allow_empty)


@dataclasses.dataclass
class NameList(Check):
    """A list of module names; a single string is one name (never its characters)."""

    optional: bool = True
    expected: str = "a list of module names"

    def coerce(self, value: Any, where: str) -> list[str]:
        return _string_list([value] if isinstance(value, str) else value, where, self.expected)


@dataclasses.dataclass
class Regexes(NameList):
    """A non-empty list of regexes; a single string is one regex."""

    expected: str = "a non-empty list of regexes"

    def coerce(self, value: Any, where: str) -> list[str]:
        return [_compiled(pattern, where) for pattern in super().coerce(value, where)]


@dataclasses.dataclass
class Choices(Check):
    """A non-empty list drawn from ``choices`` (a single string is one entry), returned sorted and unique."""

    choices: tuple
    optional: bool = False

    @property
    def expected(self) -> str:
        return f"a non-empty list of {self.choices}"

    def coerce(self, value: Any, where: str) -> list[str]:
        values = _string_list([value] if isinstance(value, str) else value, where, self.expected)
        unknown = [v for v in values if v not in self.choices]
        if unknown:
            self.fail(value, where, nearest(unknown[0], self.choices))
        return sorted(set(values))


@dataclasses.dataclass
class Mapping(Check):
    """A dict whose keys are among ``keys`` and whose values pass ``values``; returned with sorted keys."""

    keys: tuple
    values: Check
    optional: bool = True

    @property
    def expected(self) -> str:
        return f"a dict with keys among {self.keys}"

    def coerce(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            self.fail(value, where)
        unknown = [k for k in value if k not in self.keys]
        if unknown:
            hint = nearest(unknown[0], self.keys) if isinstance(unknown[0], str) else ""
            raise ValueError(f"{where} must be {self.expected}, got key {unknown[0]!r}{hint}.")
        return {key: self.values(value[key], f"{where}[{key!r}]") for key in sorted(value)}


@dataclasses.dataclass
class Patterns(Check):
    """A dict from module-name patterns (non-empty strings) to values that pass ``values``, in the order given (as
    LoRA's ``rank_pattern``)."""

    values: Check
    optional: bool = True

    @property
    def expected(self) -> str:
        return f"a dict from module-name patterns to {self.values.expected}"

    def coerce(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict) or not all(isinstance(key, str) and key for key in value):
            self.fail(value, where)
        return {key: self.values(item, f"{where}[{key!r}]") for key, item in value.items()}


@dataclasses.dataclass
class OneOrList(Check):
    """One value or a list of values, each passing ``item`` (as LoRA's ``layers_to_transform``)."""

    item: Check
    optional: bool = True

    @property
    def expected(self) -> str:
        return f"{self.item.expected}, or a list of them"

    def coerce(self, value: Any, where: str) -> Any:
        if isinstance(value, (list, tuple)):
            return [self.item(item, f"{where}[{index}]") for index, item in enumerate(value)]
        try:
            return self.item(value, where)
        except ValueError:
            self.fail(value, where)


@dataclasses.dataclass
class Nested(Check):
    """A nested peft_slim config: an instance of ``cls``, or its dict (unknown keys: see the module docstring)."""

    cls: type
    optional: bool = True
    convert: Callable[[Any, str], Any] | None = None  # other accepted forms (e.g. an older config type)

    @property
    def expected(self) -> str:
        return f"a peft_slim.{self.cls.__name__} or its dict"

    def coerce(self, value: Any, where: str) -> Any:
        if self.convert is not None:
            value = self.convert(value, where)
        if isinstance(value, dict):
            try:
                return from_dict(self.cls, value, saved=isinstance(value, SavedDict), where=where)
            except ValueError as error:  # say where the dict was given, e.g. "SlimFitConfig.activation_compression"
                message = str(error)
                raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
        if not isinstance(value, self.cls):
            self.fail(value, where)
        return value


# The LoraConfig fields PEFT stores unchecked, where a wrong value fails far from the config (a TypeError inside
# get_peft_model, a str compared with an int at load) or trains wrong (lora_alpha=nan: loss nan). Checked the same
# way as peft_slim's own fields: a bool is not an int, NaN and inf are refused. Fields this PEFT lacks are skipped.
LORA_FIELDS = {
    "r": Integer(1),
    "lora_alpha": Real(0.0, math.inf, low_open=True, high_open=True, keep_int=True),
    "lora_dropout": Real(0.0, 1.0, high_open=True),
    "target_modules": ModuleNames(allow_empty=True),  # empty: only target_parameters
    "exclude_modules": ModuleNames(allow_empty=True),
    "layers_to_transform": OneOrList(Integer(0)),
    "rank_pattern": Patterns(Integer(1)),
    "alpha_pattern": Patterns(Real(0.0, math.inf, low_open=True, high_open=True, keep_int=True)),
    "bias": OneOf(("none", "all", "lora_only")),
    "init_lora_weights": BooleanOrName(),
    "fan_in_fan_out": Boolean(),
    "use_rslora": Boolean(),
    "use_dora": Boolean(),
    "lora_bias": Boolean(),
    "inference_mode": Boolean(),
    "qalora_group_size": Integer(1),
}


@dataclasses.dataclass
class Lora(Check):
    """A nested ``peft.LoraConfig``, or its dict (as saved), its fields checked (``LORA_FIELDS``). Unknown keys follow
    the contract above."""

    optional: bool = True
    expected: str = "a peft.LoraConfig or its dict"

    def coerce(self, value: Any, where: str) -> LoraConfig:
        if isinstance(value, dict):
            saved = isinstance(value, SavedDict) or "peft_type" in value
            fields = known_fields(LoraConfig, value, saved, where)
        elif isinstance(value, LoraConfig):
            fields = {name: getattr(value, name) for name in LORA_FIELDS if hasattr(value, name)}
        else:
            self.fail(value, where)
        for name, check in LORA_FIELDS.items():
            if name in fields:
                checked = check(fields[name], f"{where}.{name}")
                if not isinstance(check, ModuleNames):  # checked, kept as given (LoraConfig holds a list as a set)
                    fields[name] = checked
        if isinstance(value, dict):
            return LoraConfig.from_peft_type(**fields)
        for name, checked in fields.items():
            setattr(value, name, checked)
        return value


# ---------------------------------------------------------------------------------------------- configs


def setting(default: Any, help: str, check: Check | None = None, flag_help: str | None = None, **metadata: Any) -> Any:
    """A dataclass field (``dataclasses.MISSING``: no default) with its ``help``, its ``check`` where it has one and
    any other metadata (``flag``, ``parse``: see ``peft_slim.cli.flags``); ``flag_help``: ``flag={"help": ...}``."""
    checked = {} if check is None else {"check": check}
    flag = {} if flag_help is None else {"flag": {"help": flag_help}}
    return dataclasses.field(default=default, metadata={"help": help, **checked, **flag, **metadata})


def validate(config: Any) -> None:
    """Run every field's check (storing the coerced value), then the config's cross-field ``_check()``."""
    for spec in dataclasses.fields(config):
        check = spec.metadata.get("check")
        if check is not None:
            setattr(config, spec.name, check(getattr(config, spec.name), f"{type(config).__name__}.{spec.name}"))
    config._check()


def to_json_value(value: Any) -> Any:
    """``value`` as JSON-ready data: nested configs as dicts, sets as sorted lists, enums as their value."""
    if hasattr(value, "to_dict") and dataclasses.is_dataclass(value):  # a LoraConfig's dict holds sets and enums
        return to_json_value(value.to_dict())
    if isinstance(value, (set, frozenset)):
        return sorted((to_json_value(v) for v in value), key=str)
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {key: to_json_value(item) for key, item in value.items()}
    if isinstance(value, str):  # str-valued enums such as PeftType and TaskType
        return str(value.value) if hasattr(value, "value") else value
    return value


def from_dict(cls: type, values: dict[str, Any], saved: bool = False, where: str | None = None) -> Any:
    """``cls(**values)``; an unknown key raises (``saved``: warns and is dropped, as a newer version wrote it)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where or cls.__name__} must be a dict of {cls.__name__}'s fields, got {values!r}.")
    known = known_fields(cls, values, saved, where)
    return cls(**{key: SavedDict(v) if saved and isinstance(v, dict) else v for key, v in known.items()})


def _suggest_on_unknown_keyword(init: Callable) -> Callable:
    """Wrap a dataclass ``__init__``: a misspelt keyword names the nearest field (still a TypeError, as Python's).
    Keywords with ``peft_type`` come from a saved ``adapter_config.json`` (PEFT's loaders pass the whole file):
    there unknown keys warn and are dropped, and nested dicts are read as saved."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "peft_type" in kwargs:
            known = known_fields(type(self), kwargs, saved=True, where=None)
            kwargs = {key: SavedDict(v) if isinstance(v, dict) else v for key, v in known.items()}
        valid = [f.name for f in dataclasses.fields(self) if f.init]
        unknown = sorted(key for key in kwargs if key not in valid)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}"
                f"{nearest(unknown[0], valid)}. " + unknown_keys_message(type(self), unknown)
            )
        init(self, *args, **kwargs)

    return __init__


def config_dataclass(cls: type) -> type:
    """``@dataclass`` for peft_slim configs: adds the misspelt-keyword hint to ``__init__``."""
    cls = dataclasses.dataclass(cls)
    cls.__init__ = _suggest_on_unknown_keyword(cls.__init__)
    return cls


class ValidatedConfig:
    """Base of peft_slim's plain configs (not PEFT types): validated on construction, JSON-ready."""

    def __post_init__(self):
        validate(self)

    def _check(self) -> None:
        """Cross-field checks; subclasses extend it (calling ``super()._check()``)."""

    def to_dict(self) -> dict[str, Any]:
        return {spec.name: to_json_value(getattr(self, spec.name)) for spec in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], saved: bool = False):
        return from_dict(cls, values, saved=saved)


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


def dump_json(data: Any) -> str:
    """``data`` as the JSON PEFT writes (indented, sorted keys); raises before anything touches the disk."""
    return json.dumps(data, indent=2, sort_keys=True)
