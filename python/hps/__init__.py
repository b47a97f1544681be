"""hps: a hierarchical parameter server for CTR and recommendation models.

Embedding rows live in a device tier (per-GPU hash tables, or host partitions
without a GPU), a host-memory cache and an SSD store; this package is the
Python face of the native core.
"""
from hps._core import __version__, cuda_compiled, cuda_device_count, liburing_compiled
from hps.errors import CorruptionError, DivergedError, HpsError, IoError, IoPathWarning, TableFullError
# Malformed input (a ValueError, like the other bad arguments; not an HpsError):
# exported here because a training script catches it beside the others.
from hps.data import DataError
from hps.hash_table import EMPTY_KEY, HashTable
from hps.herald import Herald, HeraldPlan
from hps.admission import ADMISSION_DEFAULT_KEY, AdmissionSketch
from hps.optim import SGD, AdaGrad, Adam, Normal, RowWiseAdaGrad, Uniform, Zeros
from hps.embedding import EmbeddingTable
from hps.ssd_store import SsdStore
from hps.mem_cache import CacheFullError, MemCache, parse_bytes
from hps.parameter_server import Batch, HostBatch, ParameterServer, ParameterServerConfig, PathInUseError, SsdOptions
from hps.lookup import Lookup

__all__ = [
    "ADMISSION_DEFAULT_KEY",
    "EMPTY_KEY",
    "AdmissionSketch",
    "AdaGrad",
    "Batch",
    "HostBatch",
    "CacheFullError",
    "Adam",
    "CorruptionError",
    "DataError",
    "DivergedError",
    "EmbeddingTable",
    "HashTable",
    "Herald",
    "HeraldPlan",
    "HpsError",
    "IoError",
    "IoPathWarning",
    "Lookup",
    "MemCache",
    "Normal",
    "ParameterServer",
    "ParameterServerConfig",
    "PathInUseError",
    "RowWiseAdaGrad",
    "SGD",
    "SsdOptions",
    "SsdStore",
    "TableFullError",
    "Uniform",
    "Zeros",
    "__version__",
    "cuda_compiled",
    "cuda_device_count",
    "liburing_compiled",
    "parse_bytes",
]
