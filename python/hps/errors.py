"""Exceptions raised by hps.

Bad arguments (wrong dtype, shape, the reserved key, out-of-range settings)
raise the built-in TypeError or ValueError with a message naming the argument;
conditions of the system itself derive from HpsError: a full table, a
damaged file (CorruptionError, naming it), a failed system call (IoError).
"""
from hps._core import CorruptionError, HpsError, IoError, TableFullError

__all__ = ["CorruptionError", "HpsError", "IoError", "TableFullError"]
