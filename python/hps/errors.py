"""Exceptions raised by hps.

Bad arguments (wrong dtype, shape, the reserved key, out-of-range settings)
raise the built-in TypeError or ValueError with a message naming the argument;
conditions of the system itself derive from HpsError: a full table, a
damaged file (CorruptionError, naming it), a failed system call (IoError), a
training run whose loss stopped being a number (DivergedError).
IoPathWarning says that SSD-PS moves rows on a slower path than it was asked
for.
"""
from hps._core import CorruptionError, HpsError, IoError, TableFullError

__all__ = ["CorruptionError", "DivergedError", "HpsError", "IoError", "IoPathWarning", "TableFullError"]


class DivergedError(HpsError):
    """A batch's loss was NaN or infinite (training diverged: a learning rate too
    high, most often). Raised before that batch's gradients reach any row or
    parameter, so the job keeps its last finished checkpoint as it was. Under
    hps.distributed also a sparse gradient that is not a number, raised before it
    leaves its rank for the key's owner (hps.distributed.sparse.refuse_nonfinite).
    Also a sparse gradient sum that is not a number where the optimizer steps it:
    one pushed so, or finite gradients of a key that overflowed in their sum (a
    push's duplicate keys, the ranks' gradients at the key's owner, Herald's
    primary): raised by the step, naming the key, before it changes any row; as is
    a finite sum whose step would leave a value of the row that is not finite (SGD's
    lr * g, the squares of AdaGrad and Adam past float32's range). And under
    hps.distributed the dense gradients all-reduced, or k-step Adam's merge, that
    overflowed: raised on every rank alike, before any parameter changes; and a
    k-step Adam step whose gradients' squares could overflow its v (or that holds a
    NaN or an infinity), raised by the rank's step before any parameter changes."""


class IoPathWarning(RuntimeWarning):
    """An SsdStore asked for io_uring or O_DIRECT moves rows with pread or through
    the page cache instead, because the kernel or the filesystem refused; the
    message gives the reason. Once per store. Pass ``use_io_uring=False`` or
    ``direct_io=False`` to choose the fallback (no warning), or
    ``require_direct_io=True`` to make a refused O_DIRECT an IoError."""
