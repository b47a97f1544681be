"""Config helpers shared by every config class: TOML loading, field checks, byte sizes.

The config dataclasses (ParameterServerConfig, TrainConfig, DataConfig,
DistributedConfig) read TOML tables through these, so that an unknown field, a
TOML syntax error or an unreadable size is reported the same way everywhere,
naming the file and the field.

>>> parse_bytes("512 MiB"), parse_bytes("1.5GB"), parse_bytes(4096)
(536870912, 1500000000, 4096)
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Union

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import numpy as np

__all__ = ["check_fields", "is_int", "is_number", "load_toml", "parse_bytes"]


def check_fields(cls, d: dict, source: str, prefix: str = "") -> None:
    """Raises ValueError naming the keys of d that are not fields of the dataclass cls,
    or naming the table (prefix without its dot) when d is not a table at all (`ps = 3`
    in the TOML: else an unnamed TypeError where d is read)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{source}: {prefix[:-1] + ' ' if prefix else ''}must be a table, got {d!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {', '.join(prefix + u for u in unknown)}; "
                         f"known: {', '.join(prefix + k for k in sorted(known))}")


def is_int(value) -> bool:
    """An int and not a bool (TOML's true would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or a float, not a bool: a string or a bool would fail in a comparison,
    or pass as 1."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_toml(path) -> dict:
    """A TOML file's tables; a syntax error names the file."""
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40}


def parse_bytes(value: Union[int, str], name: str = "size") -> int:
    """Bytes from an int or a string such as "8GiB", "512 MiB", "1.5GB" or "4096"."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be an int or a string like '8GiB', got {type(value).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: cannot read {value!r} as a size; write e.g. '8GiB', '512MiB' or '4096'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
