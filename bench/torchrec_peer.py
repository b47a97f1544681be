#!/usr/bin/env python3
"""The TorchRec CPU peer of W4 / W4s (BENCHMARKS.md), next to bench/train_bench.py's
plain PyTorch peer.

    python3 bench/torchrec_peer.py                     # self-check: W4 and W4s, 300k examples
    python3 bench/torchrec_peer.py --examples 2000000 --eval-examples 200000

`torchrec(train_batches, eval_batches, hidden, threads, seed, lr_emb, lr_dense, dim)` has
the signature of train_bench.plain_torch and returns the same keys (examples, seconds,
examples_per_s, auc, logloss, embedding_rows) plus "torchrec_version" and "plan".

Model (the same as plain_torch's): 26 categorical fields, one key per field per example,
an embedding of `dim` per field summed (single-hot, so the sum is the row), concatenated
with the 13 dense features, the MLP `hidden`-1 initialised exactly as plain_torch does
from `seed`, one logit, BCEWithLogitsLoss (mean).
  * Embeddings: one EmbeddingBagConfig per field (TorchRec wants one config per table),
    each table over the keys seen for that field in train + eval, keys mapped to rows by
    np.searchsorted before timing, like plain_torch. plain_torch uses one shared table
    over all keys instead; the two hold exactly the same rows, because hps.data's keys
    encode the field (key = splitmix64(((field + 1) << 32) ^ value), a bijection), so no
    key appears in two fields and the 26 per-field vocabularies partition the shared one.
    Weights uniform(-0.01, 0.01) as in plain_torch.
  * The EmbeddingBagCollection is wrapped in DistributedModelParallel over a gloo process
    group of world size 1, with every table forced to `table_wise` sharding and the `fused`
    compute kernel (FBGEMM's table-batched embedding bag with the optimizer fused into the
    backward): left to itself the planner puts small tables on data_parallel. The fused
    optimizer is exact (not row-wise) Adagrad, lr = lr_emb, eps = 1e-10 (torch.optim.Adagrad's
    default; FBGEMM's own default is 1e-8).
  * The MLP lives outside DistributedModelParallel and is trained by torch.optim.Adam (hps.tuning.dense_adam)
    (lr_dense), as in plain_torch; so DMP has no dense parameters and adds no DDP wrapper
    (a world-size-1 all-reduce would only cost time).
Only the training loop is timed; AUC and logloss come from hps.metrics on eval_batches.

Installing TorchRec on the CPU (the recipe of BENCHMARKS.md; ensure_installed() runs it
when `import torchrec` fails):

    pip install torch==2.13.0                      # already there on these machines (+cpu)
    pip install torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 --no-deps
    pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions
    python -c "import torch; print(torch.__version__)"   # must still be 2.13.0+cpu

--no-deps because torchrec declares the CUDA `fbgemm-gpu`, which would pull a CUDA
torch; `fbgemm-gpu-cpu` provides the same `fbgemm_gpu` module for the CPU. pip then warns
"torchrec 1.8.0 requires fbgemm-gpu, which is not installed": expected, harmless.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

TORCH_VERSION = "2.13.0"
TORCHREC_PINS = ["torchrec==1.8.0", "fbgemm-gpu-cpu==1.8.0"]
TORCHREC_RUNTIME_DEPS = ["tensordict", "torchmetrics==1.0.3", "tqdm", "pyre-extensions"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def ensure_installed():
    """Install TorchRec for the CPU (module docstring) unless `import torchrec` works.

    Returns torchrec's version. Raises RuntimeError if the install replaced torch.
    """
    try:
        import torchrec
        return torchrec.__version__
    except ImportError:
        pass
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    try:
        import torch
    except ImportError:
        subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
        import torch
    before = torch.__version__
    subprocess.run(pip + TORCHREC_PINS + ["--no-deps"], check=True)
    # Naming the installed torch on the same line keeps the resolver from "upgrading" it
    # to a CUDA build while it satisfies tensordict / torchmetrics.
    subprocess.run(pip + TORCHREC_RUNTIME_DEPS + [f"torch=={before}"], check=True)
    after = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           check=True, capture_output=True, text=True).stdout.strip()
    if after != before:
        raise RuntimeError(f"installing TorchRec replaced torch {before} by {after}")
    import importlib
    importlib.invalidate_caches()
    import torchrec
    return torchrec.__version__


class _ProcessGroup:
    """A gloo process group of world size 1 for DistributedModelParallel, torn down on exit
    (only if this created it, so that a caller's own group is left alone)."""

    def __enter__(self):
        import torch.distributed as dist
        self.owned = not dist.is_initialized()
        if self.owned:
            # A file:// store: no port to pick, nothing listening on the network.
            fd, self.store = tempfile.mkstemp(prefix="torchrec-peer-pg-")
            os.close(fd)
            os.unlink(self.store)  # the store file must not exist yet
            # The file:// store does not read these; set for any code that expects the
            # usual env:// rendezvous variables, pointing at loopback only.
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29512")
            dist.init_process_group("gloo", init_method="file://" + self.store, rank=0, world_size=1)
        return dist.group.WORLD

    def __exit__(self, *exc):
        import torch.distributed as dist
        if self.owned:
            dist.destroy_process_group()
            if os.path.exists(self.store):
                os.unlink(self.store)


def _describe_plan(plan, dmp, rows):
    """What the planner chose and what DMP built, from the plan itself, not from our request."""
    sharding = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            sharding[table] = (ps.sharding_type, ps.compute_kernel, list(ps.ranks or []))
    count = lambda i: {v: sum(1 for s in sharding.values() if s[i] == v)  # noqa: E731
                       for v in sorted({s[i] for s in sharding.values()})}
    out = {"tables": len(sharding), "rows": rows, "sharding_types": count(0),
           "compute_kernels": count(1), "ranks": sorted({r for s in sharding.values() for r in s[2]})}
    # The kernel modules DMP instantiated (private attributes, so best effort): the TBE
    # class and the optimizer it runs in the backward.
    try:
        # ShardedEmbeddingBagCollection hides its lookups from named_modules(): walk them.
        kernels = [m for lookup in dmp.module.ebc._lookups for _, m in lookup.named_modules()
                   if hasattr(m, "_emb_module")]
        out["kernel_modules"] = sorted({f"{type(m).__name__}/{type(m._emb_module).__name__}" for m in kernels})
        tbe = kernels[0]._emb_module
        out["fused_optimizer"] = {"type": str(tbe.optimizer.value),
                                  "lr": float(tbe.get_learning_rate()) if hasattr(tbe, "get_learning_rate")
                                  else None, "eps": tbe.optimizer_args.eps}
    except Exception as e:  # only the description suffers
        out["kernel_modules"] = f"not inspectable: {e!r}"
    return out


def torchrec(train_batches, eval_batches, hidden, threads, seed, lr_emb, lr_dense, dim):
    import torch
    from torch import nn
    import torchrec as trec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from hps.metrics import auc, logloss
    from hps.tuning import dense_adam
    torch.set_num_threads(threads)
    single = train_batches[0].keys.shape[1]  # 26
    n_bags = len(train_batches[0].bags)      # W4m: multi-hot fields, a table each
    fields = single + n_bags

    # One vocabulary per field (see the module docstring for why this equals plain_torch's
    # shared table row for row), keys mapped to per-table rows before timing.
    all_keys = np.concatenate([b.keys for b in train_batches + eval_batches])
    vocabs = [np.unique(all_keys[:, f]) for f in range(single)]
    vocabs += [np.unique(np.concatenate([b.bags[j].keys for b in train_batches + eval_batches]))
               for j in range(n_bags)]
    del all_keys
    names = [f"C{f + 1}" for f in range(single)] + [f"M{j + 1}" for j in range(n_bags)]

    def kjt_input(b):
        # KeyedJaggedTensor values are key-major: every example's C1 row, then C2, ...,
        # then each multi-hot field's bags in example order, with a length per
        # (feature, example).
        rows = [np.stack([np.searchsorted(vocabs[f], b.keys[:, f]) for f in range(single)]).ravel()]
        rows += [np.searchsorted(vocabs[single + j], b.bags[j].keys) for j in range(n_bags)]
        lengths = [np.ones(single * len(b.labels), np.int32)]
        lengths += [np.diff(b.bags[j].offsets).astype(np.int32) for j in range(n_bags)]
        return (torch.from_numpy(np.concatenate(rows).astype(np.int64)),
                torch.from_numpy(np.concatenate(lengths)))

    train_vals = [kjt_input(b) for b in train_batches]
    eval_vals = [kjt_input(b) for b in eval_batches]

    def kjt(values, n):
        values, lengths = values
        return KeyedJaggedTensor(keys=names, values=values, lengths=lengths)

    tables = [EmbeddingBagConfig(name=f"t_{name}", feature_names=[name], num_embeddings=len(v),
                                 embedding_dim=dim, pooling=PoolingType.SUM,
                                 weight_init_min=-0.01, weight_init_max=0.01)
              for name, v in zip(names, vocabs)]

    class Sparse(nn.Module):
        # DMP shards child modules; holding the EBC as a child gives it the plan key "ebc".
        def __init__(self):
            super().__init__()
            # meta: no memory until DMP materialises the sharded tables.
            self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

        def forward(self, features):
            return self.ebc(features)

    # The MLP of plain_torch / hps.torch.CtrModel: same layers, same initialisation from `seed`.
    from hps.torch import mlp as ctr_mlp
    mlp = ctr_mlp(fields * dim + 13, hidden, seed)

    with _ProcessGroup() as pg, warnings.catch_warnings():
        # The planner warns that Topology should come from TopologyFactory and about its
        # storage-reservation heuristics: neither matters for one CPU rank with tables this small.
        warnings.simplefilter("ignore", FutureWarning)
        logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": lr_emb, "eps": 1e-10})
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=1, compute_device="cpu"),
            constraints={t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                         for t in tables})
        sparse = Sparse()
        plan = planner.collective_plan(sparse, [sharder], pg)
        dmp = DistributedModelParallel(sparse, device=torch.device("cpu"), plan=plan, sharders=[sharder])

        # Weights uniform(-0.01, 0.01). DMP already drew them so (weight_init_min/max), from
        # the global RNG; redraw from a generator seeded by `seed` so that runs repeat.
        # The state dict's local shards are views of the FBGEMM weights.
        emb_gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, w in dmp.state_dict().items():
                if name.endswith(".weight"):
                    for shard in w.local_shards():
                        shard.tensor.uniform_(-0.01, 0.01, generator=emb_gen)
        plan_info = _describe_plan(plan, dmp, int(sum(len(v) for v in vocabs)))

        opt_mlp = dense_adam(mlp.parameters(), lr_dense)  # the dense step of hps.train (hps.tuning)
        loss_fn = nn.BCEWithLogitsLoss()

        def forward(values, dense):
            pooled = dmp(kjt(values, len(dense))).values()  # (n, fields * dim), in key order
            return mlp(torch.cat([pooled, torch.from_numpy(dense)], 1)).squeeze(1)

        t0 = time.perf_counter()
        n = 0
        for b, values in zip(train_batches, train_vals):
            loss = loss_fn(forward(values, b.dense), torch.from_numpy(b.labels))
            opt_mlp.zero_grad()
            loss.backward()  # also applies Adagrad to the embedding rows (fused)
            opt_mlp.step()
            n += len(b.labels)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            p = np.concatenate([torch.sigmoid(forward(v, b.dense)).numpy()
                                for b, v in zip(eval_batches, eval_vals)])
    y = np.concatenate([b.labels for b in eval_batches])
    return {"examples": n, "seconds": seconds, "examples_per_s": n / seconds, "auc": auc(y, p),
            "logloss": logloss(y, p), "embedding_rows": plan_info["rows"],
            "torchrec_version": trec.__version__, "plan": plan_info}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=300_000)
    ap.add_argument("--eval-examples", type=int, default=50_000)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--mlps", default="512,256;16", help="';'-separated MLPs: W4 512,256 and W4s 16")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr-emb", type=float, default=0.05)
    ap.add_argument("--lr-dense", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    version = ensure_installed()
    sys.path.insert(0, HERE)
    from train_bench import plain_torch
    from hps.data import SyntheticCriteo
    train_batches = list(SyntheticCriteo(seed=a.seed, batch_size=a.batch_size, examples=a.examples))
    eval_batches = list(SyntheticCriteo(seed=a.seed, batch_size=a.batch_size, examples=a.eval_examples,
                                        part="eval"))
    args = (a.threads, a.seed, a.lr_emb, a.lr_dense, a.dim)
    rows = []
    for spec in a.mlps.split(";"):
        hidden = [int(h) for h in spec.split(",") if h]
        name = "W4s" if hidden == [16] else "W4"
        log(f"== {name} MLP {hidden}: plain PyTorch ==")
        pt = plain_torch(train_batches, eval_batches, hidden, *args)
        log(f"== {name} MLP {hidden}: TorchRec {version} ==")
        tr = torchrec(train_batches, eval_batches, hidden, *args)
        log(f"plan: {tr['plan']}")
        if pt["embedding_rows"] != tr["embedding_rows"]:
            log(f"WARNING: {pt['embedding_rows']} shared rows vs {tr['embedding_rows']} per-field rows")
        rows.append((name, hidden, pt, tr))

    print(f"\n{a.examples:,} training examples, {a.eval_examples:,} eval, batch {a.batch_size}, "
          f"{a.threads} threads, torchrec {version}")
    print(f"{'':4} {'MLP':>8} | {'torch ex/s':>11} {'AUC':>7} | {'torchrec ex/s':>13} {'AUC':>7} | "
          f"{'trec/torch':>10} {'dAUC':>8}")
    for name, hidden, pt, tr in rows:
        print(f"{name:4} {','.join(map(str, hidden)):>8} | {pt['examples_per_s']:>11,.0f} {pt['auc']:>7.4f} | "
              f"{tr['examples_per_s']:>13,.0f} {tr['auc']:>7.4f} | "
              f"{tr['examples_per_s'] / pt['examples_per_s']:>10.2f} {tr['auc'] - pt['auc']:>+8.4f}")


if __name__ == "__main__":
    main()
