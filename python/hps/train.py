"""`hps train`: a CTR model trained end to end through the pipeline.

A run is a ``TrainConfig`` (TOML: top-level training fields and the tables
``[ps]`` (ParameterServerConfig), ``[ps.optimizer]``, ``[ps.initializer]``,
``[data]``). The model is ``hps.torch.CtrModel``: its embeddings live in the
parameter server (sparse optimizer there), its MLP in torch (Adam). Evaluation
(AUC, logloss) runs on held-out examples every ``eval_every`` batches and at the
end; ``checkpoint_every`` batches the parameter server checkpoints and the dense
state is saved beside it, so ``resume=True`` continues from the last checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hps import data as hdata
from hps.parameter_server import ParameterServer, ParameterServerConfig, check_fields, load_toml
from hps.pipeline import Loaded, Pipeline

TRAINER_STATE = "trainer-state.pt"


@dataclass
class DataConfig:
    source: str = "synthetic"           # "synthetic", or paths / globs / a directory of TSV or Parquet files
    eval_source: Optional[str] = None   # held-out files; synthetic: the generator's "eval" stream
    format: Optional[str] = None        # "tsv" or "parquet"; None: from the file names
    batch_size: int = 4096
    train_examples: Optional[int] = 1_000_000   # synthetic: examples to train on; files: None = all
    eval_examples: int = 100_000
    skip_malformed: bool = False
    seed: int = 0                       # synthetic data's seed
    vocab_sizes: Optional[Sequence[int]] = None  # synthetic; None: hps.data.DEFAULT_VOCAB_SIZES
    zipf_a: float = 1.1


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
    torch_threads: int = 0              # 0: torch's default

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "TrainConfig":
        d = dict(d)
        check_fields(cls, d, source)
        if "ps" not in d:
            raise ValueError(f"{source}: missing table [ps] (dim, path, ...)")
        ps = d["ps"] if isinstance(d["ps"], ParameterServerConfig) else \
            ParameterServerConfig.from_dict(d["ps"], source=f"{source}: [ps]")
        data = d.get("data", {})
        if not isinstance(data, DataConfig):
            check_fields(DataConfig, data, source, prefix="data.")
            data = DataConfig(**data)
        d["ps"], d["data"] = ps, data
        if "hidden" in d:
            d["hidden"] = tuple(int(h) for h in d["hidden"])
        return cls(**d)

    @classmethod
    def from_toml(cls, path) -> "TrainConfig":
        return cls.from_dict(load_toml(path), source=os.fspath(path))


# ---------------------------------------------------------------- metrics

def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ties count half), by ranks."""
    labels = np.asarray(labels) > 0.5
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = np.asarray(scores)[order]
    ranks = np.empty(len(scores), np.float64)
    # Average ranks over ties.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


# ---------------------------------------------------------------- data

def _train_source(cfg: TrainConfig, rank: int = 0, world: int = 1):
    d = cfg.data
    if d.source == "synthetic":
        kw = {"vocab_sizes": d.vocab_sizes} if d.vocab_sizes else {}
        return hdata.SyntheticCriteo(seed=d.seed, batch_size=d.batch_size, examples=d.train_examples,
                                     part="train", rank=rank, world=world, zipf_a=d.zipf_a, **kw)
    return hdata.open_criteo(d.source, d.batch_size, format=d.format, rank=rank, world=world,
                             skip_malformed=d.skip_malformed)


def _eval_batches(cfg: TrainConfig) -> list:
    d = cfg.data
    if d.source == "synthetic":
        kw = {"vocab_sizes": d.vocab_sizes} if d.vocab_sizes else {}
        return list(hdata.SyntheticCriteo(seed=d.seed, batch_size=d.batch_size, examples=d.eval_examples,
                                          part="eval", zipf_a=d.zipf_a, **kw))
    if not d.eval_source:
        return []
    out, n = [], 0
    for b in hdata.open_criteo(d.eval_source, d.batch_size, format=d.format, skip_malformed=d.skip_malformed):
        out.append(b)
        n += len(b)
        if n >= d.eval_examples:
            break
    return out


