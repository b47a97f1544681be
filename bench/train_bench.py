#!/usr/bin/env python3
"""W4 / W4s / W9 (BENCHMARKS.md): `hps train` against plain PyTorch (and TorchRec) on the
same model and data, in the same run.

    python3 bench/train_bench.py --quick          # W4, under ~3 minutes
    python3 bench/train_bench.py                  # W4: MLP 512-256-1
    python3 bench/train_bench.py --mlp 16         # W4s: the embedding path dominates
    python3 bench/train_bench.py --rounds 3       # each system 3 times, interleaved; medians
    python3 bench/train_bench.py --quick --device-path 2 --no-torchrec
                                                  # also hps on 2 host partitions (the
                                                  # device-tier path), against in place
    python3 bench/train_bench.py --multi-hot 100000:4,20000:8
                                                  # W4m: two multi-hot fields as well
    python3 bench/train_bench.py --mlp 16 --rounds 5 --no-torchrec --malloc-ab
                                                  # also hps with glibc's malloc as it comes
                                                  # (keep_freed_memory = false), against hps
    python3 bench/train_bench.py --mlp 16 --rounds 5 --no-torchrec --first-layer-ab
                                                  # also hps with torch's nn.Linear as the
                                                  # first layer (every input column's
                                                  # gradient), against hps
    python3 bench/train_bench.py --model-device cuda --no-torchrec
                                                  # W4 on a GPU: every MLP, and plain PyTorch's
                                                  # EmbeddingBag, on cuda:0 (bench/gpu_check.sh)

Model and data (all sides): synthetic Criteo-like examples (hps.data.SyntheticCriteo,
26 categorical fields, 13 dense), embeddings of dim 16 per field, summed per field
(single-hot), concatenated with the dense features, MLP (default 512-256-1), logit;
batch 4096; embeddings trained by AdaGrad (lr 0.05), the MLP by Adam (lr 1e-3,
hps.tuning.dense_adam on every side), the MLP initialised identically. W4m
(--multi-hot V:L,...): multi-hot fields too, each of vocabulary V and Poisson bag
lengths of mean L (SyntheticCriteo's multi_hot), each summed into one vector (hps:
CtrModel's bag embedding; plain PyTorch: the same EmbeddingBag with offsets;
TorchRec: one more table a field, its jagged lengths in the KeyedJaggedTensor).
  * hps: hps.train.train: the ParameterServer (MEM budget holding every row, one host
    partition, so batches train on MEM-PS's rows in place) behind the 4-stage pipeline,
    embeddings through hps.torch. torch's threads: hps.train's ThreadTuner picks all
    cores or one fewer on the first batches (--hps-threads fixes them). [ps] prefault:
    MEM-PS writes its rows' memory when it opens (ps_open_seconds in the JSON), before
    the timed loop, as the peers allocate and initialise their tables before theirs;
    without it the kernel's first touch of each page fell in the loop.
  * plain PyTorch: one nn.EmbeddingBag(sparse=True, mode="sum") over the keys seen in
    the run (keys mapped to dense indices before timing), torch.optim.Adagrad on it;
    --threads torch threads (default: every core, the faster for both peers here).
  * TorchRec (bench/torchrec_peer.py, installed on demand; --no-torchrec skips it): an
    EmbeddingBagCollection of one table per field, sharded table_wise with the fused
    kernel (Adagrad in the backward) under DistributedModelParallel, world size 1.
  * the MLP alone (the bound): the same MLP's forward, backward (with its input's
    gradient, which every system needs for the embeddings) and Adam step on each
    batch's dense features and fixed embedding columns, --threads torch threads. No
    system trains faster on these cores; each is reported as a fraction of it.
With --model-device cuda every MLP trains on GPU 0: hps with model_devices = "cuda" (its
rows on the device tier there, the MLP's input copied over once a batch), plain
PyTorch with its nn.EmbeddingBag and optimizers on the same GPU, each batch's tensors
copied from pinned host memory as a tuned input pipeline does; TorchRec is not run.
The batches are generated once, before timing, and each system trains on them from
memory in its own process (its own thread pools and OpenMP settings), in the same
order, and evaluates on the same held-out examples. With --rounds the systems take
turns, so that the machine's drift hits all of them alike; the median rate of each is
reported (the details are the lower median run's), with every round's ratios; a
ratio is the median of the same-round ratios.
Reported: examples/s (training loop only), each as a fraction of the MLP alone's,
eval AUC and logloss after the same examples, and for hps the pipeline's wall time
over its slowest stage (W9). One JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _provenance import provenance, scratch_dir  # noqa: E402  (commit, date, machine, command of the JSON line)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def plain_torch(train_batches, eval_batches, hidden, threads, seed, lr_emb, lr_dense, dim, device="cpu"):
    import torch
    from torch import nn
    from hps.metrics import auc, logloss
    from hps.tuning import dense_adam
    torch.set_num_threads(threads)
    vocab = np.unique(np.concatenate([b.all_keys().ravel() for b in train_batches + eval_batches]))
    index = lambda keys: torch.from_numpy(np.searchsorted(vocab, keys).astype(np.int64))  # noqa: E731

    gpu = device != "cpu"
    # On a GPU each batch's tensors start in pinned host memory and are copied over in the loop.
    host = (lambda t: t.pin_memory()) if gpu else (lambda t: t)  # noqa: E731

    def inputs(b):  # the single-hot rows, then each multi-hot field's (rows, offsets), the dense features
        return (host(index(b.keys)), [(host(index(g.keys)), host(torch.from_numpy(g.offsets[:-1].astype(np.int64))))
                                      for g in b.bags], host(torch.from_numpy(b.dense)))
    train_idx = [inputs(b) for b in train_batches]
    eval_idx = [inputs(b) for b in eval_batches]
    train_labels = [host(torch.from_numpy(b.labels)) for b in train_batches]
    on = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    n_bags = len(train_batches[0].bags)
    emb = nn.EmbeddingBag(len(vocab), dim, mode="sum", sparse=True)
    with torch.no_grad():  # seeded: the peer's AUC is the same run to run (unseeded it varied by 0.003)
        emb.weight.uniform_(-0.01, 0.01, generator=torch.Generator().manual_seed(seed))

    from hps.torch import mlp as ctr_mlp
    mlp = ctr_mlp((26 + n_bags) * dim + 13, hidden, seed)  # hps.torch.CtrModel's MLP: same layers, same init
    emb.to(device)
    mlp.to(device)
    opt_emb = torch.optim.Adagrad(emb.parameters(), lr=lr_emb)
    opt_mlp = dense_adam(mlp.parameters(), lr_dense)  # the dense step of hps.train (hps.tuning)
    loss_fn = nn.BCEWithLogitsLoss()

    def forward(inp):
        idx, bags, dense = inp
        idx = on(idx)
        pooled = [emb(idx.reshape(-1, 1)).reshape(idx.shape[0], -1)] + [emb(on(k), on(o)) for k, o in bags]
        return mlp(torch.cat(pooled + [on(dense)], 1)).squeeze(1)

    t0 = time.perf_counter()
    n = 0
    for b, idx, labels in zip(train_batches, train_idx, train_labels):
        loss = loss_fn(forward(idx), on(labels))
        opt_emb.zero_grad()
        opt_mlp.zero_grad()
        loss.backward()
        opt_emb.step()
        opt_mlp.step()
        n += len(b.labels)
    if gpu:
        torch.cuda.synchronize()  # the queued kernels are part of the training
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        p = np.concatenate([torch.sigmoid(forward(i)).cpu().numpy() for i in eval_idx])
    y = np.concatenate([b.labels for b in eval_batches])
    return {"examples": n, "seconds": seconds, "examples_per_s": n / seconds, "auc": auc(y, p),
            "logloss": logloss(y, p), "embedding_rows": len(vocab)}


def mlp_alone(train_batches, hidden, threads, seed, lr_dense, dim, device="cpu"):
    """The bound every system shares: the same MLP's forward, backward and dense
    Adam step on each batch, with the gradient of its input (every system needs
    it for the embeddings) but no embeddings: their columns hold fixed values.
    No system can train faster than this on these cores. Its input is built each
    batch (a copy of the fixed columns and the dense features), as every system
    builds its own."""
    import torch
    from hps.torch import mlp as ctr_mlp
    from hps.tuning import dense_adam
    torch.set_num_threads(threads)
    n_bags = len(train_batches[0].bags)
    width = (26 + n_bags) * dim
    net = ctr_mlp(width + 13, hidden, seed).to(device)
    opt = dense_adam(net.parameters(), lr_dense)  # after the move: fused Adam on the parameters' device
    loss_fn = torch.nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(seed)
    batch = max(len(b.labels) for b in train_batches)
    fixed = torch.empty(batch, width + 13).uniform_(-0.01, 0.01, generator=gen)
    gpu = device != "cpu"
    if gpu:  # its input built in pinned host memory and copied over, as hps does
        fixed = fixed.pin_memory()
    t0 = time.perf_counter()
    n = 0
    for b in train_batches:
        rows = len(b.labels)
        x = fixed[:rows].clone()
        x[:, width:] = torch.from_numpy(b.dense)
        x = x.to(device, non_blocking=True)
        x.requires_grad_(True)
        loss = loss_fn(net(x).squeeze(1), torch.from_numpy(b.labels).to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        n += rows
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"examples": n, "seconds": seconds, "examples_per_s": n / seconds, "threads": threads, "device": device}


def run_hps(args, workdir, hidden, train_batches, eval_batches, devices: int = 0, keep_freed_memory: bool = True):
    """devices = 0: the in-place path (one host partition, MEM-PS's rows);
    devices > 0: the device-tier path over that many host partitions.
    keep_freed_memory: TrainConfig's (false: glibc's malloc as it comes)."""
    import hps
    from hps.train import DataConfig, TrainConfig, train
    rows = 2_000_000  # MEM budget for every row the run can touch (W4: the table fits in memory)
    cfg = TrainConfig(
        ps=hps.ParameterServerConfig(dim=args.dim, path=os.path.join(workdir, "ps"),
                                     optimizer=hps.AdaGrad(lr=args.lr_emb), initializer=hps.Uniform(0.01),
                                     mem_budget=rows * (args.dim * 2 * 4 + 112), device_capacity=1 << 20,
                                     # Its rows' memory written before the timed loop, as the peers
                                     # allocate and initialise their tables before theirs.
                                     prefault=True,
                                     devices=max(devices, 1), host_in_place=devices == 0),
        data=DataConfig(batch_size=args.batch_size, train_examples=args.examples,
                        eval_examples=args.eval_examples, seed=args.seed),
        hidden=tuple(hidden), dense_lr=args.lr_dense, seed=args.seed, torch_threads=args.hps_threads,
        pipelined=not args.sequential, model_devices=args.model_device, keep_freed_memory=keep_freed_memory)
    summary = train(cfg, progress=False, train_batches=train_batches, eval_batches=eval_batches)
    return {"examples": summary["examples"], "seconds": summary["train_seconds"],
            "ps_open_seconds": summary["ps_open_seconds"],
            "examples_per_s": summary["examples_per_s"], "auc": summary["final"]["auc"],
            "logloss": summary["final"]["logloss"], "pipeline": summary["pipeline"],
            "mem_hit_rate": summary["final"]["mem_hit_rate"], "torch_threads": summary["torch_threads"],
            "device_tier": summary["ps"]["device"]["kind"], "model_device": args.model_device,
            "malloc": summary["malloc"]}


# mlp_alone: the bound; hps_device: --device-path; hps_glibc_malloc: --malloc-ab;
# hps_torch_first_layer: --first-layer-ab
SYSTEMS = ("mlp_alone", "torch", "torchrec", "hps", "hps_device", "hps_glibc_malloc", "hps_torch_first_layer")
HPS_SYSTEMS = ("hps", "hps_device", "hps_glibc_malloc", "hps_torch_first_layer")


def save_batches(path, train_batches, eval_batches):
    arrays = {}
    for part, batches in (("train", train_batches), ("eval", eval_batches)):
        for name in ("labels", "dense", "keys"):
            arrays[f"{part}_{name}"] = np.concatenate([getattr(b, name) for b in batches])
        for j in range(len(batches[0].bags)):  # a multi-hot field: its keys, and each example's count
            arrays[f"{part}_bag{j}_keys"] = np.concatenate([b.bags[j].keys for b in batches])
            arrays[f"{part}_bag{j}_lengths"] = np.concatenate([np.diff(b.bags[j].offsets) for b in batches])
    np.savez(path, **arrays)


def load_batches(path, batch_size):
    from hps.data import Bags, Batch
    d = np.load(path)
    out = []
    for part in ("train", "eval"):
        labels, dense, keys = d[f"{part}_labels"], d[f"{part}_dense"], d[f"{part}_keys"]
        bags = []
        while f"{part}_bag{len(bags)}_keys" in d:
            j = len(bags)
            bags.append((d[f"{part}_bag{j}_keys"], np.concatenate([[0], np.cumsum(d[f"{part}_bag{j}_lengths"])])))
        # Copies, not views of one block: separately allocated batches, as a reader
        # makes them (TorchRec ran ~7% slower on views).
        out.append([Batch(labels[i:i + batch_size].copy(), dense[i:i + batch_size].copy(),
                          keys[i:i + batch_size].copy(), (),
                          tuple(Bags(k[o[i]:o[min(i + batch_size, len(labels))]].copy(),
                                     (o[i:min(i + batch_size, len(labels)) + 1] - o[i]).astype(np.int64))
                                for k, o in bags))
                    for i in range(0, len(labels), batch_size)])
    return out


def run_system(a, system, hidden, data_path, workdir):
    """One system's run in this process (the --system worker)."""
    train_batches, eval_batches = load_batches(data_path, a.batch_size)
    if system == "mlp_alone":
        return mlp_alone(train_batches, hidden, a.threads, a.seed, a.lr_dense, a.dim, a.model_device)
    if system == "torch":
        return plain_torch(train_batches, eval_batches, hidden, a.threads, a.seed, a.lr_emb, a.lr_dense, a.dim,
                           a.model_device)
    if system == "torchrec":
        sys.path.insert(0, HERE)
        import torchrec_peer
        return torchrec_peer.torchrec(train_batches, eval_batches, hidden, a.threads, a.seed, a.lr_emb,
                                      a.lr_dense, a.dim)
    if system == "hps_torch_first_layer":
        # This process only: CtrModel declines to run the first layer itself, so the MLP's
        # nn.Linear computes it (and every input column's gradient) through torch's autograd.
        import hps.torch
        hps.torch.CtrModel._first_layer = lambda self, device: None
        hps.torch.NarrowLinear.forward = hps.torch.nn.Linear.forward  # (not hps's narrow kernels either)
    return run_hps(a, workdir, hidden, train_batches, eval_batches,
                   devices=a.device_path if system == "hps_device" else 0,
                   keep_freed_memory=system != "hps_glibc_malloc")


