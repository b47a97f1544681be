"""hps.distributed: one parameter-server node per MPI rank (mpi4py).

Run any hps training under ``mpiexec -n N`` and each rank becomes a node with its
own MEM-PS and SSD-PS (``<path>/rank<r>``). Keys are owned by rank
``(mix64(key) >> 32) mod N`` (the high half of the hash, so that the device tier's
``mix64(key) mod G`` still spreads a rank's keys over its devices).

Sparse parameters, bulk-synchronous per batch (no staleness):
  prefetch stage: each rank sends the distinct keys of its batch to their owners
    (alltoallv); each owner pins the union of what it was asked for in its
    MEM-PS, reading SSD-PS for misses;
  load stage: once the owner's previous batch is written back, it loads that union
    onto its device tier and returns the rows to the ranks that asked (alltoallv);
  train stage: gradients of each key go back to its owner (alltoallv), add up there,
    and the owner applies its optimizer once per key.
Dense parameters (torch): gradients all-reduced every step (``dense_sync =
"allreduce"``), or k-step Adam (:class:`KStepAdam`, the terabyte-scale paper's
Algorithm 2): local steps, x and the second moment v averaged every k steps.
All-reduces may go hierarchically (:func:`hierarchical_allreduce`).

Every collective runs under a watchdog: a rank that waits longer than
``timeout`` seconds for its peers (one died or hung) prints which operation it
was in and aborts the whole job, so nothing hangs forever. Each stage has its
own communicator, so the stages' collectives run concurrently (MPI_THREAD_MULTIPLE).
Bytes sent to other ranks are counted per kind in ``Node.bytes_sent``.

The package by concern: :mod:`hps.distributed.comm` (the job's configuration, the
mpi4py communicators, the watchdog, hierarchical all-reduce),
:mod:`hps.distributed.sparse` (key ownership and the sharded sparse exchange),
:mod:`hps.distributed.dense` (dense gradient all-reduce and k-step Adam); every
public name of those is importable from ``hps.distributed``.
:mod:`hps.distributed.poll` is used as a module (``poll.recv``: a point-to-point
receive that sleeps between probes instead of spinning, for ranks that mostly wait).
"""
from hps.distributed.comm import (COMM_KINDS, DistributedConfig, Node, RankFailure, hierarchical_allreduce,
                                  launched_by_mpi)
from hps.distributed.dense import DenseSync, kstep_adam_class
from hps.distributed.sparse import DistBatch, DistPrefetched, DistributedServer, FreshRows, owner_ranks

__all__ = ["DistributedConfig", "DistributedServer", "FreshRows", "KStepAdam", "DenseSync", "Node", "RankFailure",
           "hierarchical_allreduce", "launched_by_mpi", "owner_ranks"]


def __getattr__(name: str):
    if name == "KStepAdam":
        return kstep_adam_class()
    raise AttributeError(f"module 'hps.distributed' has no attribute {name!r}")
