"""`hps train`: a CTR model trained end to end through the pipeline.

A run is a ``TrainConfig`` (TOML: top-level training fields and the tables
``[ps]`` (ParameterServerConfig), ``[ps.optimizer]``, ``[ps.initializer]``,
``[data]``, ``[distributed]``, ``[admission]``). The model is ``hps.torch.CtrModel``: its embeddings live in the
parameter server (sparse optimizer there), its MLP in torch (Adam). Evaluation
(AUC, logloss) runs on held-out examples every ``eval_every`` batches and at the
end; ``checkpoint_every`` batches the parameter server checkpoints with the dense
state saved inside its snapshot, so ``resume=True`` continues from the last
checkpoint to exactly the parameters of an uninterrupted run (with torch_threads
fixed). A crash at any moment, in the middle of a checkpoint too, rolls back to
the last finished checkpoint; one before the first checkpoint leaves nothing to
resume, and the next run, with or without ``resume``, starts over from batch 0
and says so. The data sources are opened before anything is written, so a bad
data path leaves nothing behind.

Under ``mpiexec -n N`` every rank is a node (hps.distributed): its parameter
server lives in ``<path>/rank<r>``, it reads its share of the data, and
``<path>/job.json`` records the world size and the checkpoint (number and step)
that every rank finished; each rank keeps its previous checkpoint until job.json
names the new one, and a resumed job rolls every rank back to the one job.json names.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from hps import _core
from hps import data as hdata
from hps import reshard
from hps.admission import Admission
from hps.data.synthetic import BAG_LENGTHS, MAX_MEAN_BAG_LENGTH, MAX_VOCABULARY
from hps.data.keys import ADMISSION_DEFAULT_KEY
from hps.config import check_fields, is_int, is_number, load_toml, parse_bytes
from hps.distributed import DenseSync, DistributedConfig, DistributedServer, Node, launched_by_mpi
from hps.distributed.comm import local_ranks_from_environment, raised_on_every_rank
from hps.errors import DivergedError
from hps.jobdir import HT_LAYOUT, TRAINER_STATE, read_job_record, write_trainer_state  # (those two: in a checkpoint)
from hps.metrics import auc, logloss
from hps.parameter_server import (CHECKPOINTS, FORMAT_VERSION, JOB_MANIFEST, LAST, METADATA, RUN, WRITER_LOCK,
                                  ParameterServer, ParameterServerConfig, _lock_path, _make_dirs_durable, _remove_tree,
                                  _replace_durable, _write_durable, PathInUseError, mem_lookahead_room, new_run_id)
from hps.pipeline import MAX_LOOKAHEAD, Loaded, Pipeline, batches_ahead, depths_for
from hps.tuning import (ThreadTuner, dense_adam, import_torch, keep_freed_memory,  # (also hps.train.X, as before)
                         usable_cpus)

SUMMARY = "train-summary.json"
# [data] fields only synthetic data reads (SyntheticCriteo's)
SYNTHETIC_ONLY = ("vocab_sizes", "zipf_a", "multi_hot", "bag_length")
SYNTHETIC_EXAMPLES = 1_000_000  # synthetic data's examples a pass when [data] train_examples is not set


@dataclass
class DataConfig:
    source: str = "synthetic"           # "synthetic", or paths / globs / a directory of TSV or Parquet files
    eval_source: Optional[str] = None   # held-out files; synthetic: the generator's "eval" stream
    format: Optional[str] = None        # "tsv" or "parquet"; None: from the file names
    batch_size: int = 4096
    train_examples: Optional[int] = None  # examples a pass: files, their first N (None: all); synthetic,
                                          # N (None: SYNTHETIC_EXAMPLES)
    eval_examples: int = 100_000
    skip_malformed: bool = False
    seed: int = 0                       # synthetic data's seed
    vocab_sizes: Optional[Sequence[int]] = None  # synthetic; None: hps.data.DEFAULT_VOCAB_SIZES
    zipf_a: float = 1.1
    multi_hot: Sequence = ()            # synthetic: (vocabulary, mean bag length) of each multi-hot field
    bag_length: str = "poisson"         # synthetic: "poisson", "geometric" or "fixed" bag lengths
    schema: Optional[Any] = None        # [data.schema]: files of any columns (hps.data.Schema); None: Criteo's
    epochs: int = 1                     # passes over the training data (hps.data.Epochs)
    shuffle_buffer: int = 0             # rows of the seeded shuffle buffer (seed: `seed`); 0: file order
    online_poll: float = 1.0            # online, source a directory: seconds between looks for new files
    online_idle: Optional[float] = 60.0  # online: end after this many seconds without a new file (None: never)
    online_marker: Optional[str] = "_DONE"  # online: end once this file appears and the files present are read
    online_examples: Optional[int] = None  # online: end after this many examples a rank (None: no cap)


@dataclass
class AdmissionConfig:
    """``[admission]``: a key gets a trainable row only after it has been seen ``threshold``
    times (hps.admission); until then it reads a fixed default row and its gradients
    are dropped."""
    threshold: int = 1                  # occurrences a key needs for a row, 1 to 255; 1: every key, no sketch
    sketch_bytes: Union[int, str] = "4MiB"  # the counting sketch's counters (one byte each)

    def check(self, source: str = "[admission]", eval_every: int = 0, pipelined: bool = True,
              lookahead: int = 0) -> None:
        """Refuses a bad value, naming it; `eval_every`, `pipelined` and `lookahead`:
        the run's (TrainConfig's, [ps]'s), which decide how many sketches a rank holds
        (check_memory); `eval_every` 0 where the run has no held-out data to evaluate."""
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 255:
            raise ValueError(f"{source}: admission.threshold must be an int in [1, 255], got {t!r}")
        try:
            b = parse_bytes(self.sketch_bytes, "admission.sketch_bytes")
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
        if b < 4:
            raise ValueError(f"{source}: admission.sketch_bytes must be at least 4 (4 arrays of one-byte "
                             f"counters), got {self.sketch_bytes!r}")
        self.check_memory(source, eval_every=eval_every, pipelined=pipelined, lookahead=lookahead)

    def check_memory(self, source: str = "[admission]", machine_ranks: Optional[tuple[int, str]] = None,
                     eval_every: int = 0, pipelined: bool = True, lookahead: int = 0) -> None:
        """Refuses sketches that the ranks on this machine cannot all hold: the counters
        are allocated and zeroed whole when training starts, by every rank, and with
        `eval_every` > 0 a rank holds more of them (_sketches_a_rank).
        `machine_ranks`: (ranks, where that was counted); by default the launcher's
        environment's count (before MPI starts; hps.distributed.comm)."""
        memory = _physical_memory()
        if self.threshold == 1 or memory is None:
            return
        b = parse_bytes(self.sketch_bytes, "admission.sketch_bytes")
        if machine_ranks is None:
            try:
                machine_ranks = local_ranks_from_environment()
            except ValueError as e:
                raise ValueError(f"{source}: admission.sketch_bytes: the ranks on this machine, each of which "
                                 f"holds a sketch, cannot be counted: {e}") from None
        ranks, counted_by = machine_ranks
        sketches, why = _sketches_a_rank(eval_every, pipelined, lookahead)
        a_rank = b * sketches
        if a_rank * ranks > memory:
            if sketches == 1:
                held = "" if ranks == 1 else " a rank"
            else:
                held = f" a sketch; {sketches} sketches a rank with eval_every = {eval_every}: {why}: {a_rank:,} bytes"
            if ranks > 1:
                held += f"; {ranks} ranks on this machine ({counted_by}) hold {a_rank * ranks:,} bytes"
            raise ValueError(f"{source}: admission.sketch_bytes = {self.sketch_bytes!r} ({b:,} bytes{held}) is "
                             f"more than this machine's memory ({memory:,} bytes)")


def _sketches_a_rank(eval_every: int, pipelined: bool, lookahead: int = 0) -> tuple[int, str]:
    """(the most sketches a rank holds at once, what they are). Without evaluations in
    the run (eval_every = 0, or no held-out batches) the live sketch. With them
    (hps.admission.Admission): the live one; the evaluation's, built at the first
    evaluation and kept; and the copies of the counters the read stage keeps at each
    multiple of eval_every it counts, until the evaluation there takes its copy (held
    while the evaluation's sketch is restored from it). The read stage counts at most
    hps.pipeline.batches_ahead() batches past the one trained, its read queue
    grown to a lookahead window of `lookahead` batches (not pipelined: the window's
    batches, read before the batch before them trains), so at the evaluation after
    batch t the copies are those of t and of the multiples up to t + that many."""
    if not eval_every:
        return 1, "the live one"
    lookahead = lookahead if is_int(lookahead) and lookahead > 0 else 0  # (a bad one is refused by [ps]'s check)
    ahead = batches_ahead(depths_for(lookahead)) if pipelined else lookahead
    kept = 1 + ahead // eval_every
    if kept == 1:
        return 3, "the live one, the evaluation's, and one kept for the next evaluation"
    return 2 + kept, (f"the live one, the evaluation's, and {kept} kept for the next evaluations, which the read "
                      f"stage passes up to {ahead} batches ahead of training")


def _check_lookahead(ps: ParameterServerConfig, where: str) -> None:
    """Refuses a lookahead window the pipeline cannot fill, naming it. The pipeline
    refuses it too, but only once the server is open: by then the job's directory
    was made, and the next run found a run "that ended before its first checkpoint"."""
    if is_int(ps.lookahead) and ps.lookahead > MAX_LOOKAHEAD:
        raise ValueError(f"{where}: lookahead must be an int in [0, {MAX_LOOKAHEAD}] (batches), got {ps.lookahead!r}")


def window_batch_keys(cfg: "TrainConfig", widths: tuple, world: int = 1, batches=None) -> tuple[int, bool]:
    """(the most keys one batch of the lookahead window gives a rank's MEM-PS, repeats
    counted; whether that is a bound). A batch gives batch_size examples of `widths`'
    single-hot fields, one key each, and its multi-hot bags; under mpiexec an owner's
    batch j holds the keys it owns of every one of the `world` ranks' batch j. A bag's
    length is bounded only for synthetic bags of bag_length = "fixed": other bags
    (Poisson, geometric, a file's multi-hot columns) are left out, and the count is no
    bound. `batches`: the batches train() was given (a list: their largest; another
    iterable: no bound known)."""
    if batches is not None:
        if not isinstance(batches, (list, tuple)):
            return cfg.data.batch_size * widths[1] * world, False
        most = max((b.all_keys().size for b in batches), default=0)
        return most * world, True
    d = cfg.data
    per_example, bounded = widths[1], True
    if widths[2]:
        if d.source == "synthetic" and d.schema is None and d.bag_length == "fixed":
            per_example += sum(int(round(mean)) for _, mean in d.multi_hot)
        else:
            bounded = False
    return d.batch_size * per_example * world, bounded


def lookahead_room(cfg: "TrainConfig", window: tuple) -> int:
    """Bytes of [ps] mem_budget that a rank's MEM-PS keeps for the lookahead window
    (hps.parameter_server.mem_lookahead_room): "auto" sizes it for `lookahead` batches
    of `window` = window_batch_keys(...). Where those keys are no bound (multi-hot bags
    of no fixed length), the larger of that and the budget's 16th."""
    ps = cfg.ps
    row_bytes = _row_bytes(ps)
    keys, bounded = window
    room = mem_lookahead_room(ps, row_bytes, keys)
    return room if bounded else max(room, mem_lookahead_room(ps, row_bytes))


def check_lookahead_room(cfg: "TrainConfig", window: tuple, where: str = "[ps]") -> int:
    """lookahead_room(cfg, window), refused (ValueError, naming lookahead, lookahead_room,
    mem_budget and the bytes) where it passes mem_budget or leaves MEM-PS no row: the
    run would otherwise end at its first batch's window (CacheFullError) or not open."""
    ps = cfg.ps
    room = lookahead_room(cfg, window)
    if not room:
        return room
    budget = parse_bytes(ps.mem_budget, "mem_budget")
    row_bytes = _row_bytes(ps)
    if room <= budget and _core.MemCache.capacity_for_budget(budget - room, row_bytes) > 0:
        return room
    keys, bounded = window
    held = (f"lookahead_room = {ps.lookahead_room!r} is {room:,} bytes" if ps.lookahead_room != "auto" else
            f"lookahead_room = 'auto' sizes its room at {room:,} bytes")
    over = (f"more than mem_budget = {ps.mem_budget!r} ({budget:,} bytes)" if room > budget else
            f"which leaves mem_budget = {ps.mem_budget!r} ({budget:,} bytes) no MEM-PS row "
            f"({row_bytes:,} bytes a row, before its bookkeeping)")
    raise ValueError(f"{where}: lookahead = {ps.lookahead} keeps a window of {ps.lookahead} batches of "
                     f"{'up to' if bounded else 'at least'} {keys:,} keys; {held}, {over}: raise mem_budget, "
                     f"or lower lookahead or batch_size")


def _row_bytes(ps: ParameterServerConfig) -> int:
    """A MEM-PS row's bytes: the row and its optimizer state (as ParameterServer stores it)."""
    from hps.optim import native_optimizer
    return 4 * int(native_optimizer(ps.dim, ps.optimizer, ps.initializer, ps.seed).row_floats)