def spawn(a, system, data_path, workdir) -> dict:
    """Runs one system in a fresh process: each starts with its own thread pools
    and OpenMP settings, and none inherits another's heap."""
    argv = [sys.executable, os.path.abspath(__file__), "--system", system, "--data", data_path,
            "--workdir", workdir]
    for name in ("examples", "eval_examples", "batch_size", "mlp", "dim", "lr_emb", "lr_dense", "threads",
                 "hps_threads", "seed", "device_path", "multi_hot", "model_device"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    if a.sequential:
        argv.append("--sequential")
    run = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{system} run failed (exit {run.returncode}); its stderr is above")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--examples", type=int, default=2_000_000)
    ap.add_argument("--eval-examples", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--mlp", default="512,256", help="hidden widths, e.g. 512,256 (W4) or 16 (W4s)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr-emb", type=float, default=0.05)
    ap.add_argument("--lr-dense", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads of the peers")
    ap.add_argument("--hps-threads", type=int, default=0,
                    help="torch threads of hps (0: hps.train's ThreadTuner picks)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each system, interleaved; medians reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequential", action="store_true", help="hps without the pipeline")
    ap.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec peer (installed on demand)")
    ap.add_argument("--multi-hot", default="", metavar="V:L,...",
                    help="W4m: multi-hot fields as well, each of vocabulary V and mean bag length L")
    ap.add_argument("--device-path", type=int, default=0, metavar="G",
                    help="also run hps on the device-tier path over G host partitions (host_in_place off) "
                         "and report its rate over the in-place path's")
    ap.add_argument("--malloc-ab", action="store_true",
                    help="also run hps with glibc's malloc as it comes (keep_freed_memory = false) and report "
                         "hps's rate over it")
    ap.add_argument("--first-layer-ab", action="store_true",
                    help="also run hps with torch's nn.Linear as the MLP's first layer (CtrModel's own off) and "
                         "report hps's rate over it")
    ap.add_argument("--model-device", choices=("cpu", "cuda"), default="cpu",
                    help="where every system's MLP trains (cuda: GPU 0; plain PyTorch's embeddings too)")
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)  # worker: one run, one JSON line
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.examples = min(a.examples, 300_000)
        a.eval_examples = min(a.eval_examples, 50_000)
    hidden = [int(h) for h in a.mlp.split(",") if h]
    try:
        multi_hot = [(int(v), float(n)) for v, n in (f.split(":") for f in a.multi_hot.split(",") if f)]
    except ValueError:
        ap.error(f"--multi-hot: {a.multi_hot!r} is not V:L,... (vocabulary:mean bag length)")
    if a.system:
        print(json.dumps(run_system(a, a.system, hidden, a.data, a.workdir)), flush=True)
        return
    if a.model_device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("--model-device cuda: torch sees no CUDA GPU here")
        if a.device_path:
            ap.error("--model-device cuda with --device-path: the device path over host partitions is a CPU figure")
        a.no_torchrec = True  # its sharded GPU kernels need a process group of its own; not measured here
    systems = [s for s in SYSTEMS if not (s == "torchrec" and a.no_torchrec) and
               not (s == "hps_device" and not a.device_path) and not (s == "hps_glibc_malloc" and not a.malloc_ab)
               and not (s == "hps_torch_first_layer" and not a.first_layer_ab)]
    if "torchrec" in systems:
        sys.path.insert(0, HERE)
        import torchrec_peer
        torchrec_peer.ensure_installed()
    from hps.data import SyntheticCriteo
    name = "W4s" if hidden == [16] else "W4"
    out = {"benchmark": f"{name}{'m' if multi_hot else ''} train", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "multi_hot": [list(f) for f in multi_hot],
           "examples": a.examples, "eval_examples": a.eval_examples, "batch_size": a.batch_size, "mlp": hidden,
           "dim": a.dim, "threads": a.threads, "hps_threads": a.hps_threads, "rounds": a.rounds,
           "device_path": a.device_path, "model_device": a.model_device, "quick": a.quick,
           "malloc_ab": a.malloc_ab, "first_layer_ab": a.first_layer_ab,
           "machine": {"cpus": os.cpu_count()}, "provenance": provenance()}
    workdir = scratch_dir("train-bench-")
    try:
        log("== generating the data ==")
        data_path = os.path.join(workdir, "batches.npz")
        kw = {"multi_hot": multi_hot} if multi_hot else {}
        save_batches(data_path,
                     list(SyntheticCriteo(seed=a.seed, batch_size=a.batch_size, examples=a.examples, **kw)),
                     list(SyntheticCriteo(seed=a.seed, batch_size=a.batch_size, examples=a.eval_examples,
                                          part="eval", **kw)))
        runs = {s: [] for s in systems}
        for r in range(a.rounds):
            for system in systems:
                log(f"== round {r + 1}/{a.rounds}: {system} ==")
                shutil.rmtree(os.path.join(workdir, "ps"), ignore_errors=True)
                result = spawn(a, system, data_path, workdir)
                runs[system].append(result)
                extra = ""
                if system in HPS_SYSTEMS:
                    p = result["pipeline"]
                    extra = (f", wall/slowest stage {p['wall_over_slowest_stage']:.2f} (bound by {p['bound_by']}), "
                             f"torch threads {result['torch_threads']['chosen']}")
                auc_text = f", AUC {result['auc']:.4f}" if "auc" in result else " (the MLP alone: the bound)"
                log(f"{system}: {result['examples_per_s']:,.0f} examples/s{auc_text}{extra}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for system, results in runs.items():
        rates = [r["examples_per_s"] for r in results]
        out[system] = dict(results[int(np.argsort(rates)[(len(rates) - 1) // 2])])  # the (lower) median run
        out[system]["examples_per_s_runs"] = rates
        out[system]["examples_per_s"] = float(np.median(rates))
    median = {s: out[s]["examples_per_s"] for s in runs}
    # A ratio is the median of the same-round ratios (each round's runs ran close in time):
    # (its per-round key, its median's key, the system over, the system under).
    for per_round, key, over, under in (
            ("ratio_per_round", "ratio_examples_per_s", "hps", "torch"),
            ("ratio_over_torchrec_per_round", "ratio_over_torchrec", "hps", "torchrec"),
            ("ratio_device_path_over_in_place_per_round", "ratio_device_path_over_in_place", "hps_device", "hps"),
            ("ratio_keep_freed_memory_per_round", "ratio_keep_freed_memory", "hps", "hps_glibc_malloc"),
            ("ratio_own_first_layer_per_round", "ratio_own_first_layer", "hps", "hps_torch_first_layer")):
        if over in runs and under in runs:
            out[per_round] = [a["examples_per_s"] / b["examples_per_s"] for a, b in zip(runs[over], runs[under])]
            out[key] = float(np.median(out[per_round]))
    # What fraction of the bound each system reaches, round by round.
    out["fraction_of_mlp_alone_per_round"] = {s: [r["examples_per_s"] / m["examples_per_s"]
                                                  for r, m in zip(runs[s], runs["mlp_alone"])]
                                              for s in runs if s != "mlp_alone"}
    out["fraction_of_mlp_alone"] = {s: float(np.median(v)) for s, v in out["fraction_of_mlp_alone_per_round"].items()}
    out["auc_difference"] = out["hps"]["auc"] - out["torch"]["auc"]
    out["w9_wall_over_slowest_stage"] = out["hps"]["pipeline"]["wall_over_slowest_stage"]
    log(f"median examples/s: " + ", ".join(f"{s} {v:,.0f}" for s, v in median.items()))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
