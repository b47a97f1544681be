"""Keys of categorical values: the hash of (field, value) that names an embedding row.

Every source (the Criteo readers, the synthetic generator) and the distributed
owner map hash through this module, so a value gets the same key whichever way
it arrives.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

from hps.data.files import _shown

#: The key hps reserves for empty table slots (all 64 bits set); never produced here.
SENTINEL_KEY = 0xFFFF_FFFF_FFFF_FFFF
#: The key of admission's default row (hps.admission): the row a key reads until it has
#: been seen ``threshold`` times. Its one pre-image under the key hash below has bit 63
#: and low bits set, so no (field, 32-bit value) and no missing value hashes to it; a key
#: hashed from a 64-bit value (a schema's hashed strings, raw ids) equals it with
#: probability 2**-64 per distinct value, and would then share the default row.
ADMISSION_DEFAULT_KEY = 0xFFFF_FFFF_FFFF_FFFD


# DO NOT CHANGE the constants or the formula below: keys are stored in
# checkpoints and in SSD-PS files, so a change silently orphans every trained row.
#
# key(field, value) = splitmix64(((field + 1) << 32) ^ value), where splitmix64
# is the output function of Steele et al.'s SplittableRandom (add the golden
# gamma, then the Stafford "mix13" finalizer). Every step is invertible, so the
# hash is a bijection of 64-bit words: two (field, value) pairs with values
# below 2**32 (every Criteo hash) and different fields or values never share a
# key. The +1 keeps field 0 away from the bare value.
# A missing value hashes ((field + 1) << 32) ^ (1 << 63): bit 63 is never set
# for a 32-bit value, so it does not collide with any of them either.
# The one 64-bit word that hashes to SENTINEL_KEY is field 828_541_685's value
# 0x7b2131ab; it gets _SENTINEL_REPLACEMENT instead, the hash of field
# 1_326_503_678's value 0xa9921217. So for the fields anyone uses (below
# 828_541_685) and 32-bit values, keys are distinct and never the sentinel
# (tests/test_data.py inverts the hash to check both pre-images).

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MISSING_BIT = np.uint64(1 << 63)
_SENTINEL = np.uint64(SENTINEL_KEY)
_SENTINEL_REPLACEMENT = np.uint64(0xFFFF_FFFF_FFFF_FFFE)
_MAX_FIELD = (1 << 31) - 2  # (field + 1) << 32 must stay below bit 63


def mix64(x) -> np.ndarray:
    """splitmix64's finaliser of a uint64 array: a bijection of uint64 (distinct in,
    distinct out), so it turns ids into random-looking keys (a fresh array)."""
    z = np.array(x, dtype=np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
    return z


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of a uint64 array (a fresh array; wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        return mix64(x + _GAMMA)


def _keys(field_tags: np.ndarray, values: np.ndarray, missing: Optional[np.ndarray]) -> np.ndarray:
    """Keys from uint64 values; field_tags = (field + 1) << 32, broadcast against values."""
    pre = field_tags ^ values
    if missing is not None:
        pre = np.where(missing, field_tags ^ _MISSING_BIT, pre)  # (faster than copyto(where=))
    keys = _splitmix64(pre)
    keys[keys == _SENTINEL] = _SENTINEL_REPLACEMENT
    return keys


def _field_tags(n_fields: int) -> np.ndarray:
    """(field + 1) << 32 of fields 0..n_fields-1, as a (1, n_fields) row that broadcasts
    against (n, n_fields) values in _keys."""
    return (np.arange(1, n_fields + 1, dtype=np.uint64) << np.uint64(32))[None, :]


def _field_tag(field) -> np.uint64:
    if isinstance(field, bool) or not isinstance(field, (int, np.integer)):
        raise TypeError(f"field must be an int, got {type(field).__name__}")
    if not 0 <= field <= _MAX_FIELD:
        raise ValueError(f"field must be in [0, {_MAX_FIELD}], got {field}")
    return np.uint64((int(field) + 1) << 32)


_HEX_RE = re.compile(r"[0-9a-fA-F]{1,16}")


def feature_keys(field: int, values, missing=None) -> np.ndarray:
    """The uint64 keys of categorical ``values`` of field ``field`` (0 for C1).

    ``values`` is array-like, either of integers or of hex strings (str or
    bytes, 1 to 16 digits, any case: Criteo's "68fd1e64"); a hex string and the
    integer it spells give the same key. An empty string or None is a missing
    value, which has one key per field (:func:`missing_key`); so does every
    position where the optional boolean ``missing`` mask is true. Signed
    integers are read bitwise as unsigned of the same width (int32 -1 is
    0xFFFFFFFF), which is how 32-bit hashes stored in signed columns mean it.
    Returns an array of the shape of ``values``; never SENTINEL_KEY.

    Keys are distinct for distinct (field, value) pairs only while values are
    below 2**32 (8 hex digits, as Criteo's are): the field is XORed into bits
    32 and up, so a larger value may share its key with another field's value.

    >>> feature_keys(0, ["68fd1e64", "", None]).tolist() == (
    ...     feature_keys(0, [0x68fd1e64]).tolist() + [missing_key(0)] * 2)
    True
    >>> feature_keys(0, ["300000000"]) == feature_keys(1, ["0"])  # 9 digits: C1's value, C2's key
    array([ True])
    """
    tag = _field_tag(field)
    arr = np.asarray(values)
    flat = arr.reshape(-1)  # 1-d even for a scalar, so that the arithmetic stays on arrays
    if arr.dtype.kind in "USO":
        ints = np.zeros(flat.shape, np.uint64)
        absent = np.zeros(flat.shape, bool)
        for i, v in enumerate(flat.tolist()):
            if isinstance(v, bytes):
                v = v.decode("ascii", "replace")
            if v is None or v == "":
                absent[i] = True
            elif isinstance(v, str) and _HEX_RE.fullmatch(v):
                ints[i] = int(v, 16)
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v < 1 << 64:
                ints[i] = v  # an object array may mix in plain integers
            else:
                raise ValueError(f"field {field}: {_shown(v)} is not a hexadecimal value of 1 to 16 digits")
    elif arr.dtype.kind in "iu":
        ints = flat.astype(f"u{arr.dtype.itemsize}", copy=False).astype(np.uint64)
        absent = None
    elif arr.size == 0:
        ints, absent = flat.astype(np.uint64), None
    else:
        raise TypeError(f"values must be integers or hex strings, got dtype {arr.dtype}")
    if missing is not None:
        missing = np.asarray(missing, dtype=bool)
        if missing.shape != arr.shape:
            raise ValueError(f"missing has shape {missing.shape}, values have {arr.shape}")
        absent = missing.reshape(-1) if absent is None else (absent | missing.reshape(-1))
    return _keys(tag, ints, absent).reshape(arr.shape)


def missing_key(field: int) -> int:
    """The key of a missing (empty) value of categorical field ``field``."""
    tag = _field_tag(field)
    return int(_keys(tag, np.zeros(1, np.uint64), np.ones(1, bool))[0])