def _physical_memory() -> Optional[int]:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class TrainConfig:
    ps: ParameterServerConfig
    data: DataConfig = field(default_factory=DataConfig)
    hidden: Sequence[int] = (512, 256)
    dense_lr: float = 1e-3
    eval_every: int = 0                 # batches; 0: only at the end
    checkpoint_every: int = 0           # batches; 0: only at the end
    pipelined: bool = True
    seed: int = 0                       # the MLP's initialisation
    torch_threads: int = 0              # 0: tuned on the first batches (ThreadTuner)
    model_devices: str = "auto"         # where the dense model trains: "cuda" (worker g on GPU g), "cpu", or
                                        # "auto" (the GPUs when the device tier is on them)
    dense_replica_per_worker: bool = False  # a dense replica a worker even on one device (as on GPUs)
    helper_nice: int = 19               # niceness of the pipeline's read/prefetch/load/write-back threads
    keep_freed_memory: bool = True      # glibc's malloc keeps what a step frees for the next (whole process;
                                        # hps.tuning.keep_freed_memory), so no step faults its tensors in anew
    bind_cores: bool = False            # pin those threads to the cores of the NUMA node of what each feeds
                                        # from (hps.topology's plan; a no-op on one node, and said so)
    sysfs: str = "/sys"                 # where bind_cores reads the machine's topology (tests: fake trees)
    pooling: str = "sum"                # multi-hot fields' pooling: "sum" or "mean"
    online: bool = False                # progressive validation (score each batch, then train); a directory
                                        # source grows (hps.data.GrowingDirectory)
    online_window: int = 100_000        # online: AUC and logloss over the latest this many examples ...
    online_window_batches: int = 0      # ... or over the latest this many batches (0: by examples)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # under mpiexec
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # [admission]: rows only for keys seen f times

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "TrainConfig":
        d = dict(d)
        check_fields(cls, d, source)
        if "ps" not in d:
            raise ValueError(f"{source}: missing table [ps] (dim, path, ...)")
        if isinstance(d["ps"], ParameterServerConfig):
            ps = d["ps"]
        else:
            ps = ParameterServerConfig.from_dict(d["ps"], source=f"{source}: [ps]")
            ps.check(f"{source}: [ps]")  # a bad value named with its file, before the job starts
            _check_lookahead(ps, f"{source}: [ps]")
        data = d.get("data", {})
        given = set()  # the fields the file gives (a DataConfig given as such: not known)
        if not isinstance(data, DataConfig):
            check_fields(DataConfig, data, source, prefix="data.")
            given = set(data)
            data = DataConfig(**data)
        if data.schema is not None:
            data.schema = hdata.Schema.from_dict(data.schema, source)
            if data.source == "synthetic":
                raise ValueError(f"{source}: data.schema describes files: give data.source too")
        if data.format is not None:
            # checked here, where the file is named (the readers check it only once they open a file,
            # and a synthetic source never does: it would be ignored)
            formats = ("csv", "tsv", "parquet", "libsvm") if data.schema is not None else ("tsv", "parquet")
            if data.format not in formats:
                raise ValueError(f"{source}: data.format must be one of {', '.join(map(repr, formats))}"
                                 f"{' with a schema' if data.schema is not None else ''}, got {data.format!r}")
            if data.source == "synthetic":
                raise ValueError(f"{source}: data.format = {data.format!r} is the files' format: give data.source too")
        for name, low in (("batch_size", 1), ("epochs", 1), ("shuffle_buffer", 0), ("train_examples", 1),
                          ("eval_examples", 0)):
            v = getattr(data, name)
            if name == "train_examples" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{source}: data.{name} must be an int >= {low}, got {v!r}")
        # A string such as "false" would pass bool() as True: lines left out that should stop the run.
        if not isinstance(data.skip_malformed, bool):
            raise ValueError(f"{source}: data.skip_malformed must be true or false, got {data.skip_malformed!r}")
        # Checked here, naming the field: a reader given one of the wrong type failed with a bare
        # TypeError, or (online_examples = 2.5) cut it short without a word.
        for name in ("source", "eval_source"):
            v = getattr(data, name)
            paths = v if isinstance(v, (list, tuple)) else [v]
            # (an empty path failed in the reader as "no such file: ", naming nothing; an
            # eval_source of "" is no held-out data, as None is)
            if not (v in (None, "") and name == "eval_source") and \
                    (not paths or not all(isinstance(p, (str, os.PathLike)) and os.fspath(p) for p in paths)):
                raise ValueError(f"{source}: data.{name} must be a path, a glob, a directory or a list of them, "
                                 f"got {v!r}")
        if not (is_number(data.online_poll) and 0 < data.online_poll < math.inf):
            raise ValueError(f"{source}: data.online_poll must be a number > 0 (seconds), got {data.online_poll!r}")
        if data.online_idle is not None and not (is_number(data.online_idle) and data.online_idle >= 0):
            raise ValueError(f"{source}: data.online_idle must be a number >= 0 (seconds), got {data.online_idle!r}")
        if data.online_examples is not None and not (is_int(data.online_examples) and data.online_examples >= 1):
            raise ValueError(f"{source}: data.online_examples must be an int >= 1, got {data.online_examples!r}")
        if data.online_marker is not None and not (isinstance(data.online_marker, str) and data.online_marker):
            raise ValueError(f"{source}: data.online_marker must be a file name, got {data.online_marker!r}")
        # The shuffle's and synthetic data's seed: numpy's generators take a non-negative int
        # (-1 failed at the first shuffle, after the parameter server was written; 1.5 was cut to 1).
        if not (is_int(data.seed) and data.seed >= 0):
            raise ValueError(f"{source}: data.seed must be an int >= 0, got {data.seed!r}")
        if not (is_number(data.zipf_a) and data.zipf_a >= 0):
            raise ValueError(f"{source}: data.zipf_a must be a number >= 0, got {data.zipf_a!r}")
        # Synthetic data's fields, as SyntheticCriteo takes them: it refused a bad one naming
        # neither the file nor the field (multi_hot = [5] with a bare TypeError), vocab_sizes
        # = [] trained on the default vocabularies, and a bad bag_length without multi_hot
        # passed unread.
        v = data.vocab_sizes
        if v is not None and not (isinstance(v, (list, tuple)) and v and
                                  all(is_int(x) and 1 <= x <= MAX_VOCABULARY for x in v)):
            raise ValueError(f"{source}: data.vocab_sizes must be a non-empty list of ints in [1, 2**31] (a "
                             f"categorical field's vocabulary each), got {v!r}")
        if not isinstance(data.multi_hot, (list, tuple)):
            raise ValueError(f"{source}: data.multi_hot must be a list of [vocabulary size, mean bag length], "
                             f"got {data.multi_hot!r}")
        for j, f in enumerate(data.multi_hot):
            if not (isinstance(f, (list, tuple)) and len(f) == 2 and is_int(f[0]) and 1 <= f[0] <= MAX_VOCABULARY
                    and is_number(f[1]) and 0 <= f[1] <= MAX_MEAN_BAG_LENGTH):
                raise ValueError(f"{source}: data.multi_hot[{j}] must be [vocabulary size, an int in [1, 2**31]; "
                                 f"mean bag length, a number in [0, {MAX_MEAN_BAG_LENGTH}]], got {f!r}")
        if data.bag_length not in BAG_LENGTHS:
            raise ValueError(f"{source}: data.bag_length must be one of {', '.join(map(repr, BAG_LENGTHS))}, "
                             f"got {data.bag_length!r}")
        # Synthetic data's fields with files were read by nothing, without a word (the
        # reverse, data.format or data.schema with synthetic data, is refused above).
        refuse_synthetic_only(data, given, source)
        # (checkpoint_every = -1 trained no batch and ended as a finished run)
        for name, low in (("online_window", 1), ("online_window_batches", 0), ("eval_every", 0),
                          ("checkpoint_every", 0), ("torch_threads", 0)):
            v = d.get(name, low)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{source}: {name} must be an int >= {low}, got {v!r}")
        nice = d.get("helper_nice", 19)
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:  # as Pipeline takes it
            raise ValueError(f"{source}: helper_nice must be an int in [0, 19], got {nice!r}")
        lr = d.get("dense_lr", 1.0)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise ValueError(f"{source}: dense_lr must be a finite number > 0, got {lr!r}")
        hidden = d.get("hidden", [1])
        if not isinstance(hidden, (list, tuple)) or \
                any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
            raise ValueError(f"{source}: hidden must be a list of layer widths, ints >= 1 ([] for none), "
                             f"got {hidden!r}")
        if d.get("online") and (data.epochs != 1 or data.shuffle_buffer) and _online_directory(data):
            raise ValueError(f"{source}: online training reads a growing directory once: data.epochs must be 1 "
                             f"and data.shuffle_buffer 0")
        for name in ("pipelined", "dense_replica_per_worker", "bind_cores", "online", "keep_freed_memory"):
            if name in d and not isinstance(d[name], bool):
                raise ValueError(f"{source}: {name} must be true or false, got {d[name]!r}")
        if d.get("model_devices", "auto") not in ("auto", "cpu", "cuda"):
            raise ValueError(f"{source}: model_devices must be \"auto\", \"cpu\" or \"cuda\", "
                             f"got {d['model_devices']!r}")
        if d.get("pooling", "sum") not in ("sum", "mean"):
            raise ValueError(f"{source}: pooling must be \"sum\" or \"mean\", got {d['pooling']!r}")
        seed = d.get("seed", 0)  # the MLP's initial weights (torch's generator takes 64 bits)
        if not (is_int(seed) and 0 <= seed < 1 << 64):
            raise ValueError(f"{source}: seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
        if not isinstance(d.get("sysfs", ""), str):
            raise ValueError(f"{source}: sysfs must be a path (a string), got {d['sysfs']!r}")
        dist = d.get("distributed", {})
        if not isinstance(dist, DistributedConfig):
            check_fields(DistributedConfig, dist, source, prefix="distributed.")
            dist = DistributedConfig(**dist)
        dist.check(f"{source}: [distributed]")
        adm = d.get("admission", {})
        if not isinstance(adm, AdmissionConfig):
            check_fields(AdmissionConfig, adm, source, prefix="admission.")
            adm = AdmissionConfig(**adm)
        adm.check(source, eval_every=d.get("eval_every", 0) if _has_held_out(data) else 0,
                  pipelined=d.get("pipelined", True), lookahead=ps.lookahead)
        if adm.threshold > 1 and ps.optimizer.kind != "sgd" and ps.optimizer.eps == 0 \
                and getattr(ps.optimizer, "initial_accumulator_value", 0.0) == 0:
            raise ValueError(f"{source}: admission.threshold > 1 drops the default row's gradients, and with "
                             f"ps.optimizer.eps = 0 a zero gradient steps {ps.optimizer.kind} by 0 / 0; set eps > 0")
        d["ps"], d["data"], d["distributed"], d["admission"] = ps, data, dist, adm
        if "hidden" in d:
            d["hidden"] = tuple(int(h) for h in d["hidden"])
        return cls(**d)

    @classmethod
    def from_toml(cls, path) -> "TrainConfig":
        return cls.from_dict(load_toml(path), source=os.fspath(path))


def refuse_synthetic_only(data: DataConfig, given, source: str, data_flag: bool = False) -> None:
    """Raises ValueError naming ``source`` (the config file) and the fields when ``given``
    (the [data] fields the file gives) holds fields only synthetic data reads
    (SYNTHETIC_ONLY) while data.source names files: nothing would read them.
    ``data_flag``: the files come from ``hps train --data``, over the file's source."""
    unread = [f"data.{name}" for name in SYNTHETIC_ONLY if name in given]
    if not unread or data.source == "synthetic":
        return
    named = " and ".join(filter(None, (", ".join(unread[:-1]), unread[-1])))
    what = f"--data {' '.join(map(os.fspath, data.source))}" if data_flag and isinstance(data.source, (list, tuple)) \
        else "--data" if data_flag else f"data.source = {data.source!r}"
    fix = "leave out --data" if data_flag else "set data.source = 'synthetic'"
    raise ValueError(f"{source}: {named} describe{'s' if len(unread) == 1 else ''} synthetic data; {what} "
                     f"reads files: remove {'it' if len(unread) == 1 else 'them'}, or {fix}")


# ---------------------------------------------------------------- data

def _train_source(cfg: TrainConfig, rank: int = 0, world: int = 1):
    d = cfg.data
    one_pass = _one_pass(cfg, rank, world)
    if d.train_examples is not None and d.source != "synthetic" and not isinstance(one_pass, hdata.GrowingDirectory):
        # Files: the first N examples of a pass; under mpiexec each rank its share
        # of N (the ranks read different files, so which N is the ranks' firsts).
        one_pass = hdata.FirstExamples(one_pass, d.train_examples // world + (rank < d.train_examples % world))
    if d.epochs != 1 or d.shuffle_buffer:
        return hdata.Epochs(one_pass, d.epochs, d.shuffle_buffer, seed=d.seed)
    return one_pass


def _online_directory(d: DataConfig) -> Optional[str]:
    """The directory an online run watches: a source that is one local path and no
    existing file or glob (one that does not exist is named by GrowingDirectory)."""
    src = d.source
    if isinstance(src, (list, tuple)) and len(src) == 1:
        src = src[0]
    if not isinstance(src, (str, os.PathLike)) or src == "synthetic":
        return None
    src = os.fspath(src)
    if "://" in src or any(c in src for c in "*?[") or os.path.isfile(src):
        return None
    return src


def _one_pass(cfg: TrainConfig, rank: int, world: int):
    d = cfg.data
    directory = _online_directory(d) if cfg.online else None
    if directory is not None:
        if d.schema is not None:
            def open_file(path):
                return hdata.open_schema([path], d.schema, d.batch_size, format=d.format,
                                         skip_malformed=d.skip_malformed)
        else:
            def open_file(path):
                return hdata.open_criteo([path], d.batch_size, format=d.format, skip_malformed=d.skip_malformed)
        return hdata.GrowingDirectory(directory, open_file, poll=d.online_poll, idle=d.online_idle,
                                      marker=d.online_marker, examples=d.online_examples, rank=rank, world=world,
                                      batch_size=d.batch_size)
    if d.source == "synthetic":
        kw = {"vocab_sizes": d.vocab_sizes} if d.vocab_sizes else {}
        if d.multi_hot:
            kw.update(multi_hot=[tuple(f) for f in d.multi_hot], bag_length=d.bag_length)
        examples = d.train_examples if d.train_examples is not None else SYNTHETIC_EXAMPLES
        return hdata.SyntheticCriteo(seed=d.seed, batch_size=d.batch_size, examples=examples,
                                     part="train", rank=rank, world=world, zipf_a=d.zipf_a, **kw)
    if d.schema is not None:
        return hdata.open_schema(d.source, d.schema, d.batch_size, format=d.format, rank=rank, world=world,
                                 skip_malformed=d.skip_malformed)
    return hdata.open_criteo(d.source, d.batch_size, format=d.format, rank=rank, world=world,
                             skip_malformed=d.skip_malformed)


def _check_job_outside_data(cfg: TrainConfig) -> None:
    """Raises ValueError when [ps] path is inside a local data directory (data.source or
    data.eval_source) under names that directory's listing takes (none starting with "."
    or "_"), or where a local glob among them would list files: a directory gives its
    files at every depth, so a resumed run would list the job's own checkpoints among
    its data (and a growing directory would read them as the run writes them). So is
    held-out data inside the training data's directory, or among its glob's files, or
    that names a training file (_check_held_out_files_untrained)."""
    check_output_outside_data(cfg, cfg.ps.path, "[ps] path", "the run's checkpoints",
                              "put the job elsewhere")
    # Held-out data the training data's listing takes (data/eval/ under data/) would be
    # trained on, and the evaluations would score examples the model was fitted to.
    evals = cfg.data.eval_source if isinstance(cfg.data.eval_source, (list, tuple)) else \
        [cfg.data.eval_source] if cfg.data.eval_source else []
    for held in (os.fspath(e) for e in evals):
        if "://" in held:
            continue
        for path, is_glob in _local_sources(cfg.data.source):
            if not is_glob:
                # (a glob of held-out files: each of them; else the directory or file as named)
                named = _held_files(held) if not os.path.exists(held) else [held]
                if any(_listed_under(os.path.realpath(f), path) for f in named):
                    raise ValueError(f"data.eval_source {held} is inside the training data directory {path} "
                                     f"(data.source), whose files are read at every depth: the held-out examples "
                                     f"would be trained on; move them out, or under a name starting with '.' or '_'")
                continue
            taken = next((f for f in _held_files(held)
                          if hdata.files._glob_takes(path, os.path.realpath(f), below=False)), None)
            if taken is not None:
                raise ValueError(f"data.eval_source {held} is among the files of the training data glob {path} "
                                 f"(data.source){'' if taken == held else f' ({taken})'}: the held-out examples "
                                 f"would be trained on; move them out, or under a name starting with '.' or '_'")
    _check_held_out_files_untrained(cfg, evals)


def _check_held_out_files_untrained(cfg: TrainConfig, evals: list) -> None:
    """Raises ValueError where a local file of the held-out data (data.eval_source: a
    file, or a directory's or glob's) is a file of the training data (data.source, as
    listed), naming both fields and the files: the run evaluated rows it trained on,
    and reported their AUC, a training AUC, as held-out. Compared as the same file
    (os.stat's device and inode, os.path.samefile's), however spelled: "./a.csv" and
    "a.csv", a link, a hard link. The checks above find held-out files under the
    training data's directories and globs; this one the training files named one by
    one, and held-out directories and globs that list training files."""
    held_files = [(held, f) for held in (os.fspath(e) for e in evals) if "://" not in held
                  for f in _held_files(held)]
    if not held_files:
        return
    trained: dict = {}
    given = cfg.data.source if isinstance(cfg.data.source, (list, tuple)) else [cfg.data.source]
    for src in (os.fspath(p) for p in given):
        if src == "synthetic" or "://" in src:
            continue
        for f in _held_files(src):
            identity = _file_identity(f)
            if identity is not None:
                trained.setdefault(identity, (src, f))
    for held, f in held_files:
        src, t = trained.get(_file_identity(f), (None, None))
        if src is not None:
            raise ValueError(f"data.eval_source {held}{'' if f == held else f' ({f})'} is a file of the training "
                             f"data, data.source {src}{'' if t == src else f' ({t})'}: the evaluations would score "
                             f"examples the model is trained on, their AUC a training AUC; hold out files the "
                             f"training data does not name")


def _file_identity(path: str) -> Optional[tuple]:
    """(device, inode) of the file at path (os.path.samefile's), None where it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_output_outside_data(cfg: TrainConfig, output, named: str, what: str, instead: str) -> None:
    """Raises ValueError when `output` (a directory the run writes, `named` so by the
    message: "[ps] path", "--report") is inside a local data directory (data.source or
    data.eval_source) under names its listing takes: a directory gives its files at
    every depth, so `what` it holds would be read as data by a later run or a resume
    (a growing directory: as they are written). So is one where a local glob among
    them would list a file it holds ("data/**" or "data/*/*" takes data/run/'s), as
    list_files expands it. Compared by real paths, so that a link or ".." does not hide it."""
    real = os.path.realpath(output)
    for name in ("source", "eval_source"):
        for path, is_glob in _local_sources(getattr(cfg.data, name)):
            if is_glob and hdata.files._glob_takes(path, real, below=True):
                raise ValueError(f"{named} {os.fspath(output)} is inside what the data glob {path} (data.{name}) "
                                 f"lists, whose files are read: {what} would be read as data; {instead}, or under "
                                 f"a name starting with '.' or '_'")
            if not is_glob and _listed_under(real, path):
                raise ValueError(f"{named} {os.fspath(output)} is inside the data directory {path} (data.{name}), "
                                 f"whose files are read at every depth: {what} would be read as data; {instead}, "
                                 f"or under a name starting with '.' or '_'")


def _local_sources(given) -> list:
    """(path, whether a glob) of each local glob or directory among [data] source or
    eval_source (a path or a list), told apart as list_files tells them."""
    paths = given if isinstance(given, (list, tuple)) else [given] if given else []
    return [(p, hdata.files._glob.has_magic(p)) for p in map(os.fspath, paths)
            if p != "synthetic" and "://" not in p and (hdata.files._glob.has_magic(p) or os.path.isdir(p))]


def _held_files(held: str) -> list:
    """The files held-out data names (a file, a directory's, a glob's), as listed; none
    where it names none (its reader names that)."""
    try:
        return hdata.files._expand(held)
    except (OSError, ValueError):
        return []


def _listed_under(path: str, directory: str) -> bool:
    """Whether `path` (real) lies under `directory` by names its listing takes (none
    starting with "." or "_"): under its real path, or under the target of a link
    to a directory that its listing follows."""
    for root in hdata.files._listed_roots(directory):
        inside = os.path.relpath(path, root).split(os.sep)
        if inside[0] != ".." and all(hdata.files._visible(part) for part in inside if part != "."):
            return True
    return False


def _source_name(source) -> str:
    """[data] source or eval_source as a message names it (a path, a glob, or a list of them)."""
    return ", ".join(map(os.fspath, source)) if isinstance(source, (list, tuple)) else os.fspath(source)


def _check_data_has_examples(cfg: TrainConfig, node: Optional[Node], rank: int, world: int) -> None:
    """Refuses files that give no example at all (each one empty, a header alone, or
    every line malformed and skipped) before anything is written: such a run trained
    nothing, wrote a checkpoint and a summary, and ended as a success. The first
    example is read from a reader of its own (the run's reads its pass from the
    start). Under mpiexec the job's data must have one: a rank without any steps
    through the others' batches. A growing directory (online) is read up to its first
    example, waiting for it as the run would, or to its stop condition: every rank
    reads the whole directory, since a rank's own files may come only as the stream
    ends (each file goes to the rank its name hashes to)."""
    d = cfg.data
    if d.source == "synthetic":
        return
    growing = cfg.online and _online_directory(d) is not None

    def first_example() -> tuple[bool, int, int]:
        reader = _one_pass(cfg, 0, 1) if growing else _one_pass(cfg, rank, world)
        # Files: up to the first example, so that a malformed line after it (in the same
        # block, or the same batch) is not raised here by a run that trains fewer examples.
        batches = iter(reader if growing else hdata.FirstExamples(reader, 1))
        try:
            return next(batches, None) is not None, len(reader.files_read if growing else reader.files), \
                reader.malformed
        finally:
            batches.close()
    found = _collective(node, first_example)
    if node is not None:
        every = node.allgather("train", found, "whether the data holds an example")
        total = max if growing else sum  # (each rank read the same directory)
        found = (any(f[0] for f in every), total(f[1] for f in every), total(f[2] for f in every))
    has, files, malformed = found
    if has:
        return
    raise ValueError(f"{_source_name(d.source)}: the training data holds no examples ({files} file(s)"
                     + (f", {malformed:,} malformed line(s) skipped" if malformed else "")
                     + (" read before the online stop condition" if growing else "") + "); nothing was written")


def _eval_batches(cfg: TrainConfig) -> list:
    d = cfg.data
    if d.source == "synthetic":
        kw = {"vocab_sizes": d.vocab_sizes} if d.vocab_sizes else {}
        if d.multi_hot:
            kw.update(multi_hot=[tuple(f) for f in d.multi_hot], bag_length=d.bag_length)
        return list(hdata.SyntheticCriteo(seed=d.seed, batch_size=d.batch_size, examples=d.eval_examples,
                                          part="eval", zipf_a=d.zipf_a, **kw))
    if not d.eval_source or d.eval_examples == 0:  # 0: no held-out examples, as synthetic data's
        return []
    out = _EvalBatches()
    reader = hdata.open_criteo(d.eval_source, d.batch_size, format=d.format, skip_malformed=d.skip_malformed) \
        if d.schema is None else hdata.open_schema(d.eval_source, d.schema, d.batch_size, format=d.format,
                                                   skip_malformed=d.skip_malformed)
    # The batch that crosses the count cut short, as train_examples'; a malformed line past
    # the count, in a block read whole, is neither raised nor counted.
    out.extend(hdata.FirstExamples(reader, d.eval_examples))
    out.malformed, out.malformed_examples = reader.malformed, list(reader.malformed_examples)
    if d.schema is not None and out:  # what the training data's fields are held to (_check_eval_fields)
        out.fields, out.fields_file = reader.fields(), reader.widths_file()
    if not out:  # (evaluations would score nothing and report no AUC, as if none were asked for)
        raise ValueError(f"{_source_name(d.eval_source)}: the held-out data (data.eval_source) holds no examples "
                         f"({len(reader.files)} file(s)" + (f", {reader.malformed:,} malformed line(s) skipped"
                                                          if reader.malformed else "") + "); nothing was written")
    return out


def _has_held_out(d: DataConfig) -> bool:
    """Whether [data] gives evaluations examples to score (_eval_batches): synthetic
    data's eval stream, or eval_source's files. Without them an evaluation scores
    nothing and admission keeps no sketch for it."""
    return d.eval_examples > 0 and (d.source == "synthetic" or bool(d.eval_source))


class _EvalBatches(list):
    """The held-out batches, the malformed lines skipped reading them (skip_malformed),
    and a schema's fields of the first file with data (None: Criteo's) and that file."""
    malformed = 0
    malformed_examples: list = []
    fields: Optional[tuple] = None
    fields_file: Optional[str] = None


def _check_eval_fields(source, eval_batches) -> None:
    """Raises ValueError unless the held-out data give the training data's fields (names
    and order), as every file of one data set must: the counts alone let eval data of the
    columns in another order by, and its rows were scored with one column's values as
    another's field."""
    got = getattr(eval_batches, "fields", None)
    fields = getattr(source, "fields", None)
    want = fields() if got is not None and callable(fields) else None
    if want is not None and got != want:
        from hps.data.tabular import _describe
        raise ValueError(f"{eval_batches.fields_file}: the schema gives other fields here than in the training "
                         f"data's {source.widths_file()} ({_describe(got)} against {_describe(want)})")


def _malformed_report(cfg: TrainConfig, source, eval_batches) -> Optional[dict]:
    """What skip_malformed left out, for the summary: the lines skipped in the training
    data's last pass (this rank's files; run() sums the ranks') and in the held-out data,
    with the first messages."""
    if not cfg.data.skip_malformed:
        return None
    report = {}
    for name, reader in (("train", source), ("eval", eval_batches)):
        count = getattr(reader, "malformed", None)
        if isinstance(count, int):
            report[name] = {"malformed": count, "malformed_examples": list(reader.malformed_examples)}
    return report or None


# ---------------------------------------------------------------- training

class Trainer:
    """The model, its dense optimizer and the parameter server, stepped by the pipeline.

    With a `node` (hps.distributed.Node) the parameter server is this rank's shard
    of the job's (``<path>/rank<r>``) and the dense parameters are kept in step
    with the other ranks' (DenseSync)."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, node: Optional[Node] = None,
                 checkpoint: Union[int, None, str] = LAST, widths: tuple = (13, 26, 0), defer_dense: bool = False,
                 window_room: Optional[int] = None):
        """``checkpoint``: in a job, the checkpoint job.json names (None: none yet),
        to which this rank rolls back; alone, LAST (the last one finished). ``widths``:
        the data's dense features, single-hot and multi-hot fields (Criteo's by default).
        ``defer_dense``: a resumed MLP, its optimizer and dense sync are loaded by
        :meth:`load_dense_state`, once a dense hook has replaced them (hps.hierarchical's
        split MLP saves a state the unsplit one cannot take). ``window_room``: the bytes
        of [ps] lookahead_room = "auto" (train's check_lookahead_room; None: sized for the
        data config's batches, window_batch_keys)."""
        torch = import_torch()
        self.torch = torch
        self.cfg = cfg
        self.node = node
        self.thread_tuner = None
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        else:
            self.thread_tuner = ThreadTuner(torch, usable_cpus())
        ps_cfg = cfg.ps
        if node is not None:
            # Under mpiexec, schedule = "herald" makes each rank a worker (HeraldServer);
            # the rank's own store serves the keys it owns as in a sequential job.
            ps_cfg = dataclasses.replace(cfg.ps, path=os.path.join(cfg.ps.path, f"rank{node.rank}"),
                                         schedule="sequential")
        if cfg.ps.lookahead and cfg.ps.lookahead_room == "auto":
            # The room this run's window needs, not the budget's 16th a server alone takes:
            # a window past that room raised CacheFullError at the first batch.
            if window_room is None:
                window_room = lookahead_room(cfg, window_batch_keys(cfg, widths, 1 if node is None else node.size))
            ps_cfg = dataclasses.replace(ps_cfg, lookahead_room=window_room)
        path = ps_cfg.path
        job = os.path.join(cfg.ps.path, JOB_MANIFEST)
        if node is None and os.path.exists(job):
            manifest = read_job_record(job)  # (damaged: named, before anything of the job is touched)
            world = manifest["world"]
            if not resume or manifest.get("checkpoint") is None:
                raise ValueError(f"{cfg.ps.path} holds a distributed job of {world} ranks; run it with "
                                 f"mpiexec -n {world} hps train ..." + (
                                     ", or pass --resume to continue it in this one process"
                                     if manifest.get("checkpoint") is not None else ""))
            with reshard.Hold(cfg.ps.path) as hold:  # (let go before the server below opens at the root)
                # back to one process: a parameter server at the root
                _plan_reshard(cfg.ps.path, 1, cfg, hold, widths, ranks=False)
                _, new, rows = reshard.to_one_process(cfg.ps.path, hold)
            _notice(f"resharded: {rows:,} rows now in one process as checkpoint {new}")
        if node is None:
            reshard.remove_old_ranks(cfg.ps.path)  # (what a crash right after such a reshard's switch left)
            if resume:
                _remove_lock_only_ranks(cfg.ps.path, 0)  # (a one-process server has no rank directories)
        has_ps, stored = stored_checkpoint(path)
        if node is None:
            if has_ps and stored is not None and not resume:
                raise ValueError(f"{path} already holds a parameter server (checkpoint {stored}); pass --resume "
                                 f"to continue it, or give a new path")
            if resume and not has_ps and not (os.path.isdir(path) and os.listdir(path)):
                _notice(f"--resume: {path} holds no checkpoint yet: starting from batch 0")
            checkpoint = stored
        if has_ps and checkpoint is None:
            _discard_run(path)  # nothing durable to keep; a new config may differ in layout
            if node is None:  # (said once it is so: a run still running there is refused above)
                _notice(f"{path} holds a run that ended before its first checkpoint: starting it over "
                        f"from batch 0")
        self.state_dir = path
        opened = time.perf_counter()
        # What was read above, before the server took the path's lock (a reshard's
        # hold is let go before it), must still be so once it holds it: another run
        # may have checkpointed or resharded in between, and opening at what this
        # one read would roll that back.
        if node is None:
            unchanged = _server_still_at(path, stored if has_ps else None)
        else:
            unchanged = _job_still_at(cfg.ps.path, node.size, checkpoint)
        self.ps = ParameterServer(ps_cfg, checkpoint=checkpoint, before_restore=unchanged)
        self.ps_open_seconds = time.perf_counter() - opened  # a prefault's cost shows here, not in training
        # A summary written aside by a run killed before its rename (_write_json_atomic):
        # the server holds the path's lock now, and a resume that finds the data done
        # writes none, so it stayed for good.
        _remove_tree(os.path.join(path, SUMMARY + ".tmp"))
        self.local_ps = self.ps
        try:
            self._set_up(node, widths, defer_dense, checkpoint)
        except BaseException:
            # Failed with the server open (a resume whose MLP cannot take the checkpoint's:
            # another `hidden`): closed now, as train() closes a run that fails. The error's
            # traceback holds this trainer (an interactive session keeps it), and with it
            # the server's lock on the path, so the corrected run in this process was
            # refused ("another parameter server has this path open") until the garbage
            # collector ran. Closing writes nothing; a close that fails too leaves the
            # server to the collector: the setup's error is the one to report.
            try:
                self.local_ps.close()
            except Exception:  # noqa: BLE001
                pass
            raise

    def _set_up(self, node: Optional[Node], widths: tuple, defer_dense: bool,
                checkpoint: Union[int, None, str]) -> None:
        """The rest of __init__, once the parameter server is open: the model, its
        replicas and optimizers, admission, and a resumed run's dense state."""
        from hps.torch import CtrModel, DeviceReplicas
        torch, cfg = self.torch, self.cfg
        self.widths = widths
        self.model = CtrModel(self.ps, num_fields=widths[1], num_dense=widths[0], hidden=cfg.hidden, seed=cfg.seed,
                              num_bags=widths[2], pooling=cfg.pooling)
        #: The dense model of each worker (device g of the tier) on its device; self.model is
        #: replica 0, the one the optimizer steps and the checkpoint keeps.
        self.replicas = DeviceReplicas(self.model, worker_devices(cfg, torch),
                                       shared=[m for m in (self.model.embedding, self.model.bag_embedding) if m],
                                       per_worker=cfg.dense_replica_per_worker)
        self.dense_sync = None
        params = list(self.model.mlp.parameters())
        if node is None:
            self.opt = dense_adam(params, cfg.dense_lr)
        else:
            if cfg.ps.schedule == "herald":
                from hps.distributed.herald import HeraldServer
                # an example's bytes on the wire: its keys, dense features and label
                self.ps = HeraldServer(self.ps, node, cfg.ps.worker_cache_rows,
                                       example_bytes=8 * widths[1] + 4 * (widths[0] + 1))
            else:
                self.ps = DistributedServer(self.ps, node, sparse_rows=cfg.distributed.sparse_rows,
                                            sparse_grads=cfg.distributed.sparse_grads)
            self.model.embedding.ps = self.ps
            self.dense_sync = DenseSync(node, params, cfg.dense_lr, cfg.distributed)
            self.opt = self.dense_sync.make_optimizer(lambda ps_: dense_adam(ps_, cfg.dense_lr))
        self.loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
        #: [admission]: rewrites the batches' keys (read stage, evaluation); its sketch is checkpointed.
        self.admission = Admission(cfg.admission.threshold, cfg.admission.sketch_bytes)
        if self.admission.enabled:  # the default row's gradients are dropped
            self.model.embedding.frozen_key = ADMISSION_DEFAULT_KEY
        self.batches_done = 0
        self.examples_done = 0
        # In a job, the examples of this rank's own data trained, by whichever rank
        # (examples_done is the job's; Herald's schedule moves examples between ranks):
        # where a resumed rank picks up in its data.
        self.rank_examples_done: Optional[int] = 0
        self.history: list[dict] = []
        #: Online: each step's logits as (rows, logits) a mini-batch, taken before its update; None: not kept.
        self.step_logits: Optional[list] = None
        #: Online: the progressive window (hps.progressive), kept in each checkpoint.
        self.online_window = None
        self.online_state: Optional[dict] = None  # a resumed run's window, for _train to load
        #: Online, a growing directory: the source, whose files read (in order) each checkpoint keeps ...
        self.online_source = None
        self.online_files: Optional[list] = None  # ... and a resumed run's, for _train to replay
        #: Files: this rank's data files in the order it reads them, which each checkpoint keeps ...
        self.data_files: Optional[list] = None
        self.resumed_data_files: Optional[dict] = None  # ... and a resumed run's, for _train to check
        #: More files for each checkpoint, written in its directory after the dense state and
        #: before the checkpoint is named (hps.hierarchical: the group PSs' blocks, the centre's).
        self.checkpoint_files: Optional[Callable[[str], None]] = None
        self._defer_dense = defer_dense
        self._dense_state: Optional[dict] = None  # deferred: loaded by load_dense_state
        if checkpoint is not None:
            self._load_state()

    # -- state
    def _load_state(self) -> None:
        """The dense state saved in the checkpoint the parameter server resumed from."""
        path = os.path.join(self.local_ps.checkpoint_dir(), TRAINER_STATE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"--resume: {path} is missing: checkpoint {self.local_ps.checkpoint_number} "
                                    f"of {self.state_dir} holds no dense state (not made by hps train)")
        if os.path.exists(os.path.join(self.local_ps.checkpoint_dir(), HT_LAYOUT)) and not self._defer_dense:
            # (hps.hierarchical checks the other way: a checkpoint without it is not its job's)
            raise ValueError(f"--resume: checkpoint {self.local_ps.checkpoint_number} of {self.state_dir} was "
                             f"written by a hierarchical job (its MLP split over group PSs, {HT_LAYOUT}): resume it "
                             f"with the same [hierarchical] table")
        state = self.torch.load(path, weights_only=False, map_location="cpu")  # (saved on any device)
        self._dense_state = {k: state[k] for k in ("mlp", "opt", "dense_sync") if k in state}
        if not self._defer_dense:
            self.load_dense_state()
        self.batches_done, self.examples_done = state["batches_done"], state["examples_done"]
        own = state.get("rank_examples")  # (None: a checkpoint of before, or of another number of ranks)
        self.rank_examples_done = own["examples"] if own is not None and self.node is not None and \
            (own["rank"], own["world"]) == (self.node.rank, self.node.size) else None
        self.history = state.get("history", [])
        self.online_state = state.get("online_window")
        self.online_files = state.get("online_files")
        self.resumed_data_files = state.get("data_files")
        self.admission.load_state_dict(state.get("admission", {"threshold": 1, "default_reads": 0, "eval_reads": 0,
                                                              "eval_default_reads": 0, "sketch": None}))

    def load_dense_state(self) -> None:
        """The MLP, its optimizer and the dense sync as the checkpoint resumed from
        holds them (a no-op without one, or again)."""
        state, self._dense_state = self._dense_state, None
        if state is None:
            return
        self.model.mlp.load_state_dict(state["mlp"])
        self.opt.load_state_dict(state["opt"])  # (its state moves to the parameters' device)
        self.replicas.broadcast()
        if self.dense_sync is not None:
            self.dense_sync.load_state_dict(state["dense_sync"])

    def checkpoint(self) -> None:
        """One checkpoint of the whole model: the parameter server's snapshot, with
        the dense state (MLP, optimizer, counters) saved inside it, so both name
        the same batch and a crash at any point leaves the previous checkpoint
        whole. In a job: every rank's (keeping its previous one), then rank 0
        records in job.json the checkpoint every rank finished, and only then
        do the ranks drop their previous ones."""
        state = {"mlp": self.model.mlp.state_dict(), "opt": self.opt.state_dict(),
                 "batches_done": self.batches_done, "examples_done": self.examples_done,
                 "history": self.history}
        if self.node is not None and self.rank_examples_done is not None:
            state["rank_examples"] = {"rank": self.node.rank, "world": self.node.size,
                                      "examples": self.rank_examples_done}
        if self.dense_sync is not None:
            state["dense_sync"] = self.dense_sync.state_dict()
        if self.online_window is not None:
            state["online_window"] = self.online_window.state_dict()
        if self.data_files is not None:
            rank, world = (self.node.rank, self.node.size) if self.node is not None else (0, 1)
            state["data_files"] = {"rank": rank, "world": world, "files": list(self.data_files)}
        if self.online_source is not None:  # (read ahead of this batch too: replayed in the same order)
            state["online_files"] = [self.online_source.name(p) for p in list(self.online_source.files_read)]
        if self.admission.enabled:  # the sketch's counters: a resumed run admits as this one would
            state["admission"] = self.admission.state_dict()
        buf = io.BytesIO()
        self.torch.save(state, buf)
        data = buf.getvalue()

        def save(directory: str) -> None:
            write_trainer_state(directory, data, self.batches_done, self.examples_done)
            if self.checkpoint_files is not None:
                self.checkpoint_files(directory)

        if self.node is None:
            self.ps.checkpoint(save)
            return
        number = self.ps.checkpoint(save, keep_previous=True)
        done = self.node.allgather("train", (number, self.batches_done), "checkpoint")
        if len(set(done)) > 1:
            detail = ", ".join(f"rank {r}: checkpoint {n} at batch {b}" for r, (n, b) in enumerate(done))
            raise RuntimeError(f"the ranks' checkpoints disagree ({detail})")
        if self.node.rank == 0:
            manifest = os.path.join(self.cfg.ps.path, JOB_MANIFEST)
            # The job's run goes on (a job.json before ids: one now).
            run = read_job_record(manifest).get(RUN) or new_run_id()
            _write_json_atomic(manifest, {"world": self.node.size, "step": self.batches_done, "checkpoint": number,
                                          RUN: run})
        self.node.allgather("train", None, "checkpoint recorded in job.json")
        self.ps.prune_checkpoints()

    # -- steps
    def step(self, loaded: Loaded) -> None:
        """Forward and backward over each device's mini-batch, on that worker's replica
        of the dense model (gradients go to the owners and add up), then the replicas'
        dense gradients summed and one dense step for the whole batch (of every rank),
        copied to every replica."""
        torch = self.torch
        examples = loaded.data  # the examples batch; loaded.batch is the working set of its keys
        n = max(getattr(examples, "total_examples", len(examples.labels)), 1)
        self.opt.zero_grad()
        emb = self.model.embedding
        for worker, idx, batch in self._calls(loaded, examples):
            model = self.replicas.replica(worker)
            emb.attach(batch, worker)
            rows = _as_slice(idx)
            keys = torch.from_numpy(examples.keys[rows].view(np.int64))
            if getattr(examples, "bags", None):  # multi-hot fields (a schema's)
                logits = model(keys, torch.from_numpy(examples.dense[rows]), _bag_inputs(examples.rows(idx)))
            else:
                logits = model(keys, torch.from_numpy(examples.dense[rows]))
            labels = torch.from_numpy(examples.labels[rows]).to(logits.device, non_blocking=True)
            loss = self.loss_fn(logits, labels) / n
            if not torch.isfinite(loss):  # before backward: no NaN reaches a row, the MLP or a checkpoint
                raise _diverged(self, loss.item(), f"worker {worker}")
            loss.backward()
            if self.step_logits is not None:
                self.step_logits.append((idx, logits.detach().cpu().numpy()))
        emb.attach(None)
        self.replicas.reduce_gradients()
        if self.dense_sync is not None:
            self.dense_sync.reduce_gradients()
        self.opt.step()
        if self.dense_sync is not None:
            self.dense_sync.after_step()
        self.replicas.broadcast()

    def _calls(self, loaded: Loaded, examples):
        """(worker, its examples, the batch it reads) for each call of the model
        in a step: one a worker with examples; or, where every worker trains on
        one replica (host partitions, the MLP on the CPU) and the fields are
        single-hot, one call over all of them, the workers' examples one after
        another, whose lookups and gradients WorkerShares splits by worker (the
        tier still moves and counts each worker's rows). A model call has a
        fixed cost whatever its examples: two calls a batch made the device-tier
        path on 2 host partitions 0.84x the in-place path on W4s (16 hidden units)."""
        shares = [(w, idx) for w, idx in enumerate(loaded.minibatches) if len(idx)]
        if len(shares) < 2 or len(self.replicas) > 1 or getattr(examples, "bags", None):
            return [(w, idx, loaded.batch) for w, idx in shares]
        from hps.torch import WorkerShares
        workers, parts = zip(*shares)
        return [(0, np.concatenate(parts), WorkerShares(loaded.batch, workers, [len(p) for p in parts]))]

    def evaluate(self, batches: list) -> dict:
        """AUC and logloss over `batches`; in a job, rank r scores batches r, r+N, ...
        (every rank takes part in every round's pull) and all ranks get the metrics."""
        torch = self.torch
        if not batches:
            return {}
        node = self.node
        if node is None:
            mine = list(batches)
        else:
            rounds = -(-len(batches) // node.size)
            mine = [batches[i] if i < len(batches) else None for i in range(node.rank, rounds * node.size, node.size)]
        labels, probs = [], []
        self.admission.begin_evaluation(self.batches_done)  # the sketch as the batches trained left it
        with torch.no_grad():
            for b in mine:
                if b is None:
                    # This rank's part of the round's exchanges: one pull for the
                    # single-hot fields and one a multi-hot field, as the model makes.
                    n_dense, n_fields, n_bags = self.widths
                    for _ in range((1 if n_fields else 0) + n_bags):
                        self.ps.pull(np.empty(0, np.uint64))
                    continue
                b = self.admission.eval_batch(b)  # keys never admitted read the default row
                logits = self.model(torch.from_numpy(b.keys.view(np.int64)), torch.from_numpy(b.dense),
                                    *((_bag_inputs(b),) if getattr(b, "bags", None) else ()))
                probs.append(torch.sigmoid(logits).cpu().numpy())
                labels.append(b.labels)
        self.admission.end_evaluation()
        y = np.concatenate(labels) if labels else np.empty(0, np.float32)
        p = np.concatenate(probs) if probs else np.empty(0, np.float32)
        if node is not None:
            adm = self.admission
            parts = node.allgather("train", (y, p, adm.eval_reads, adm.eval_default_reads), "evaluation scores")
            y = np.concatenate([a for a, *_ in parts])
            p = np.concatenate([b for _, b, *_ in parts])
            adm.eval_reads, adm.eval_default_reads = sum(x[2] for x in parts), sum(x[3] for x in parts)  # the job's
        return {"auc": auc(y, p), "logloss": logloss(y, p), "eval_examples": len(y)}


def worker_devices(cfg: TrainConfig, torch) -> list:
    """The device each worker's dense replica trains on, by cfg.model_devices: worker
    g (device g of the tier) on GPU g, or every worker on the CPU. "auto" takes the
    GPUs when the device tier is on them (hps and torch see at least [ps] devices)."""
    g = cfg.ps.devices
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = cfg.model_devices
    if want == "auto":
        want = "cuda" if _core.cuda_device_count() >= g and gpus >= g else "cpu"
    if want == "cpu":
        return ["cpu"] * g
    if gpus < g:
        raise ValueError(f"model_devices = \"cuda\" trains worker g on GPU g: [ps] devices = {g} needs {g} GPU(s), "
                         f"and torch sees {gpus}")
    return [f"cuda:{w}" for w in range(g)]


def _diverged(trainer, loss: float, where: str) -> DivergedError:
    """The error of a step whose loss is not a number (`where`: the model call's
    worker, and Hogwild net), raised before its backward pass (hps.hierarchical.hogwild's
    step too): no NaN reaches a row, the MLP or a checkpoint."""
    return DivergedError(f"batch {trainer.batches_done + 1}: the loss is {loss} ({where}): training diverged (a "
                         f"learning rate too high? dense_lr = {trainer.cfg.dense_lr}, [ps.optimizer] lr = "
                         f"{trainer.cfg.ps.optimizer.lr})")


def _as_slice(idx: np.ndarray):
    """idx as a slice where it is a run of consecutive rows (a sequential partition's
    mini-batch), so that indexing gives views: a copy of a batch's keys took 5% of
    the train thread on W4s (py-spy), and the host batch knows its keys' positions
    only for the keys it prefetched, where they lie (HostBatch.positions)."""
    if len(idx) and idx[-1] - idx[0] == len(idx) - 1 and bool(np.all(np.diff(idx) == 1)):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _bag_inputs(examples) -> list:
    """A batch's multi-hot fields as CtrModel's bags: (keys, offsets, weights) tensors a field."""
    torch = import_torch()
    return [(torch.from_numpy(b.keys.view(np.int64)), torch.from_numpy(b.offsets[:-1]),
             None if b.weights is None else torch.from_numpy(b.weights)) for b in examples.bags]


def _widths(cfg: TrainConfig, source) -> tuple:
    """(dense features, single-hot fields, multi-hot fields) of the data: Criteo's, or
    those of the schema's first file."""
    widths = getattr(source, "widths", None)
    if widths is not None:
        return widths()
    if isinstance(source, (list, tuple)) and source:  # batches given in memory: the first one's
        b = source[0]
        return b.dense.shape[1], b.keys.shape[1], len(getattr(b, "bags", ()))
    return 13, 26, 0


def _widths_origin(source) -> tuple[bool, Optional[str]]:
    """(whether `source` holds a file or batch, the file _widths takes its fields from:
    None where they are no file's, as synthetic data's, a libsvm schema's or the batches
    given in memory's), for the message of ranks whose fields differ. A rank of no file
    or batch has no fields to compare, whatever _widths assumed for it."""
    shaped_by = getattr(source, "widths_file", None)
    if shaped_by is not None:
        return True, shaped_by()
    if isinstance(source, (list, tuple)):
        return bool(source), None
    files = getattr(source, "files", None)  # (Criteo's readers: its fixed fields, in every file)
    if files is not None:
        return bool(files), files[0] if files else None
    return True, None


def _different_fields(every: list) -> str:
    """The message for ranks whose data give other fields than rank 0's: rank 0's and
    each differing rank's, with the file each took them from. `every`: each rank's
    (widths or None for a rank without data, file or None)."""
    def said(rank: int, widths: Optional[tuple], path: Optional[str]) -> str:
        if widths is None:
            return f"rank {rank} has no file (nor batch) to take them from"
        return f"rank {rank}: {widths}" + (f" from {path}" if path is not None else "")
    differ = [said(r, *e) for r, e in enumerate(every) if r and e[0] != every[0][0]]
    return (f"the ranks' data give different fields (dense, single-hot, multi-hot): {said(0, *every[0])}; "
            + "; ".join(differ) + " (every rank's data must give the same fields)")


def _check_same_files(cfg: TrainConfig, node: Node, source) -> None:
    """Every rank must list the same data files in the same order: each lists them itself
    and reads files[rank::world] of its own list, so ranks whose lists differ (a relative
    glob in another working directory, a part written while the job started) read
    overlapping shards and leave others unread, without a word. So must each local file
    be of one size on every rank: a relative path names another file in another working
    directory (or on another host), and lists of the same names then read shards of
    different data sets, also without a word (copies of the data, at one place or at
    several, are of one size). Raises on every rank, naming a file where the lists
    part. A source without a file list (synthetic data, a growing directory, which
    shares its files by name) has nothing to check."""
    files = getattr(source, "all_files", None)
    every = node.allgather("train", None if files is None else (files, [_file_size(f) for f in files]),
                           "the data files")
    lists = [None if e is None else e[0] for e in every]
    for r, mine in enumerate(lists):
        if mine != lists[0]:
            raise ValueError(f"the ranks list different data files (data.source = "
                             f"{_source_name(cfg.data.source)!r}): {_where_lists_part(lists[0], mine, r)}; rank r "
                             f"reads files[r::world] of its own list, so the ranks would read overlapping files "
                             f"and leave others unread: give every rank the same files (absolute paths; no file "
                             f"added while the job starts)")
    if files is None:
        return
    for r, (_, sizes) in enumerate(every):
        i = next((i for i, (a, b) in enumerate(zip(every[0][1], sizes)) if a and a[0] != b[0]), None)
        if i is not None:
            (size0, real0), (size, real) = every[0][1][i], sizes[i]
            raise ValueError(f"the ranks' data files differ (data.source = {_source_name(cfg.data.source)!r}): "
                             f"{files[i]} is {_size_name(size0)} on rank 0 ({real0}) and {_size_name(size)} on "
                             f"rank {r} ({real}): they would read parts of different data as one data set; give "
                             f"every rank the same files (absolute paths, or copies; none written while the job "
                             f"starts)")


def _file_size(path: str) -> Optional[tuple]:
    """(size in bytes or None where it is gone, real path) of a local data file, for
    _check_same_files; None for a URL (one object, whichever rank reads it)."""
    if "://" in path:
        return None
    try:
        size = os.stat(path).st_size
    except OSError:  # (gone since the listing: its reader names it)
        size = None
    return size, os.path.realpath(path)


def _size_name(size: Optional[int]) -> str:
    return "missing" if size is None else f"{size:,} bytes"


def _check_same_field_names(node: Node, source) -> None:
    """Each rank holds its files to its own first file's fields, and the ranks compare how
    many fields their data give (_different_fields): a rank whose files have the columns
    in another order (site, os against os, site) trained one column's values as another's
    field, without a word. Raises on every rank, naming both ranks' first files. (Criteo's
    fields are fixed; a growing directory's are its first file's with fields, and agree()
    then holds every rank's files to rank 0's.)"""
    def names():
        fields = getattr(source, "fields", None)
        got = fields() if callable(fields) else None  # (the first file with data's)
        return got, source.widths_file() if got is not None else None
    every = node.allgather("train", _collective(node, names), "the data's field names")
    first, where = every[0]
    for r, (mine, my_where) in enumerate(every):
        if first is not None and mine is not None and mine != first:
            from hps.data.tabular import _describe
            raise ValueError(f"the ranks' data give other fields: rank 0's {where} {_describe(first)}; rank "
                             f"{r}'s {my_where} {_describe(mine)} (every file of a data set must give the same "
                             f"fields, in the same order)")


def _where_lists_part(first: Optional[list], mine: Optional[list], r: int) -> str:
    """Where rank r's file list differs from rank 0's, for _check_same_files' message."""
    if first is None or mine is None:
        return f"rank 0 reads {'no ' if first is None else ''}files, rank {r} {'no ' if mine is None else ''}files"
    theirs, ours = set(first), set(mine)
    extra = next(((i, f) for i, f in enumerate(mine) if f not in theirs), None)
    lacking = next(((i, f) for i, f in enumerate(first) if f not in ours), None)
    if extra is not None:
        return f"{extra[1]} is rank {r}'s file {extra[0] + 1} of {len(mine)} and not among rank 0's {len(first)}"
    if lacking is not None:
        return f"{lacking[1]} is rank 0's file {lacking[0] + 1} of {len(first)} and not among rank {r}'s {len(mine)}"
    i = next(i for i, (a, b) in enumerate(zip(first, mine)) if a != b)
    return f"the same files in another order: file {i + 1} is {first[i]} on rank 0, {mine[i]} on rank {r}"


def _write_json_atomic(path: str, obj: dict) -> None:
    _write_durable(path + ".tmp", json.dumps(obj, indent=1).encode())
    _replace_durable(path + ".tmp", path)


def _notice(message: str) -> None:
    print(f"hps train: {message}", file=sys.stderr, flush=True)


def _remove_lock_only_ranks(root: str, first: int) -> None:
    """A resume's removal of the rank directories from `first` on that hold only their
    lock file (hps.reshard.remove_lock_only_ranks: a reshard killed before its ranks
    wrote them), each named, so that a directory the user saw does not go unsaid."""
    for path in reshard.remove_lock_only_ranks(root, first):
        _notice(f"--resume: removed {path}: it held only a writer lock file, left by a reshard that was cut "
                f"short before its rank wrote it; the job has no such rank")


def stored_checkpoint(path: str) -> tuple[bool, Optional[int]]:
    """(whether path holds a parameter server, the number of its last finished
    checkpoint or None)."""
    meta_path = os.path.join(path, METADATA)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return False, None
    if meta.get("format") != FORMAT_VERSION:  # never taken for a server without checkpoints, and discarded
        raise ValueError(f"{meta_path}: format {meta.get('format')}, this build reads {FORMAT_VERSION}")
    return True, meta.get("checkpoint")


def _changed_meanwhile(path: str, now, read) -> PathInUseError:
    return PathInUseError(f"{path}: another run changed it while this one was opening it (its checkpoint is "
                          f"now {now}, where this run read {read}); nothing was changed: run again")


def _server_still_at(path: str, checkpoint: Optional[int]):
    """ParameterServer's before_restore for one process: the server at path still
    names `checkpoint` as its last (None: none, or no server)."""
    def check(meta: Optional[dict]) -> None:
        now = None if meta is None else meta.get("checkpoint")
        if now != checkpoint:
            raise _changed_meanwhile(path, now, checkpoint)
    return check


def _job_still_at(root: str, world: int, checkpoint: Optional[int]):
    """ParameterServer's before_restore for a rank: the job's manifest still
    names this job's world and the checkpoint its ranks roll back to."""
    def check(meta: Optional[dict]) -> None:
        try:
            job = read_job_record(os.path.join(root, JOB_MANIFEST))
        except FileNotFoundError:
            job = {}
        if job.get("world") != world or job.get("checkpoint") != checkpoint:
            raise _changed_meanwhile(root, f"{job.get('checkpoint')} of {job.get('world')} ranks",
                                     f"{checkpoint} of {world} ranks")
    return check


def load_trainer_state(path: str) -> dict:
    """The dense state (``mlp``, ``opt``, ``batches_done``, ...) of the last
    checkpoint of the parameter server at path (a job's: ``<path>/rank<r>``)."""
    import torch
    has_ps, number = stored_checkpoint(path)
    if number is None:
        raise FileNotFoundError(f"{path} holds no checkpoint" + ("" if has_ps else " (no parameter server)"))
    return torch.load(os.path.join(path, CHECKPOINTS, f"{number:06d}", TRAINER_STATE), weights_only=False,
                      map_location="cpu")


def _discard_run(path: str, held: bool = False) -> None:
    """Removes what a run that never finished a checkpoint left at path: nothing
    in it is durable state (a parameter server opens such a run empty anyway).
    Holds the path's writer lock throughout, so that a run still open there is
    refused (PathInUseError) before anything goes, and none opens there until
    the removal is done: a check that let go before removing left a window in
    which another run opened and lost its files. The lock file goes last, while
    held (_lock_path takes the path's new one then). `held`: the caller holds the
    lock (a reshard's hps.reshard.Hold) and goes on holding it: the lock file stays."""
    fd = None
    if not held:
        try:
            fd = _lock_path(path, doing="removing what a run that never checkpointed left")
        except PathInUseError as e:
            raise PathInUseError(f"{path} holds a run that has not finished a checkpoint and is still running: it "
                                 f"was not removed. {e}") from None
    try:
        # (with what a run killed between a write aside and its rename left: _write_json_atomic)
        names = (METADATA, METADATA + ".tmp", "ssd", "ssd.restore", CHECKPOINTS, SUMMARY, SUMMARY + ".tmp",
                 TRAINER_STATE)
        for name in names if held else names + (WRITER_LOCK,):
            _remove_tree(os.path.join(path, name))
    finally:
        if fd is not None:
            os.close(fd)


# Settings each rank may take for its own machine: they change how fast it runs or
# where it keeps rows, not what the ranks exchange or compute together.
MACHINE_SETTINGS = ("torch_threads", "helper_nice", "bind_cores", "sysfs", "keep_freed_memory", "model_devices",
                    "dense_replica_per_worker", "ps.mem_budget", "ps.prefault", "ps.devices", "ps.device_capacity",
                    "ps.write_buffer_rows", "ps.device_threads", "ps.host_in_place", "ps.topology", "ps.ssd",
                    "distributed.timeout")


def _job_settings(cfg: TrainConfig) -> dict:
    """cfg's settings that every rank of a job must share, flattened ("ps.optimizer.lr": 0.05)."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    def flatten(d: dict, prefix: str) -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flatten(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = plain(v)
        return out
    settings = flatten({**dataclasses.asdict(cfg), "ps": cfg.ps.to_dict()}, "")
    return {k: v for k, v in settings.items()
            if not any(k == m or k.startswith(m + ".") for m in MACHINE_SETTINGS)}


def _check_same_config(cfg: TrainConfig, node: Node) -> None:
    """Every rank must run the job's config (save MACHINE_SETTINGS): a rank given
    another dense_lr steps its copy of the MLP apart from the others' without a
    word, another codec or checkpoint_every puts its exchanges out of step. Raises
    on every rank, naming the settings that differ and each rank's value."""
    every = node.allgather("train", _job_settings(cfg), "the ranks' configs")
    names = sorted(set().union(*every))
    differ = [k for k in names if any(e.get(k) != every[0].get(k) for e in every)]
    if differ:
        detail = "; ".join(f"{k} = " + ", ".join(f"{e.get(k)!r} on rank {r}" for r, e in enumerate(every))
                           for k in differ[:4]) + ("; ..." if len(differ) > 4 else "")
        raise ValueError(f"the ranks run different configs ({detail}): every rank of a job must run the same "
                         f"one (only {', '.join(MACHINE_SETTINGS)} may differ)")


def _collective(node: Optional[Node], fn):
    """fn() on every rank; if it raises on any, every rank raises (naming the
    rank), so a setup error ends the job cleanly instead of leaving peers waiting.
    Any exception counts (a damaged store's CorruptionError too: one that went by
    left its peers waiting here until the watchdog's timeout). fn may run
    collectives itself (the Trainer's servers check their initial rows): a rank
    that failed before one meets its peers there, where Node.allgather raises
    RankFailure on every rank, naming what failed, or where every rank raises,
    having heard of it (Node.give_up); that is passed on as it is."""
    if node is None:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the peers wait here for this rank's word
        if raised_on_every_rank(e):
            raise  # every rank raised in the same exchange: none is owed here
        error = f"{type(e).__name__}: {e}"
    errors = node.allgather("train", error, "setup", note=error and f"rank {node.rank}: {error}")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise ValueError("; ".join(f"rank {r}: {e}" for r, e in failed))
    return result


def _prepare_job(cfg: TrainConfig, node: Node, resume: bool, widths: Optional[tuple] = None) -> Optional[int]:
    """Rank 0 checks <path>/job.json (world size; the checkpoint every rank
    finished), or writes a new one; every rank gets the checkpoint to roll back
    to (None: start from batch 0). `widths`: the data's fields, which a reshard
    checks against the job's MLP first. A reshard's rank 0 holds the job's directories
    (hps.reshard.Hold) from its check to its commit, and lets go before its own
    server opens."""
    hold = reshard.Hold(cfg.ps.path)

    def check():
        if node.rank != 0:
            return None
        root = cfg.ps.path
        manifest = os.path.join(root, JOB_MANIFEST)
        job = None
        if os.path.exists(manifest):
            job = read_job_record(manifest)  # (damaged: named, before anything of the job is touched)
        if resume and job is not None:  # (past both worlds: no directory a reshard takes or removes)
            _remove_lock_only_ranks(root, max(job["world"], node.size))
        if resume and job is not None and job["world"] != node.size and job.get("checkpoint") is not None:
            # (a job that never checkpointed starts over below)
            return _plan_reshard(root, node.size, cfg, hold, widths, ranks=True)
        if resume and job is None and stored_checkpoint(root)[1] is not None:
            return _plan_reshard(root, node.size, cfg, hold, widths, ranks=True)  # a one-process run's server
        if resume and job is not None and job["world"] == node.size:
            if reshard.RESHARDED in job:
                reshard.remove_old(root)  # what a crash right after the reshard's switch left
            if job.get("checkpoint") is None:
                _notice(f"--resume: the job at {root} ended before its first checkpoint: starting it over "
                        f"from batch 0")
            return job.get("checkpoint")
        if job is not None and job.get("checkpoint") is None:
            _notice(f"{root} holds a job that ended before its first checkpoint: starting it over from batch 0")
            for r in range(job["world"]):
                rank_dir = os.path.join(root, f"rank{r}")
                if os.path.isdir(rank_dir):
                    _discard_run(rank_dir)
                    if not os.listdir(rank_dir):
                        os.rmdir(rank_dir)
            os.remove(manifest)
        elif resume and os.path.exists(root) and os.listdir(root):
            raise FileNotFoundError(f"--resume: {root} holds no distributed job (no {JOB_MANIFEST})")
        elif resume:
            _notice(f"--resume: {root} holds no job yet: starting from batch 0")
        if os.path.exists(root) and os.listdir(root):
            raise ValueError(f"{root} is not empty; pass --resume to continue the job there, or give a new path")
        _make_dirs_durable(root)
        _write_json_atomic(manifest, {"world": node.size, "step": 0, "checkpoint": None, RUN: new_run_id()})
        return None
    try:
        number = _collective(node, check)
        number = node.allgather("train", number, "the job's checkpoint")[0]
        if isinstance(number, dict):  # the job ran on another number of ranks: reshard its checkpoint first
            def write():  # (under rank 0's hold of every directory written: reshard.take_new_ranks)
                return reshard.write_rank(cfg.ps.path, node.size, node.rank, held=True)
            done = node.allgather("train", _collective(node, write), "reshard")
            new = done[0][1]
            _collective(node, lambda: reshard.commit(cfg.ps.path, node.size, number, new, hold)
                        if node.rank == 0 else None)
            if node.rank == 0:
                _notice(f"resharded: {sum(d[2] for d in done):,} rows now on {node.size} ranks as checkpoint {new}")
            number = new
    finally:
        hold.release()
    return number


def _plan_reshard(root: str, world: int, cfg: TrainConfig, hold: "reshard.Hold", widths: Optional[tuple],
                  ranks: bool) -> dict:
    """Rank 0: the checkpoint to reshard, checked whole (hps.reshard) and against
    this run's config and data (`widths`: its dense, single-hot and multi-hot
    fields; `ranks`: the run is a job of ranks, not one process), and says so;
    the old job's directories stay locked in `hold`, and (`ranks`) the new ranks'
    too (hps.reshard.take_new_ranks: every rank writes under rank 0's locks)."""
    reshard.finish_removal(root)  # (the switch below replaces the record of what is left)
    old = reshard.check_source(root, hold)
    _check_resumable_with(cfg, root, widths, cfg.distributed.dense_sync if ranks else None)
    if ranks:  # (once nothing is refused: a refused resume writes nothing)
        reshard.take_new_ranks(root, world, hold)
    _notice(f"--resume: the job at {root} ran on {old['world']} rank(s), this run has {world}: resharding "
            f"its checkpoint {old['checkpoint']} (step {old['step']}) over {world} ranks")
    return old


def _check_resumable_with(cfg: TrainConfig, root: str, widths: Optional[tuple] = None,
                          dense_sync: Optional[str] = None) -> None:
    """Raises ValueError naming the field when the job at root cannot resume with
    cfg: the parameter server's layout ([ps] dim, optimizer kind, initializer,
    seed), the MLP (``hidden``; its input, from `widths`: the data's dense,
    single-hot and multi-hot fields), the dense optimizer ([distributed]
    `dense_sync`: the run's, None for one process) or [admission] (threshold,
    sketch bytes) of its checkpoint differ. A reshard checks this first: the
    parameter server and the trainer would refuse it only once the table had been
    resharded (the MLP's and optimizer's state load, or the first step, fails)."""
    from hps.jobdir import read_job
    job = read_job(root)
    mine, theirs = cfg.ps.layout(), job.config.layout()
    for name in ParameterServerConfig.LAYOUT_FIELDS:
        if mine[name] != theirs[name]:
            raise ValueError(f"--resume: the job at {root} has {name} = {theirs[name]!r}, this run's [ps] has "
                             f"{mine[name]!r}; nothing was resharded (resume with the job's {name})")
    if os.path.exists(os.path.join(job.checkpoint_dir(0), HT_LAYOUT)):
        # (its group PSs' blocks and centre live in the trainer ranks' checkpoints, for as many ranks)
        raise ValueError(f"--resume: the job at {root} is a hierarchical job ({job.checkpoint_dir(0)}/{HT_LAYOUT}): "
                         f"it cannot be resharded onto another number of ranks; nothing was resharded (resume it "
                         f"with its [hierarchical] layout and mpiexec -n)")
    path = os.path.join(job.checkpoint_dir(0), TRAINER_STATE)
    state = reshard._load_state(path)
    saved_in, saved_hidden = _mlp_widths(state["mlp"])
    if saved_hidden is not None and saved_hidden != list(cfg.hidden):
        raise ValueError(f"--resume: the job at {root} trained an MLP of hidden = {saved_hidden} ({path}), this "
                         f"run has hidden = {list(cfg.hidden)}; nothing was resharded (resume with the job's hidden)")
    if widths is not None and saved_in is not None:
        n_dense, n_fields, n_bags = widths
        wanted = (n_fields + n_bags) * cfg.ps.dim + n_dense
        if wanted != saved_in:
            raise ValueError(f"--resume: the job at {root} trained an MLP of {saved_in} inputs ({path}), this run's "
                             f"data has {n_dense} dense, {n_fields} single-hot and {n_bags} multi-hot fields, "
                             f"{wanted} inputs at dim {cfg.ps.dim}; nothing was resharded (resume on the job's "
                             f"data fields: [data] schema)")
    if dense_sync is not None:
        groups = state["opt"].get("param_groups") or [{}]
        kstep = "beta1" in groups[0] or any("m" in st for st in state["opt"].get("state", {}).values())
        saved_sync = "kstep" if kstep else "allreduce"  # (k-step Adam's groups and state; else torch's Adam)
        if saved_sync != dense_sync:
            raise ValueError(f"--resume: the job at {root} trained its MLP with [distributed] dense_sync = "
                             f"{saved_sync!r} ({path}: its optimizer's state), this run has {dense_sync!r}; "
                             f"nothing was resharded (resume with the job's dense_sync)")
    saved = state.get("admission") or {"threshold": 1}
    if saved["threshold"] != cfg.admission.threshold:
        raise ValueError(f"--resume: the job at {root} was trained with [admission] threshold = "
                         f"{saved['threshold']}, this run has {cfg.admission.threshold}; nothing was resharded")
    sketch = saved.get("sketch")
    if sketch is not None:
        rows = int(sketch["rows"])
        asked = parse_bytes(cfg.admission.sketch_bytes, "admission.sketch_bytes") // rows * rows
        if asked != int(sketch["bytes"]):
            raise ValueError(f"--resume: the job at {root} counts admission in a sketch of {sketch['bytes']:,} "
                             f"bytes, this run's [admission] sketch_bytes = {cfg.admission.sketch_bytes!r} "
                             f"({asked:,}); nothing was resharded")


def _mlp_widths(mlp: dict) -> tuple:
    """(input width, hidden widths) of a saved CTR MLP (hps.torch.mlp's Sequential:
    a Linear at every other index, the last of width 1); (None, None) for another
    network, which its own load then checks."""
    try:
        weights = sorted((int(name.split(".")[0]), tuple(v.shape)) for name, v in mlp.items()
                         if name.endswith(".weight"))
    except (ValueError, AttributeError):
        return None, None
    if not weights or any(len(shape) != 2 for _, shape in weights) or weights[-1][1][0] != 1:
        return None, None
    return weights[0][1][1], [shape[0] for _, shape in weights[:-1]]


def _check_resumed_step(trainer: Trainer) -> None:
    """Every rank resumed from the checkpoint job.json names: they must be at one step."""
    node = trainer.node
    steps = node.allgather("train", trainer.batches_done, "resume")
    if len(set(steps)) > 1:
        detail = ", ".join(f"rank {r} at batch {s}" for r, s in enumerate(steps))
        raise ValueError(f"the ranks' checkpoints named by {os.path.join(trainer.cfg.ps.path, JOB_MANIFEST)} "
                         f"are at different steps ({detail}); the job cannot resume consistently")


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True,
          on_eval: Optional[Callable[[dict], None]] = None, train_batches=None, eval_batches=None,
          node: Optional[Node] = None, dense_hook: Optional[Callable] = None, report=None) -> dict:
    """Trains per `cfg`; returns the summary (also written to <path>/train-summary.json).
    `train_batches` / `eval_batches` (iterables of hps.data.Batch) replace the
    sources cfg.data names: a benchmark feeds both sides the same batches from memory.
    `report`: the directory the caller writes the run's plots to once it returns
    (hps train --report), refused where the data's listing would take them
    (check_output_outside_data) before anything is written: under mpiexec by every
    rank together, as the job's [ps] path is.

    Under mpiexec (or given a `node`) this is one rank of a distributed job: every
    rank calls train() with the same cfg; `train_batches` are this rank's.
    `dense_hook(trainer)`, called once the Trainer is made, may replace its MLP,
    optimizer and dense sync (hps.hierarchical's split MLP does)."""
    if node is None and launched_by_mpi():
        node = Node(cfg.distributed)
    if node is not None:
        # First: each check below refuses a config on the rank that runs it, and a rank
        # given another config (another file on its host) refused its own while the
        # other ranks waited in this exchange until the watchdog's timeout.
        _check_same_config(cfg, node)
    _check_lookahead(cfg.ps, "[ps]")
    # GPUs this machine lacks: refused before the job's directory is made, on every rank
    # at once (model_devices is a machine's own setting: one rank alone may lack them).
    _collective(node, lambda: worker_devices(cfg, import_torch()) if cfg.model_devices == "cuda" else None)
    if cfg.ps.schedule == "herald" and node is not None and \
            (cfg.distributed.sparse_rows, cfg.distributed.sparse_grads) != ("none", "none"):
        raise ValueError("[distributed] sparse_rows and sparse_grads compress the sequential job's embeddings and "
                         "gradients; schedule = 'herald' moves whole rows (with optimizer state) as float32: set "
                         "them to 'none', or schedule = 'sequential'")
    if cfg.ps.schedule == "herald" and node is not None and cfg.online:
        raise ValueError("[ps] schedule = 'herald' under mpiexec moves examples between ranks; online training "
                         "scores each rank's own examples (set online = false, or schedule = 'sequential')")
    if cfg.ps.schedule == "herald" and (cfg.ps.ttl_steps or cfg.ps.max_rows):
        # Under mpiexec each rank's server runs 'sequential' behind Herald's caches,
        # which it would not check: the caches keep rows the checkpoint's erase
        # cannot reach, so an erased key would come back from them.
        raise ValueError(f"[ps] ttl_steps = {cfg.ps.ttl_steps} and max_rows = {cfg.ps.max_rows}: bounded tables "
                         f"need schedule = 'sequential' (Herald's worker caches hold rows between batches)")
    rank, world = (node.rank, node.size) if node is not None else (0, 1)
    def check_outside_data() -> None:
        if train_batches is None:
            _check_job_outside_data(cfg)
        if report is not None:
            check_output_outside_data(cfg, report, "--report", "the report's plots", "write them elsewhere")
    # Every rank, together: one machine alone may hold the directories so (a relative
    # --report leads into the data from one rank's working directory only).
    _collective(node, check_outside_data)
    # The inputs first: a bad data path fails here, before anything is written.
    source = train_batches if train_batches is not None else \
        _collective(node, lambda: _train_source(cfg, rank, world))
    if node is not None and train_batches is None:
        _check_same_files(cfg, node, source)
    eval_batches = list(eval_batches) if eval_batches is not None else _collective(node, lambda: _eval_batches(cfg))
    if cfg.admission.threshold > 1:
        # Checked again with what this run does. Reading the config could count the
        # ranks on this machine only by the launcher's variables, which some
        # launchers (srun's PMI plugins) do not set; and evaluations keep sketches only
        # where there are held-out batches to score, which `eval_batches` and the
        # command line's flags (eval_every, --sequential) may have changed since.
        _collective(node, lambda: cfg.admission.check_memory(
            "[admission]", None if node is None else (node.machine_ranks, "MPI's shared-memory communicator"),
            eval_every=cfg.eval_every if eval_batches else 0, pipelined=cfg.pipelined, lookahead=cfg.ps.lookahead))
    widths, (has_data, shaped_by) = _collective(node, lambda: (_widths(cfg, source), _widths_origin(source)))
    if train_batches is None:
        _check_data_has_examples(cfg, node, rank, world)
    if node is not None:
        # The ranks' fields are compared before the checks of them below, which every
        # rank makes together (_collective): a check that refused one rank's fields
        # on its own (rank 1's multi-hot fields under schedule = 'herald') left the
        # other ranks waiting in this exchange until the watchdog's timeout.
        every = node.allgather("train", (tuple(widths) if has_data else None, shaped_by), "the data's fields")
        if len({w for w, _ in every}) > 1:
            raise ValueError(_different_fields(every))
        _check_same_field_names(node, source)
        if isinstance(source, hdata.GrowingDirectory):
            source.agree(node)  # one file every rank's files are held to

    def check_fields() -> None:
        if cfg.data.schema is not None and eval_batches:  # (each rank's own held-out files)
            b = eval_batches[0]
            got = (b.dense.shape[1], b.keys.shape[1], len(getattr(b, "bags", ())))
            if got != tuple(widths):
                raise ValueError(f"{cfg.data.eval_source}: the schema gives {got[0]} dense, {got[1]} categorical "
                                 f"and {got[2]} multi-hot fields here, the training data {widths[0]}, {widths[1]} "
                                 f"and {widths[2]}")
            _check_eval_fields(source, eval_batches)
        if cfg.ps.schedule == "herald" and widths[2]:
            raise ValueError(f"[ps] schedule = 'herald' partitions examples of single-hot fields; this data has "
                             f"{widths[2]} multi-hot field(s) (schedule = 'sequential' trains them)")
    _collective(node, check_fields)
    window_room = None
    if cfg.ps.lookahead:  # refused before the job's directory is made, not at the first batch's window
        window = window_batch_keys(cfg, widths, world, train_batches)
        if node is not None and train_batches is not None:  # each rank's own batches: the job's largest
            every = node.allgather("train", window, "the lookahead window's batch keys")
            window = (max(k for k, _ in every), all(b for _, b in every))
        window_room = _collective(node, lambda: check_lookahead_room(cfg, window))
    number = LAST
    if node is not None:
        number = _prepare_job(cfg, node, resume, tuple(widths))
    trainer = _collective(node, lambda: Trainer(cfg, resume=resume, node=node, checkpoint=number, widths=widths,
                                                defer_dense=dense_hook is not None, window_room=window_room))
    try:
        if dense_hook is not None:  # (in the try: a hook that fails closes the server too)
            if len(trainer.replicas) > 1 or trainer.model.device.type != "cpu":
                raise ValueError("[hierarchical] splits one dense model on the CPU a trainer: set model_devices = "
                                 "\"cpu\" and dense_replica_per_worker = false")
            dense_hook(trainer)
            _collective(node, trainer.load_dense_state)  # (into the hook's MLP, optimizer and dense sync)
        if node is not None:
            _check_resumed_step(trainer)
            trainer.admission.agree(node)  # one sketch for the job (checkpoints before job-wide counting had one a rank)
            if trainer.batches_done == 0:
                trainer.dense_sync.broadcast_parameters()
            try:
                return _train(cfg, trainer, progress and node.rank == 0, on_eval, source, eval_batches)
            except Exception as e:  # noqa: BLE001 - the peers would wait for this rank forever
                _abort_rank(node, e)
        return _train(cfg, trainer, progress, on_eval, source, eval_batches)
    except BaseException:
        # A run that fails (Ctrl-C too) lets go of its server and path now. Its error's
        # traceback holds the trainer (an interactive session keeps it), and with it
        # the open server's lock on the path: a resume in this process was refused as
        # "another parameter server has this path open", naming this process, until
        # the garbage collector ran. Closing writes nothing: what the last checkpoint
        # did not keep is dropped, as a crash drops it, and the pipeline's threads were
        # joined before its error came here. A close that fails too (a compaction's
        # error) leaves the server to the collector, as before: the run's own error is
        # the one to report.
        try:
            trainer.ps.close()
        except Exception:  # noqa: BLE001
            pass
        raise


def _name_depth(paths: list) -> int:
    """How many path components name the local files of a list apart: their depth
    under the directory they have in common (1 for a single file)."""
    local = [p for p in paths if "://" not in p]
    if len(local) < 2:
        return 1
    root = os.path.commonpath(local)
    return max(len(os.path.relpath(p, root).split(os.sep)) for p in local)


def _file_names(paths: list, depth: int) -> list:
    """Data files' names where they lie: local files by their last `depth` path
    components (a partitioned set repeats base names: day=1/part-0, day=2/part-0),
    URLs whole (they name no local directory)."""
    return [p if "://" in p else "/".join(p.split(os.sep)[-depth:]) for p in paths]


def _check_resumed_files(cfg: TrainConfig, trainer: Trainer) -> None:
    """Raises ValueError unless this rank's data files are those the run it resumes read,
    in its order (more after them only in one unshuffled pass): it skips the examples done,
    which is right only if they come in the order they came before. A file added where the
    listing sorts it before one read (day2 between day1 and day3) moved the examples, and
    the run skipped some it had not trained and trained others twice. A checkpoint of
    another number of ranks, or of before this check, has no list to hold them to."""
    before = trainer.resumed_data_files
    rank, world = (trainer.node.rank, trainer.node.size) if trainer.node is not None else (0, 1)
    if not trainer.examples_done or before is None or (before["rank"], before["world"]) != (rank, world):
        return
    was, now = before["files"], trainer.data_files
    # By name under the files' common directory: a data set moved or copied elsewhere
    # (another disk, another machine) resumes as it was; its files' order is what the
    # examples done depend on.
    depth = max(_name_depth(was), _name_depth(now))  # (a partition added deepens the list's root)
    names_was, names_now = _file_names(was, depth), _file_names(now, depth)
    d = cfg.data
    appended = d.epochs == 1 and not d.shuffle_buffer  # (more files after: the examples done come first)
    if names_now == names_was or (appended and names_now[:len(was)] == names_was):
        return
    i = next((i for i, (a, b) in enumerate(zip(names_now, names_was)) if a != b), min(len(now), len(was)))
    where = f"file {i + 1} is {now[i] if i < len(now) else 'none'} here, {was[i] if i < len(was) else 'none'} there"
    raise ValueError(f"--resume: the data files are not those the run resumed from read, in its order: {where} "
                     f"({len(now)} file(s) here, {len(was)} there{f' on rank {rank}' if world > 1 else ''}); the "
                     f"resumed run skips the {trainer.examples_done:,} examples done, which is right only if the "
                     f"data comes in the same order" + ("" if appended else " (new files too change the order "
                                                        "with data.epochs > 1 or a shuffle_buffer)")
                     + ": give it the files it read, or start a new run")


def _abort_rank(node: Node, e: BaseException) -> None:
    """e ended this rank's part of the job: its traceback and the abort of every
    rank (naming this one and e), since the peers would wait for it forever.
    A KeyboardInterrupt or SystemExit is left to end the process as it would.
    The traceback goes with abort_job's line (once a reason): the same error
    may come here twice, from two stages (a Herald job's NaN gradients: the
    train stage, then the writer), and its traceback was printed each time."""
    if not isinstance(e, Exception):
        return
    import traceback
    node.abort(f"{type(e).__name__}: {e}", code=1, detail="".join(traceback.format_exception(e)))


def _train(cfg: TrainConfig, trainer: Trainer, progress: bool, on_eval, source, eval_batches: list) -> dict:
    node = trainer.node
    if cfg.eval_every and eval_batches:
        # The read stage counts admission ahead of the batch trained: each evaluation
        # in the run takes the counters it kept at that batch.
        trainer.admission.keep_for_evaluations(cfg.eval_every, trainer.batches_done)

    if isinstance(source, hdata.GrowingDirectory):
        trainer.online_source = source
        if trainer.online_files:  # the files the run resumed from read, first and in its order
            source.replay(trainer.online_files)
    elif isinstance(getattr(source, "files", None), list):
        # (local files by their real paths, which the refusal names; compared by name)
        trainer.data_files = [f if "://" in f else os.path.realpath(f) for f in source.files]
        _check_resumed_files(cfg, trainer)
    if node is None:
        # Skipped by examples, not batches: the run resumed from may have ended on a
        # short batch (its --examples smaller than this run's).
        steps = hdata.skip_examples(source, trainer.examples_done)
    else:  # the ranks' batches are aligned, a global batch one per rank
        if trainer.rank_examples_done is not None:
            # By this rank's examples, not the job's steps: the steps count those a
            # rank whose data had ended took part in empty, and a rank may have ended
            # on a short batch (a cap of examples, online_examples): skipping as many
            # of its batches as the job took steps lost the examples past them.
            steps = hdata.skip_examples(source, trainer.rank_examples_done)
        else:  # a checkpoint that did not keep them (of before, or of another number of ranks)
            steps = itertools.islice(source, trainer.batches_done, None)
        n_dense, n_fields, n_bags = trainer.widths
        empty = hdata.Batch(np.empty(0, np.float32), np.empty((0, n_dense), np.float32),
                            np.empty((0, n_fields), np.uint64), (),
                            tuple(hdata.Bags(np.empty(0, np.uint64), np.zeros(1, np.int64)) for _ in range(n_bags)))
        steps = trainer.ps.aligned(steps, empty)
        if trainer.admission.enabled:  # the job's count: every rank counts the global step's keys
            adm = trainer.admission
            steps = (type(s)(adm.train_job_batch(s.examples, node), s.total_examples) for s in steps)
    if node is None and trainer.admission.enabled:
        # [admission]: the read stage counts each batch's keys and rewrites those not
        # admitted, before the prefetch pins the batch's rows.
        steps = map(trainer.admission.train_batch, steps)
    if trainer.batches_done:
        first = next(steps, None)  # every rank together: aligned() is collective
        if first is None:
            return _finished_before(cfg, trainer)
        steps = itertools.chain([first], steps)

    bar = None
    if progress:
        try:
            from tqdm import tqdm
            total = None
            if cfg.data.source == "synthetic" or cfg.data.train_examples is not None:
                total = (cfg.data.train_examples or SYNTHETIC_EXAMPLES) * cfg.data.epochs
            bar = tqdm(total=total, initial=trainer.examples_done, unit="ex", unit_scale=True,
                       file=sys.stderr, mininterval=1.0, desc="train")
        except ImportError:
            bar = None

    malloc = keep_freed_memory() if cfg.keep_freed_memory else {"kept": False, "reason": "keep_freed_memory = false"}
    # Where this process's clock and counters start (a resumed run's history holds the
    # points of the runs before it, on their own): hps.report's intervals start here.
    started_at = {"examples": trainer.examples_done, "batches": trainer.batches_done}
    t_start = time.perf_counter()
    online = None
    if cfg.online:  # progressive validation: the step keeps its logits, scored here before the next step
        from hps.progressive import ProgressiveWindow
        online = ProgressiveWindow(cfg.online_window, cfg.online_window_batches or None)
        if trainer.online_state is not None:  # resumed: the window and curve go on
            online.load_state_dict(trainer.online_state)
        trainer.online_window = online
        trainer.step_logits = []

    def record_eval(final: bool = False) -> None:
        metrics = trainer.evaluate(eval_batches)
        s = trainer.ps.stats()
        entry = {"batches": trainer.batches_done, "examples": trainer.examples_done,
                 "seconds": time.perf_counter() - t_start, "unix_time": time.time(),
                 **_tier_counters(s), "final": final, **metrics}
        if pipeline.stats.wall_seconds or pipeline.stats.batches:
            entry["stages"] = dict(pipeline.stats.busy_seconds)
        if "distributed" in s:
            entry["bytes_sent"] = s["distributed"]["bytes_sent"]
        trainer.history.append(entry)
        if on_eval:
            on_eval(entry)
        if bar is not None and "auc" in metrics:
            bar.write(f"batch {trainer.batches_done}: eval AUC {metrics['auc']:.4f}, "
                      f"logloss {metrics['logloss']:.4f}, MEM hit rate {format_rate(entry['mem_hit_rate'])}")

    def step(loaded: Loaded) -> None:
        trainer.step(loaded)
        trainer.batches_done += 1
        n = getattr(loaded.data, "total_examples", len(loaded.data.labels))
        trainer.examples_done += n
        if trainer.rank_examples_done is not None:  # (read: this rank's own, where data came from others)
            trainer.rank_examples_done += len((loaded.data if loaded.read is None else loaded.read).labels)
        if online is not None:
            _score_online(trainer, online, loaded.data, time.perf_counter() - t_start)
        if trainer.thread_tuner is not None:
            trainer.thread_tuner.step(n)
        if bar is not None:
            s = trainer.ps.stats()
            mem = s["mem"]
            post = {"hit": format_rate(mem_hit_rate(mem)),
                    "ssd_MB": f"{(s['ssd']['bytes_read'] + s['ssd']['bytes_written']) / 1e6:.0f}"}
            if online is not None and online.history:
                post["auc_win"] = f"{online.history[-1]['auc']:.4f}"
            bar.set_postfix(post, refresh=False)
            bar.update(n)

    binding = None
    if cfg.bind_cores:
        from hps import topology as htopo
        binding = htopo.discover(cfg.sysfs, host_partitions_if_no_gpu=cfg.ps.devices).binding_plan()
    keys_of = {"keys_of": lambda d: d.all_keys()} if trainer.widths[2] else {}
    # In a job, a stage that raises ends the job at once: its other stages' threads,
    # which the pipeline joins before it raises, may wait in collectives for peers
    # that wait for the failed stage (a train step that raised, say: its peers wait
    # in the step's exchanges, its loader in the next batch's), until the watchdog's
    # timeout, whose message would not say what failed.
    on_error = None if node is None else (lambda e: _abort_rank(node, e))
    pipeline = Pipeline(trainer.ps, step, helper_nice=cfg.helper_nice, binding=binding, on_error=on_error, **keys_of)

    def untimed():
        """Evaluations and checkpoints: not in the ThreadTuner's probes."""
        return trainer.thread_tuner.untimed() if trainer.thread_tuner is not None else contextlib.nullcontext()

    def after_batch_hooks(inner):
        def wrapped(loaded):
            inner(loaded)
            if cfg.eval_every and trainer.batches_done % cfg.eval_every == 0:
                with untimed(), pipeline.set_aside():  # (not the train stage's busy time: see set_aside)
                    pipeline.wait_for_write_backs()  # MEM-PS as a sequential run has it here
                    record_eval()
            if cfg.checkpoint_every and trainer.batches_done % cfg.checkpoint_every == 0:
                # The batch in flight is written back after this step returns; the
                # checkpoint waits for it (ParameterServer.checkpoint takes the batch lock).
                pending_checkpoint.append(trainer.batches_done)
        return wrapped

    pending_checkpoint: list[int] = []
    pipeline.train_step = after_batch_hooks(step)
    # Checkpoints between batches: run the pipeline in segments.
    while True:
        segment = _take_until_checkpoint(steps, cfg.checkpoint_every, trainer.batches_done)
        seg_stats_before = pipeline.stats.batches
        pipeline.run(segment, pipelined=cfg.pipelined)
        if pending_checkpoint:
            with untimed():
                trainer.checkpoint()
            pending_checkpoint.clear()
        if pipeline.stats.batches == seg_stats_before:
            break
    if bar is not None:
        bar.close()
    if trainer.dense_sync is not None:
        trainer.dense_sync.after_step(final=True)  # k-step Adam: one model to evaluate and keep
    record_eval(final=True)
    trainer.checkpoint()
    # The final checkpoint writes the dirty rows: the final entry's counters are
    # read after it, so they agree with summary["ps"] (and the printed table).
    trainer.history[-1].update(_tier_counters(trainer.ps.stats()))
    wall = pipeline.stats.wall_seconds
    # The periodic evaluations run inside the train step, so inside the pipeline's
    # wall time (the final one and the checkpoints run outside it).
    eval_seconds = pipeline.stats.set_aside_seconds
    summary = {"examples": trainer.examples_done, "batches": trainer.batches_done,
               "train_seconds": wall, "ps_open_seconds": trainer.ps_open_seconds,
               "examples_per_s": pipeline.stats.examples / wall if wall else 0.0,
               "eval_seconds": eval_seconds,
               "examples_per_s_without_eval": _rate(pipeline.stats.examples, wall - eval_seconds),
               "pipeline": pipeline.stats.as_dict(), "final": trainer.history[-1], "history": trainer.history,
               "started_at": started_at,
               "torch_threads": (trainer.thread_tuner.as_dict() if trainer.thread_tuner is not None
                                 else {"chosen": cfg.torch_threads}),
               "ps": _jsonable(trainer.ps.stats()), "settings": settings(cfg), "malloc": malloc,
               "dense_model": {"devices": [str(d) for d in trainer.replicas.devices],
                               "replicas": len(trainer.replicas)},
               "core_binding": ({"noop": binding.noop, "reason": binding.reason,
                                 "threads": pipeline.stats.binding} if binding is not None else None),
               "admission": trainer.admission.summary()}
    if online is not None:
        last = {"batches": trainer.batches_done, "examples": trainer.examples_done,
                "seconds": time.perf_counter() - t_start,
                **online.metrics()}
        history = online.history
        if not history or history[-1]["batches"] != trainer.batches_done:
            history = history + [last]  # the curve ends at the last batch
        summary["online"] = {"window": ({"batches": cfg.online_window_batches} if cfg.online_window_batches
                                        else {"examples": cfg.online_window}),
                             **{k: v for k, v in last.items() if k not in ("batches", "examples", "seconds")},
                             "history": history}
        files = getattr(source, "files_read", None)
        if files is not None:
            summary["online"]["files_read"] = len(files)
    skipped = _malformed_report(cfg, source, eval_batches)
    if node is not None:
        ranks = node.allgather("train", {"examples": pipeline.stats.examples, "wall_seconds": wall,
                                         "eval_seconds": eval_seconds,
                                         "bytes_sent": dict(node.bytes_sent),
                                         # rows sent as a bit, never trained (hps.distributed.FreshRows)
                                         "fresh_rows_sent_as_bits": getattr(trainer.ps, "fresh_rows_sent", int)(),
                                         "admission": trainer.admission.rank_summary(),
                                         "skipped": (skipped or {}).get("train")}, "summary")
        summary["admission"]["ranks"] = [r.pop("admission") for r in ranks]  # the rest is the job's
        skipped_ranks = [r.pop("skipped") for r in ranks]
        if skipped is not None and "train" in skipped:
            # Each rank reads its own files: the job skipped the sum (the held-out
            # data is every rank's, so its count is already the job's).
            skipped["train"] = {"malformed": sum(r["malformed"] for r in skipped_ranks),
                                "malformed_examples": [m for r in skipped_ranks for m in r["malformed_examples"]]
                                [:hdata.MAX_MALFORMED_EXAMPLES],
                                "ranks": [r["malformed"] for r in skipped_ranks]}
        slowest = max(r["wall_seconds"] for r in ranks)
        trained = sum(r["examples"] for r in ranks)
        summary["examples_per_s"] = trained / slowest if slowest else 0.0
        summary["examples_per_s_without_eval"] = _rate(trained, max(r["wall_seconds"] - r["eval_seconds"]
                                                                    for r in ranks))
        summary["distributed"] = {"rank": node.rank, "world": node.size, "nodes": node.nodes,
                                  "dense_sync": cfg.distributed.dense_sync, "k": cfg.distributed.k,
                                  "hierarchical": cfg.distributed.hierarchical,
                                  "dense_merges": trainer.dense_sync.merges, "ranks": ranks}
    if skipped is not None:
        summary["skipped_lines"] = skipped
    asked = cfg.data.train_examples
    if asked is not None and cfg.data.source != "synthetic" and not cfg.online \
            and trainer.examples_done < asked * cfg.data.epochs:
        summary["short"] = (f"the data held {trainer.examples_done:,} examples, fewer than the "
                            f"{asked * cfg.data.epochs:,} asked" + (f" ({asked:,} a pass, {cfg.data.epochs} epochs)" if cfg.data.epochs > 1 else ""))
    # Written aside, then renamed over: in place, a full disk or a crash in the middle
    # left the summary before emptied and a few bytes of this one, which a resume of the
    # finished run (_finished_before) could not read.
    _write_json_atomic(os.path.join(trainer.state_dir, SUMMARY), _jsonable(summary))
    trainer.ps.close()
    if node is not None:
        node.close()
    return summary


def settings(cfg: TrainConfig) -> dict:
    """The run's settings a reader of its numbers and plots needs (the plots' caption)."""
    d, ps = cfg.data, cfg.ps
    src = _source_name(d.source)
    return {"data": src if len(src) <= 60 else "..." + src[-57:], "batch_size": d.batch_size,
            "examples": d.train_examples if d.train_examples is not None else
            (SYNTHETIC_EXAMPLES if d.source == "synthetic" else "all"), "epochs": d.epochs,
            "dim": ps.dim, "mem_budget": ps.mem_budget, "cache_policy": ps.cache_policy, "devices": ps.devices,
            "schedule": ps.schedule,
            "sparse_optimizer": ps.optimizer.kind, "hidden": list(cfg.hidden),
            "pipelined": cfg.pipelined, "online": cfg.online}


def mem_hit_rate(mem: dict) -> Optional[float]:
    """MEM-PS hits over lookups (ParameterServer.stats()["mem"]); None without any
    lookup: nothing was measured, which a rate of 0 would pass off as every lookup missing."""
    lookups = mem["hits"] + mem["misses"]
    return mem["hits"] / lookups if lookups else None


def format_rate(rate: Optional[float]) -> str:
    """A hit rate for a table or progress line: "-" where nothing was measured."""
    return "-" if rate is None else f"{rate:.3f}"


def _rate(examples: int, seconds: float) -> float:
    return examples / seconds if seconds > 0 else 0.0


def _tier_counters(s: dict) -> dict:
    """What an eval point records of the tiers (ParameterServer.stats())."""
    mem, ssd = s["mem"], s["ssd"]
    return {"mem_hit_rate": mem_hit_rate(mem),
            "mem_hits": mem["hits"], "mem_misses": mem["misses"],
            "ssd_bytes_read": ssd["bytes_read"], "ssd_bytes_written": ssd["bytes_written"],
            "ssd_live_records": ssd["live_records"], "ssd_disk_bytes": ssd["disk_bytes"]}


def _finished_before(cfg: TrainConfig, trainer: Trainer) -> dict:
    """A resumed run whose data has nothing left: the job is left as it is, and the
    summary is the one of the run that finished it (if it wrote one), marked
    ``finished_before``."""
    path = os.path.join(trainer.state_dir, SUMMARY)
    summary = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                summary = json.load(f)
        except ValueError:  # cut short (an older hps wrote it in place: see _train's end): as gone
            summary = {}
        if (summary.get("examples"), summary.get("batches")) != (trainer.examples_done, trainer.batches_done):
            # An older run's: the run that made the last checkpoint failed before it
            # wrote its own (a crash, a full disk), and its summary was shown as this one's.
            summary = None
    trainer.ps.close()
    if trainer.node is not None:
        trainer.node.close()
    if summary is None:  # finished, but its summary is gone (a crash after the last checkpoint)
        summary = {"examples": trainer.examples_done, "batches": trainer.batches_done}
    summary["finished_before"] = {"examples": trainer.examples_done, "batches": trainer.batches_done,
                                  "path": cfg.ps.path}
    if trainer.node is not None:  # this job's ranks now (a reshard may have changed them): rank 0 speaks
        summary["distributed"] = {**summary.get("distributed", {}), "rank": trainer.node.rank,
                                  "world": trainer.node.size}
    return summary


def _score_online(trainer: Trainer, window, examples, seconds: float) -> None:
    """Adds the batch's scores from the step just run (its forward pass came before
    its update) to the progressive window, which records a point of its curve."""
    # Each call's logits go to its examples: one call over every device's share
    # (Trainer._calls) may hold all of them, but in the shares' order, which
    # Herald's schedule does not keep in the batch's.
    logits = np.empty(len(examples.labels), np.float32)
    for idx, part in trainer.step_logits:
        logits[idx] = part
    trainer.step_logits.clear()
    window.add(examples.labels, 1.0 / (1.0 + np.exp(-logits.astype(np.float64))))
    window.record(batches=trainer.batches_done, examples=trainer.examples_done, seconds=seconds)


def _take_until_checkpoint(it, every: int, done: int):
    """The batches of `it` up to the next multiple of `every` (all when every = 0)."""
    if not every:
        yield from it
        return
    for _ in range(every - done % every):
        try:
            yield next(it)
        except StopIteration:
            return


def _jsonable(x: Any):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(x) else float(x)  # (a numpy NaN, eval's logloss, passed as NaN: not JSON)
    return x
