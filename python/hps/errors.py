"""Exceptions raised by hps.

Bad arguments (wrong dtype, shape, the reserved key, out-of-range settings)
raise the built-in TypeError or ValueError with a message naming the argument;
conditions of the system itself derive from HpsError.
"""
from hps._core import HpsError, TableFullError

__all__ = ["HpsError", "TableFullError"]