# ---------------------------------------------------------------- training

class Trainer:
    """The model, its dense optimizer and the parameter server, stepped by the pipeline."""

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        import torch
        from hps.torch import CtrModel
        self.torch = torch
        self.cfg = cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        path = cfg.ps.path
        has_ps = os.path.exists(os.path.join(path, "hps-parameter-server.json"))
        if resume:
            if not has_ps:
                raise FileNotFoundError(f"--resume: {path} holds no parameter server to resume")
            self.ps = ParameterServer(cfg.ps)
        else:
            if has_ps:
                raise ValueError(f"{path} already holds a parameter server; pass --resume to continue it, "
                                 f"or give a new path")
            self.ps = ParameterServer(cfg.ps)
        self.model = CtrModel(self.ps, num_fields=26, num_dense=13, hidden=cfg.hidden, seed=cfg.seed)
        self.opt = torch.optim.Adam(self.model.mlp.parameters(), lr=cfg.dense_lr)
        self.loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
        self.batches_done = 0
        self.examples_done = 0
        self.history: list[dict] = []
        if resume:
            self._load_state()

    # -- state
    def _state_path(self) -> str:
        return os.path.join(self.cfg.ps.path, TRAINER_STATE)

    def _load_state(self) -> None:
        path = self._state_path()
        if not os.path.exists(path):
            raise FileNotFoundError(f"--resume: {path} is missing (no checkpoint of the dense model yet)")
        state = self.torch.load(path, weights_only=False)
        self.model.mlp.load_state_dict(state["mlp"])
        self.opt.load_state_dict(state["opt"])
        self.batches_done, self.examples_done = state["batches_done"], state["examples_done"]
        self.history = state.get("history", [])

    def checkpoint(self) -> None:
        """The parameter server first, then the dense state naming the same step."""
        self.ps.checkpoint()
        tmp = self._state_path() + ".tmp"
        self.torch.save({"mlp": self.model.mlp.state_dict(), "opt": self.opt.state_dict(),
                         "batches_done": self.batches_done, "examples_done": self.examples_done,
                         "history": self.history}, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self._state_path())

    # -- steps
    def step(self, loaded: Loaded) -> None:
        """Forward and backward over each device's mini-batch (gradients go to the
        owners and add up), then one dense step for the whole batch."""
        torch = self.torch
        data = loaded.data
        n = len(data.labels)
        self.opt.zero_grad()
        emb = self.model.embedding
        for worker, idx in enumerate(loaded.minibatches):
            if len(idx) == 0:
                continue
            emb.attach(loaded.batch, worker)
            keys = torch.from_numpy(data.keys[idx].view(np.int64))
            logits = self.model(keys, torch.from_numpy(data.dense[idx]))
            loss = self.loss_fn(logits, torch.from_numpy(data.labels[idx])) / n
            loss.backward()
        emb.attach(None)
        self.opt.step()

    def evaluate(self, batches: list) -> dict:
        torch = self.torch
        if not batches:
            return {}
        labels, probs = [], []
        with torch.no_grad():
            for b in batches:
                logits = self.model(torch.from_numpy(b.keys.view(np.int64)), torch.from_numpy(b.dense))
                probs.append(torch.sigmoid(logits).numpy())
                labels.append(b.labels)
        y, p = np.concatenate(labels), np.concatenate(probs)
        return {"auc": auc(y, p), "logloss": logloss(y, p), "eval_examples": len(y)}


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True,
          on_eval: Optional[Callable[[dict], None]] = None, train_batches=None, eval_batches=None) -> dict:
    """Trains per `cfg`; returns the summary (also written to <path>/train-summary.json).
    `train_batches` / `eval_batches` (iterables of hps.data.Batch) replace the
    sources cfg.data names: a benchmark feeds both sides the same batches from memory."""
    trainer = Trainer(cfg, resume=resume)
    eval_batches = list(eval_batches) if eval_batches is not None else _eval_batches(cfg)
    source = train_batches if train_batches is not None else _train_source(cfg)
    skip = trainer.batches_done

    def batches():
        for i, b in enumerate(source):
            if i < skip:
                continue  # done before the checkpoint we resumed from
            yield b

    bar = None
    if progress:
        try:
            from tqdm import tqdm
            total = None
            if cfg.data.source == "synthetic" and cfg.data.train_examples:
                total = cfg.data.train_examples
            bar = tqdm(total=total, initial=trainer.examples_done, unit="ex", unit_scale=True,
                       file=sys.stderr, mininterval=1.0, desc="train")
        except ImportError:
            bar = None

    t_start = time.perf_counter()

    def record_eval(final: bool = False) -> None:
        metrics = trainer.evaluate(eval_batches)
        s = trainer.ps.stats()
        mem = s["mem"]
        entry = {"batches": trainer.batches_done, "examples": trainer.examples_done,
                 "seconds": time.perf_counter() - t_start,
                 "mem_hit_rate": mem["hits"] / max(1, mem["hits"] + mem["misses"]),
                 "ssd_bytes_read": s["ssd"]["bytes_read"], "ssd_bytes_written": s["ssd"]["bytes_written"],
                 "final": final, **metrics}
        if pipeline.stats.wall_seconds or pipeline.stats.batches:
            entry["stages"] = dict(pipeline.stats.busy_seconds)
        trainer.history.append(entry)
        if on_eval:
            on_eval(entry)
        if bar is not None and "auc" in metrics:
            bar.write(f"batch {trainer.batches_done}: eval AUC {metrics['auc']:.4f}, "
                      f"logloss {metrics['logloss']:.4f}, MEM hit rate {entry['mem_hit_rate']:.3f}")

    def step(loaded: Loaded) -> None:
        trainer.step(loaded)
        trainer.batches_done += 1
        trainer.examples_done += len(loaded.data.labels)
        if bar is not None:
            s = trainer.ps.stats()
            mem = s["mem"]
            bar.set_postfix({"hit": f"{mem['hits'] / max(1, mem['hits'] + mem['misses']):.3f}",
                             "ssd_MB": f"{(s['ssd']['bytes_read'] + s['ssd']['bytes_written']) / 1e6:.0f}"},
                            refresh=False)
            bar.update(len(loaded.data.labels))

    pipeline = Pipeline(trainer.ps, step)

    def after_batch_hooks(inner):
        def wrapped(loaded):
            inner(loaded)
            if cfg.eval_every and trainer.batches_done % cfg.eval_every == 0:
                record_eval()
            if cfg.checkpoint_every and trainer.batches_done % cfg.checkpoint_every == 0:
                # The batch in flight is written back after this step returns; the
                # checkpoint waits for it (ParameterServer.checkpoint takes the batch lock).
                pending_checkpoint.append(trainer.batches_done)
        return wrapped

    pending_checkpoint: list[int] = []
    pipeline.train_step = after_batch_hooks(step)
    # Checkpoints between batches: run the pipeline in segments.
    it = batches()
    while True:
        segment = _take_until_checkpoint(it, cfg.checkpoint_every, trainer.batches_done)
        seg_stats_before = pipeline.stats.batches
        pipeline.run(segment, pipelined=cfg.pipelined)
        if pending_checkpoint:
            trainer.checkpoint()
            pending_checkpoint.clear()
        if pipeline.stats.batches == seg_stats_before:
            break
    if bar is not None:
        bar.close()
    record_eval(final=True)
    trainer.checkpoint()
    summary = {"examples": trainer.examples_done, "batches": trainer.batches_done,
               "train_seconds": pipeline.stats.wall_seconds,
               "examples_per_s": pipeline.stats.examples / pipeline.stats.wall_seconds
               if pipeline.stats.wall_seconds else 0.0,
               "pipeline": pipeline.stats.as_dict(), "final": trainer.history[-1], "history": trainer.history,
               "ps": _jsonable(trainer.ps.stats())}
    with open(os.path.join(cfg.ps.path, "train-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    trainer.ps.close()
    return summary


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
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    return x
