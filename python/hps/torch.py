"""PyTorch integration: embedding bags whose rows live in a ParameterServer.

``EmbeddingBag`` is shaped like ``torch.nn.EmbeddingBag`` (sum or mean pooling over
bags given by offsets, or over the rows of a 2-D input with optional padding), but
holds no weight: its forward pulls the rows of the batch's keys from the parameter
server (from the device tier while a batch is attached, from MEM-PS otherwise) and
its backward pushes their gradients back, where the sparse optimizer steps once per
key. Dense parameters stay ordinary torch parameters for any torch optimizer.
``SparseStep`` holds the rows' gradients until a step of its own, for
``torch.amp.GradScaler``, which unscales them and skips the steps it skips.

``CtrModel`` is the reference click-through-rate model: one pooled embedding per
categorical field, concatenated with the dense features, through an MLP to a logit.

Requires torch (``pip install torch``); the rest of hps does not.
"""
from __future__ import annotations

import copy
import threading
import weakref
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hps import _core
from hps.parameter_server import ParameterServer, WorkingBatch, working_batch

__all__ = ["EmbeddingBag", "CtrModel", "DeviceReplicas", "NarrowLinear", "SparseStep", "WorkerShares", "mlp"]


def mlp(in_width: int, hidden: Sequence[int], seed: int = 0, narrow_kernels: bool = False) -> nn.Sequential:
    """Linear+ReLU layers of the widths in `hidden`, then one output: the CTR
    model's MLP, initialised from `seed` alone (uniform +-1/sqrt(fan_in), as
    torch's default), so that benchmark peers can build the same network.
    `narrow_kernels`: the first layer an hps.torch.NarrowLinear (CtrModel's),
    the same parameters; the peers' is torch's nn.Linear."""
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    width = in_width
    for h in hidden:
        # In place: the ReLU needs no tensor of its own (5% of a W5 step on 2 cores).
        linear = NarrowLinear if narrow_kernels and not layers else nn.Linear
        layers += [linear(width, h), nn.ReLU(inplace=True)]
        width = h
    layers.append(nn.Linear(width, 1))
    net = nn.Sequential(*layers)
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Linear):
                bound = 1.0 / np.sqrt(m.in_features)
                m.weight.uniform_(-bound, bound, generator=gen)
                m.bias.uniform_(-bound, bound, generator=gen)
    return net


def _occurrences(keys: np.ndarray, key: int) -> np.ndarray:
    """Flat indices of `key` in `keys`: a frozen key's (EmbeddingBag.frozen_key), whose
    gradients are dropped, so its row stays as the initializer made it (a zero gradient
    leaves a row unchanged under SGD, AdaGrad and Adam alike)."""
    return np.flatnonzero(keys.reshape(-1) == np.uint64(key))


def _keys_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.int64:
        raise TypeError(f"input must be an int64 tensor of keys (uint64 keys bit-cast), got {t.dtype}")
    return t.detach().cpu().contiguous().numpy().view(np.uint64)


def _anchored(anchor: torch.Tensor) -> torch.Tensor:
    """A lookup's first input: a view of its module's anchor, so that its backward
    can ask whether the pass trains the rows (_trains_rows). (Of the anchor itself,
    a leaf, torch answers no question inside torch.autograd.grad.)"""
    return anchor.view(1)


def _trains_rows() -> bool:
    """Whether the backward pass running the lookup's backward (which calls this)
    trains its rows: whether it runs the node of the lookup's first input (_anchored).
    .backward() runs every node; torch.autograd.grad, and backward(inputs=...) without
    the anchor, only those the gradients asked for need: a lookup's backward runs for
    its per_sample_weights' gradient, or for the MLP's through CtrModel's first layer,
    and nn.EmbeddingBag's weight takes no gradient then. (A torch without the query:
    every pass trains.)"""
    current, will_run = (getattr(torch._C, name, None) for name in
                         ("_current_autograd_node", "_will_engine_execute_node"))
    node = current() if current is not None and will_run is not None else None
    if node is None:
        return True
    anchor = node.next_functions[0][0]
    return anchor is None or will_run(anchor)


def _graph_task() -> int:
    """The running backward pass's id (torch's graph task), or -1 outside one (or
    in a torch without graph task ids)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


# The gradients the lookups of each backward pass (torch's graph task) pushed, by
# pass: {server: [(keys, grads), ...]}, pushed at the pass's end (_push_pass). The
# lock: a pass on several devices runs backwards on several threads. (Reentrant: a
# failed pass's entry is dropped when torch frees its callback, which may happen on
# any thread, at any decref, in principle while this thread holds the lock.)
_PENDING: dict = {}
_PENDING_LOCK = threading.RLock()
# The last backward pass whose lookups went into a batch, by server (id): a pass that
# also pushes to that server directly is refused at its end (_push_pass).
_BATCHED: dict = {}


def _into_batch(ps) -> None:
    """A lookup's gradients went into a batch of ps in the running pass."""
    task = _graph_task()
    if task >= 0:
        with _PENDING_LOCK:
            _BATCHED[id(ps)] = task


def _named(module) -> str:
    """A module as errors name it: its kind, dim and pooling, and its server."""
    return f"hps.torch.EmbeddingBag(dim={module.dim}, mode={module.mode!r}) on {module.ps!r}"


def _refuse_direct_push(module) -> None:
    """Raises where the server's push of a module with no batch attached would wait
    forever: the push waits for every batch of the server to finish, and one of
    them (ParameterServer._batch_in_the_way) finishes only after this thread goes
    on: a backward inside the batch's with block (its forward there or before it),
    in a pipeline's train step. The backward hung there, in one thread."""
    in_the_way = getattr(module.ps, "_batch_in_the_way", None)
    why = in_the_way() if in_the_way is not None else None
    if why is not None:
        raise RuntimeError(
            f"hps.torch: {_named(module)} has no batch attached, so its gradients go to the server directly, whose "
            f"push waits for every batch of the server to finish; a batch of it is open ({why}) and finishes only "
            f"after this backward pass: the push would wait forever. Nothing was pushed. Attach the module to the "
            f"batch (module.attach(batch, worker)), or run the backward pass once the batch is finished (after its "
            f"with block)")


def _to_batch(module, batch, positions, grads, worker: int, tensor: bool = False) -> None:
    """A lookup's gradients, laid out as the batch gave its rows, to that batch:
    added there (accumulate_tensor for a tensor), or held by the module's
    SparseStep until its step."""
    if module._held is not None:
        module._held._hold(module, batch, positions, grads, worker, tensor)
        return
    if tensor:
        batch.accumulate_tensor(positions, grads, worker=worker)
    else:
        batch.accumulate(positions, grads, worker=worker)
    _into_batch(module.ps)


def _push(module, keys: np.ndarray, grads: np.ndarray) -> None:
    """Sends a lookup's gradients (its distinct keys') to ps: inside a backward pass,
    at the pass's end, summed per key with those of the pass's other lookups (a
    model's other modules, one module's other lookups), so that each key takes one
    optimizer step on its summed gradient, as torch's sparse embedding and its
    optimizer do, and the pass is one step of the server ([ps] ttl_steps). A push
    per lookup stepped a key in two lookups twice: the same as one step under SGD,
    not under AdaGrad or Adam. Outside a backward pass (or a torch without graph task
    ids) at once, as ParameterServer.push alone. Held by the module's SparseStep
    until its step, if it has one. Refused at once where the push would wait for a
    batch that waits for this pass (_refuse_direct_push)."""
    if module._held is not None:
        module._held._hold(module, None, keys, grads, 0, False)
        return
    _refuse_direct_push(module)
    ps = module.ps
    task = _graph_task()
    if task < 0:
        ps.push(keys, grads)
        return
    with _PENDING_LOCK:
        first = task not in _PENDING
        _PENDING.setdefault(task, {}).setdefault(ps, []).append((keys, grads))
    if first:
        # Run once every node of the pass has run (as DDP's reducer finishes its
        # all-reduces); an error in it reaches backward()'s caller. A pass that
        # fails before its end runs no callback: its gradients reach no row. The
        # pass's graph task holds the callback until the task is freed, run or not,
        # so its freeing drops the entry: that of a failed pass (with its server)
        # stayed for the life of the process. (Not by task id: passes on other
        # threads, or nested ones, run at once with lower and higher ids.)
        def at_end():
            _push_pass(task)
        weakref.finalize(at_end, _drop_pass, task)
        torch.autograd.Variable._execution_engine.queue_callback(at_end)


def _drop_pass(task: int) -> None:
    """A pass's gradients, once torch freed its end callback: none after the pass's
    push (_push_pass took them); a failed pass's, which nothing will push."""
    with _PENDING_LOCK:
        _PENDING.pop(task, None)


def _push_pass(task: int) -> None:
    """The pass's gradients to each server it pushed to (in the order of their
    first pushes), summed per key: one push, one step, a server."""
    with _PENDING_LOCK:
        by_server = _PENDING.pop(task)
        both = any(_BATCHED.get(id(ps)) == task for ps in by_server)
    if both:
        # The push waits for the server's batch in flight to finish, and that batch
        # (the one this pass accumulates into) finishes after this pass: forever.
        raise RuntimeError(
            "hps.torch: this backward pass's lookups went both into a batch of a parameter server (a module "
            "attached to it) and to the server directly (a module on the same server with no batch attached), "
            "whose push would wait for that batch, which waits for this pass; nothing was pushed. Attach every "
            "hps.torch module on the server to the batch (module.attach(batch, worker)) or none")
    for ps, parts in by_server.items():
        if len(parts) == 1:
            keys, grads = parts[0]
        else:
            keys, inverse = _core.unique_keys(np.concatenate([k for k, _ in parts]))
            grads = _core.sum_by_inverse(inverse, np.concatenate([g for _, g in parts]), len(keys))
        ps.push(keys, grads)


class _PooledLookup(torch.autograd.Function):
    """Rows of distinct keys, pooled into bags; backward sends per-key gradients."""

    @staticmethod
    def forward(ctx, anchor, module, keys, bag, weights, counts, device):
        ctx.batch, ctx.worker = module.batch, module.worker
        if ctx.batch is not None:
            # One row per key from the batch's working set; no distinct-key pass.
            ctx.positions = ctx.batch.positions(keys)
            elem = torch.from_numpy(ctx.batch.gather(ctx.positions, worker=ctx.worker))
        else:
            uniq, inverse = _core.unique_keys(np.ascontiguousarray(keys))
            rows = torch.from_numpy(module.ps.pull(uniq))
            elem = rows[torch.from_numpy(inverse)]
            ctx.uniq, ctx.inverse = uniq, inverse
        ctx.rows = None
        if weights is not None:
            if ctx.needs_input_grad[4]:  # d out / d weight j = row j . grad_out[bag j]
                ctx.rows = elem
            elem = elem * weights.unsqueeze(1)
        bag_t = torch.from_numpy(bag)
        if weights is None and len(bag) == len(counts) and (counts == 1).all():
            out = elem  # one key a bag (single-hot fields): pooling is the identity
        else:
            out = torch.zeros(len(counts), module.dim, dtype=torch.float32)
            out.index_add_(0, bag_t, elem)
        if module.mode == "mean":
            out = out / torch.from_numpy(np.maximum(counts, 1)).to(torch.float32).unsqueeze(1)
        ctx.module, ctx.bag, ctx.counts, ctx.keys = module, bag_t, counts, keys
        ctx.save_for_backward(weights if weights is not None else torch.empty(0))
        return out.to(device)  # (no copy on the CPU)

    @staticmethod
    def backward(ctx, grad_out):
        (weights,) = ctx.saved_tensors
        module = ctx.module
        grad_out = grad_out.to("cpu", torch.float32)
        if module.mode == "mean":
            grad_out = grad_out / torch.from_numpy(np.maximum(ctx.counts, 1)).to(torch.float32).unsqueeze(1)
        elem = grad_out if len(ctx.bag) == len(ctx.counts) and (ctx.counts == 1).all() else grad_out[ctx.bag]
        grad_weights = None
        if ctx.rows is not None:
            grad_weights = (ctx.rows * elem).sum(1)
        if not _trains_rows():  # (the pass asked for per_sample_weights' gradient alone)
            return None, None, None, None, grad_weights, None, None
        if weights.numel():
            elem = elem * weights.unsqueeze(1)
        incoming = elem is grad_out  # (a single-hot lookup's gradient, as autograd handed it)
        elem = np.ascontiguousarray(elem.detach().numpy())
        if module.frozen_key is not None:
            drop = _occurrences(ctx.keys, module.frozen_key)
            if len(drop) and incoming:
                # Not in place: autograd hands one gradient to several branches (an
                # addition's inputs), and the other's rows would be zeroed too.
                elem = elem.copy()
            elem[drop] = 0.0
        if ctx.batch is not None:
            _to_batch(module, ctx.batch, ctx.positions, elem, ctx.worker)  # summed per key as they arrive
        else:
            # One pass in C++: torch's index_add_ took 4x as long on these shapes.
            _push(module, ctx.uniq, _core.sum_by_inverse(ctx.inverse, elem, len(ctx.uniq)))
        return None, None, None, None, grad_weights, None, None


# A wide first layer's input rows lie this many floats apart, or a multiple of it
# (64 bytes), the columns past the input's zeros: torch's BLAS computes the weight's
# gradient grad^T x faster over W4's rows padded to 432 floats than over its 429
# columns (_weight_grad; docs/benchmarks.md, W4l: python3 bench/first_layer_bench.py).
_ROW_FLOATS = 16


def _model_input(ctx, batch, worker, dim, keys, dense, frozen_key, device, padded=False):
    """[field embeddings | dense] for _InputWithFields and _FirstLayer: the rows
    gathered straight into the first columns of the MLP's input (a field of one key
    pools to its row; a host batch reads them from MEM-PS); on a GPU, or from a batch
    that does not gather into columns, gathered into a tensor of their own on that
    device (by the tier itself where it can: WorkingBatch.gather_tensor) and the input
    put together from it. Keeps on ctx what a backward needs to hand the gradient back.
    padded (on the CPU, gathering into columns): the input is the first columns of a
    matrix whose rows are _ROW_FLOATS floats apart or a multiple of it, zeros after
    them (_weight_grad multiplies over all of them)."""
    examples, fields = keys.shape
    width = fields * dim
    ctx.positions = batch.positions(keys)
    ctx.batch, ctx.worker, ctx.width, ctx.dim, ctx.keys, ctx.frozen_key = batch, worker, width, dim, keys, frozen_key
    if device.type != "cpu" or not batch.gathers_into_columns:
        rows = torch.empty(examples * fields, dim, dtype=torch.float32, device=device)
        batch.gather_tensor(ctx.positions, rows, worker=worker)
        return torch.cat([rows.view(examples, width), dense.to(device, torch.float32, non_blocking=True)], 1)
    cols = width + dense.shape[1]
    if padded and cols % _ROW_FLOATS:
        rows = torch.empty(examples, cols + _ROW_FLOATS - cols % _ROW_FLOATS, dtype=torch.float32)
        rows[:, cols:] = 0.0
        x = rows[:, :cols]
    else:
        x = torch.empty(examples, cols, dtype=torch.float32)
    batch.gather(ctx.positions, x.numpy()[:, :width], worker=worker)
    x[:, width:] = dense
    return x


def _weight_grad(grad_h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_h^T x, a linear layer's weight gradient (out, in) for its input x (B, in).
    Where x's rows lie further apart than its columns (_model_input's padded rows),
    the product runs over the whole rows, zeros included, and the weight's columns
    are copied out of it: a product whose rows are a multiple of 64 bytes long ran
    faster than the narrower one, by more than the copy costs."""
    rows, cols = x.shape
    covered = x.storage_offset() + rows * x.stride(0) <= x.untyped_storage().nbytes() // x.element_size()
    if x.stride(1) != 1 or x.stride(0) <= cols or not covered:
        return grad_h.t().mm(x)
    whole = x.as_strided((rows, x.stride(0)), (x.stride(0), 1))
    return grad_h.t().mm(whole)[:, :cols].contiguous()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a lies in b's memory (a view of it, or b itself as .to and .contiguous
    hand it back when there is nothing to convert)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _InputWithFields(torch.autograd.Function):
    """A batch's MLP input [field embeddings | dense] in one matrix (_model_input),
    whose backward hands the embedding columns' gradient to the batch where it lies.
    The same values as pooling and torch.cat, without the concatenation's copy and
    the copies of the gradient slice."""

    @staticmethod
    def forward(ctx, anchor, module, batch, worker, dim, keys, dense, frozen_key, device):
        ctx.module = module
        return _model_input(ctx, batch, worker, dim, keys, dense, frozen_key, device)

    @staticmethod
    def backward(ctx, grad_x):
        if not _trains_rows():
            return (None,) * 9
        if grad_x.device.type != "cpu" or not ctx.batch.gathers_into_columns:
            fields = ctx.keys.shape[1]
            grads = grad_x[:, :ctx.width].to(torch.float32).contiguous().view(-1, ctx.width // fields)
            if ctx.frozen_key is not None:  # one row a key: the frozen key's rows
                drop = _occurrences(ctx.keys, ctx.frozen_key)
                if len(drop) and _same_storage(grads, grad_x):
                    grads = grads.clone()  # (not in autograd's tensor: see below)
                grads[torch.from_numpy(drop).to(grads.device)] = 0.0
            _to_batch(ctx.module, ctx.batch, ctx.positions, grads, ctx.worker, tensor=True)
            return (None,) * 9
        grads_t = grad_x.detach().to(torch.float32).contiguous()
        grads = grads_t.numpy()
        if ctx.frozen_key is not None:  # its columns
            drop = _occurrences(ctx.keys, ctx.frozen_key)
            if len(drop) and _same_storage(grads_t, grad_x):
                # Not in place: autograd hands one gradient to several branches (a model
                # that adds x to another tensor), and the other's columns would be zeroed too.
                grads = grads.copy()
            fields = ctx.keys.shape[1]
            dim = ctx.width // fields
            grads[(drop // fields)[:, None], ((drop % fields) * dim)[:, None] + np.arange(dim)] = 0.0
        _to_batch(ctx.module, ctx.batch, ctx.positions, grads[:, :ctx.width], ctx.worker)
        return (None,) * 9


# The narrow kernels' threads, whatever torch's: on W4l's shapes (4096 x 429, 16 units,
# cold caches) one thread of them took less time than torch's products on two, and two
# of them (a thread started a call) more than one.
_NARROW_THREADS = 1


def _narrow_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ weight.T + bias by hps's narrow kernel (x: rows of consecutive floats)."""
    h = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _core.narrow_linear_forward(x.detach().numpy(), weight.detach().numpy(),
                                None if bias is None else bias.detach().numpy(), h.numpy(), threads=_NARROW_THREADS)
    return h


def _narrow_input_grad(grad_h: torch.Tensor, weight: torch.Tensor, columns: int) -> np.ndarray:
    """grad_h @ weight[:, :columns] by hps's narrow kernel, (rows, columns) float32."""
    out = np.empty((grad_h.shape[0], columns), dtype=np.float32)
    _core.narrow_linear_input_grad(grad_h.detach().contiguous().numpy(), weight.detach().numpy(), columns, out,
                                   threads=_NARROW_THREADS)
    return out


def _narrow_weight_grads(grad_h: torch.Tensor, x: torch.Tensor, weight: bool,
                         bias: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The weight's gradient grad_h.T @ x if `weight`, the bias's grad_h.sum(0) (in row
    order) if `bias`, by hps's narrow kernel (one pass over x for both)."""
    if not (weight or bias):
        return None, None
    grad_weight = torch.empty(grad_h.shape[1], x.shape[1], dtype=torch.float32)
    grad_bias = torch.empty(grad_h.shape[1], dtype=torch.float32) if bias else None
    _core.narrow_linear_weight_grad(grad_h.detach().contiguous().numpy(), x.detach().numpy(), grad_weight.numpy(),
                                    None if grad_bias is None else grad_bias.numpy(), threads=_NARROW_THREADS)
    return grad_weight if weight else None, grad_bias


class _NarrowLinearProducts(torch.autograd.Function):
    """NarrowLinear's products by hps's kernels, on an input of its own: what
    _FirstLayer computes inside a batch, so that a model fed its input another way
    (CtrModel without a batch, a Hogwild net on the input it tapped) gets the same
    bits. The input's gradient covers every column."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x = x if x.stride(-1) == 1 else x.contiguous()
        ctx.save_for_backward(x, weight)
        return _narrow_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_h):
        x, weight = ctx.saved_tensors
        grad_x = torch.from_numpy(_narrow_input_grad(grad_h, weight, x.shape[1])) if ctx.needs_input_grad[0] else None
        grad_weight, grad_bias = _narrow_weight_grads(grad_h, x, *ctx.needs_input_grad[1:3])
        return grad_x, grad_weight, grad_bias


class NarrowLinear(nn.Linear):
    """nn.Linear (the same parameters and state_dict) whose products, for at most 16
    outputs in float32 on the CPU, run on hps's kernels (hps/narrow_linear.h: at that
    width torch's BLAS spends more time packing the input and clearing its output
    than multiplying). CtrModel's first layer; wider layers, other dtypes and devices
    are nn.Linear's. The sums are in a fixed order, so every path that trains a
    CtrModel on the CPU (a batch's _FirstLayer, a Hogwild net) gets the same bits."""

    def runs_kernels(self, x: Optional[torch.Tensor] = None) -> bool:
        w = self.weight
        return (w.shape[0] <= _core.NARROW_LINEAR_MAX_OUTPUTS and w.dtype == torch.float32
                and w.device.type == "cpu" and w.is_contiguous()
                and (x is None or (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.runs_kernels(x):
            return super().forward(x)
        return _NarrowLinearProducts.apply(x, self.weight, self.bias)


def _first_linear(net: nn.Module, device: torch.device) -> Optional[nn.Linear]:
    """The first layer of `net` where hps.torch computes it itself (_FirstLayer,
    _FirstLayerOnPooled): an nn.Sequential starting with a float32 nn.Linear (or
    NarrowLinear) with a bias, on the CPU; else None."""
    if device.type != "cpu" or not isinstance(net, nn.Sequential) or len(net) < 2:
        return None
    first = net[0]
    if type(first) not in (nn.Linear, NarrowLinear) or first.bias is None or first.weight.dtype != torch.float32:
        return None
    return first


class _FirstLayer(torch.autograd.Function):
    """The MLP's first layer (weight (k, in), bias (k,)) on the batch's input
    [field embeddings | dense] (_model_input), on the CPU. Its backward computes the
    input's gradient for the embedding columns only, grad (B, k) times the weight's
    first fields x dim columns, and hands it to the batch; nn.Linear's autograd would
    compute every column, the dense features' too, which nothing reads. That is
    less work, and more so than the columns say: W4's input has 26 x 16 + 13 = 429
    columns, rows that are not a multiple of 64 bytes, and torch's BLAS (MKL on an
    AMD EPYC) took 2.6 times as long for every column as for the 416 embedding
    columns at k = 16 on one thread, 1.3 times at k = 512 (docs/benchmarks.md, W4l:
    python3 bench/first_layer_bench.py). A layer of at most 16 outputs (W4s) runs
    its forward product and all three gradients on hps's own kernels (NarrowLinear's),
    the same on every path that trains through this layer; wider ones on torch's
    addmm and mm, the weight's and bias's gradients as nn.Linear computes them, but
    over input rows padded to a multiple of 64 bytes (_model_input, _weight_grad)."""

    @staticmethod
    def forward(ctx, anchor, module, batch, worker, dim, keys, dense, frozen_key, narrow, weight, bias):
        ctx.module = module
        x = _model_input(ctx, batch, worker, dim, keys, dense, frozen_key, torch.device("cpu"), padded=not narrow)
        ctx.save_for_backward(x, weight)
        ctx.narrow = narrow
        if not narrow:
            return torch.addmm(bias, x, weight.t())
        return _narrow_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_h):
        x, weight = ctx.saved_tensors
        trains = _trains_rows()  # (else the pass asked for the weight's and bias's gradients alone)
        if ctx.narrow:
            grad_weight, grad_bias = _narrow_weight_grads(grad_h, x, *ctx.needs_input_grad[9:11])
            grads = _narrow_input_grad(grad_h, weight, ctx.width) if trains else None  # (B, fields * dim)
        else:
            grad_weight = _weight_grad(grad_h, x) if ctx.needs_input_grad[9] else None
            grad_bias = grad_h.sum(0) if ctx.needs_input_grad[10] else None
            # (B, fields * dim), contiguous
            grads = grad_h.detach().mm(weight.detach()[:, :ctx.width]).numpy() if trains else None
        if not trains:
            return (None,) * 9 + (grad_weight, grad_bias)
        if ctx.frozen_key is not None:  # its rows, in place (this backward made them)
            grads.reshape(-1, ctx.dim)[_occurrences(ctx.keys, ctx.frozen_key)] = 0.0
        _to_batch(ctx.module, ctx.batch, ctx.positions, grads, ctx.worker)
        return (None,) * 9 + (grad_weight, grad_bias)


class _FirstLayerOnPooled(torch.autograd.Function):
    """The MLP's first layer on [pooled embeddings... | dense] put together by torch.cat
    (CtrModel with multi-hot fields, on the CPU): apply(dense, weight, bias, *pooled).
    As _FirstLayer, its backward computes the input's gradient for the embedding columns
    only (each piece's, views of one product) and none for the dense features unless
    they require it."""

    @staticmethod
    def forward(ctx, dense, weight, bias, *pooled):
        x = torch.cat([*pooled, dense.to(torch.float32)], dim=1)
        ctx.save_for_backward(x, weight)
        ctx.widths = [p.shape[1] for p in pooled]
        return torch.addmm(bias, x, weight.t())

    @staticmethod
    def backward(ctx, grad_h):
        x, weight = ctx.saved_tensors
        width = sum(ctx.widths)
        grad_dense = grad_h.mm(weight[:, width:]) if ctx.needs_input_grad[0] else None
        grad_weight = grad_h.t().mm(x) if ctx.needs_input_grad[1] else None
        grad_bias = grad_h.sum(0) if ctx.needs_input_grad[2] else None
        grads = torch.split(grad_h.mm(weight[:, :width]), ctx.widths, dim=1) if width else ()
        return (grad_dense, grad_weight, grad_bias, *grads)


# A module's rows live in its server, which a copy cannot take: deepcopy and pickle
# failed on the server's native optimizer ("cannot pickle 'hps._core.SparseOptimizer'
# object"), naming neither the module nor what to save instead.
_NOT_COPIED = ("hps.torch.EmbeddingBag cannot be copied or pickled: it holds no weight, its rows live in its "
               "ParameterServer, which a copy cannot take (a second server over the same files). Save the dense "
               "parameters with the model's state_dict() and the rows with ps.checkpoint() (hps.ParameterServer.open "
               "resumes them); to copy a model, share the module: copy.deepcopy(model, {id(bag): bag}), as "
               "DeviceReplicas' shared= does")


class EmbeddingBag(nn.Module):
    """nn.EmbeddingBag-like pooling over rows kept in `ps`.

    forward(input, offsets=None, per_sample_weights=None):
      - 1-D input (int64 keys) with offsets (bag starts, like nn.EmbeddingBag);
      - 2-D input (B, L): one bag per row; entries equal to ``padding_key`` are
        left out (an empty bag pools to zeros).
    per_sample_weights (the input's shape) scale each key's row before pooling and,
    where they require grad, get their gradient as nn.EmbeddingBag's do; with
    ``mode="mean"`` (which nn.EmbeddingBag refuses) a bag's weighted sum is divided by
    its number of keys.
    Returns (B, dim) float32 on the input's device (the rows are looked up in
    host memory or on the device tier, and copied there). Gradients go to the
    parameter server on backward: into the attached batch (``attach``) if there
    is one, else as a ps.push at the end of the backward pass, summed per key
    with the pass's other lookups (of any module on that server): one optimizer
    step a key on its summed gradient, and one step of the server ([ps] ttl_steps);
    or, for a module of a SparseStep, at its step. A backward pass of a module with
    no batch attached while a batch of its server is open (whose push would wait
    for it, forever) is refused (RuntimeError).
    """

    def __init__(self, ps: ParameterServer, mode: str = "sum", padding_key: Optional[int] = None):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        if padding_key is not None and not -(1 << 63) <= padding_key < (1 << 64):
            # (masked to 64 bits it would name another key, whose rows would be dropped)
            raise ValueError(f"padding_key must be a 64-bit key (-2**63 to 2**64 - 1), got {padding_key}")
        self.ps = ps
        self.dim = ps.dim
        self.mode = mode
        self.padding_key = padding_key
        #: A key whose gradients are dropped, its row never trained (admission's default
        #: row, hps.admission); None: every key trains.
        self.frozen_key: Optional[int] = None
        # Gives the lookup's output a grad_fn, so backward reaches it.
        self.anchor = torch.zeros(1, requires_grad=True)
        self.batch: Optional[WorkingBatch] = None
        self.worker = 0
        # The SparseStep that holds this module's gradients until its step (None: they
        # go to the server as backward computes them).
        self._held: Optional["SparseStep"] = None

    def __deepcopy__(self, memo):
        # (A deepcopy that shares the module finds it in memo and never gets here.)
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def attach(self, batch, worker: int = 0) -> None:
        """Serves lookups from `batch` (a WorkingBatch: any kind of batch) for
        device `worker`; None detaches (lookups then go to the server)."""
        self.batch, self.worker = working_batch(batch), worker

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        keys = _keys_of(input)
        if per_sample_weights is not None:
            # Kept in the graph: a weight that requires grad gets one, as nn.EmbeddingBag's does.
            per_sample_weights = per_sample_weights.to("cpu", torch.float32)
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None for a 2-D input (one bag per row)")
            bags, length = keys.shape
            bag = np.repeat(np.arange(bags, dtype=np.int64), length)
            keys = keys.reshape(-1)
            keep = None
            if self.padding_key is not None:
                keep = keys != np.uint64(self.padding_key & 0xFFFFFFFFFFFFFFFF)
                keys, bag = keys[keep], bag[keep]
            if per_sample_weights is not None:
                if per_sample_weights.shape != input.shape:
                    raise ValueError(f"per_sample_weights must have the input's shape {tuple(input.shape)}, "
                                     f"got {tuple(per_sample_weights.shape)}")
                per_sample_weights = per_sample_weights.reshape(-1)
                if keep is not None:
                    per_sample_weights = per_sample_weights[torch.from_numpy(keep)]
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError("a 1-D input needs offsets (the start of each bag)")
            if offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"offsets must be a 1-D int64 or int32 tensor, got {offsets.dim()}-D "
                                 f"{offsets.dtype}")
            starts = offsets.detach().cpu().numpy().astype(np.int64)
            if len(starts) and (starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] > len(keys)):
                raise ValueError("offsets must start at 0, not decrease, and not pass the end of input")
            if per_sample_weights is not None and per_sample_weights.shape != (len(keys),):
                raise ValueError(f"per_sample_weights must have one weight a key ({len(keys)}), "
                                 f"got shape {tuple(per_sample_weights.shape)}")
            bags = len(starts)
            if not bags:  # no bag: every key is outside one (nn.EmbeddingBag's (0, dim) output)
                keys = keys[:0]
                if per_sample_weights is not None:
                    per_sample_weights = per_sample_weights[:0]
            bag = np.repeat(np.arange(bags, dtype=np.int64), np.diff(np.append(starts, len(keys))))
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()} dimensions")
        counts = np.bincount(bag, minlength=bags).astype(np.int64)
        return _PooledLookup.apply(_anchored(self.anchor), self, keys, bag, per_sample_weights, counts, input.device)


class CtrModel(nn.Module):
    """Per-field pooled embeddings + dense features -> MLP -> logit (apply a
    sigmoid, or BCEWithLogitsLoss, for the click probability)."""

    def __init__(self, ps: ParameterServer, num_fields: int = 26, num_dense: int = 13,
                 hidden: Sequence[int] = (512, 256), seed: int = 0, num_bags: int = 0, pooling: str = "sum"):
        super().__init__()
        self.embedding = EmbeddingBag(ps, mode="sum")
        self.num_fields = num_fields
        self.num_dense = num_dense
        # Multi-hot fields, pooled by `pooling`; the MLP input is [single-hot | multi-hot | dense].
        self.num_bags = num_bags
        self.bag_embedding = EmbeddingBag(ps, mode=pooling) if num_bags else None
        self.mlp = mlp((num_fields + num_bags) * ps.dim + num_dense, hidden, seed, narrow_kernels=True)

    def forward(self, keys: torch.Tensor, dense: torch.Tensor, bags: Optional[Sequence] = None) -> torch.Tensor:
        """keys: (B, num_fields) int64, one key per field; dense: (B, num_dense); bags: one
        (input, offsets, per_sample_weights or None) per multi-hot field, as nn.EmbeddingBag takes them.
        The logits come out on the MLP's device, wherever keys and dense are."""
        if keys.dim() != 2 or keys.shape[1] != self.num_fields:
            raise ValueError(f"keys must have shape (B, {self.num_fields}), got {tuple(keys.shape)}")
        if keys.dtype != torch.int64:  # (named here: the lookups would name EmbeddingBag's input)
            raise TypeError(f"keys must be an int64 tensor of keys (uint64 keys bit-cast), got {keys.dtype}")
        if dense.dim() != 2 or dense.shape != (keys.shape[0], self.num_dense):
            raise ValueError(f"dense must have shape ({keys.shape[0]}, {self.num_dense}) (keys' B, num_dense), "
                             f"got {tuple(dense.shape)}")
        emb = self.embedding
        device = self.device
        if self.num_bags or bags:
            if len(bags or ()) != self.num_bags:
                raise ValueError(f"bags: expected {self.num_bags} multi-hot fields, got {len(bags or ())}")
            # The multi-hot lookups go where the single-hot ones go (attach() and a
            # distributed server are set on self.embedding).
            be = self.bag_embedding
            be.ps, be.batch, be.worker, be.frozen_key = emb.ps, emb.batch, emb.worker, emb.frozen_key
            be._held = emb._held
            pooled = [self._fields(keys)] if self.num_fields else []
            pooled += [be(k, o, per_sample_weights=w) for k, o, w in bags]
            pooled = [p.to(device) for p in pooled]
            first = self._first_layer(device)
            if first is not None:
                return self._after_first_layer(
                    _FirstLayerOnPooled.apply(dense, first.weight, first.bias, *pooled))
            return self.mlp(torch.cat(pooled + [dense.to(device, torch.float32)], dim=1)).squeeze(1)
        if emb.batch is not None and emb.padding_key is None and not dense.requires_grad:
            first = self._first_layer(device)
            if first is not None:
                return self._after_first_layer(
                    _FirstLayer.apply(_anchored(emb.anchor), emb, emb.batch, emb.worker, emb.dim, _keys_of(keys),
                                      dense.cpu(), emb.frozen_key, isinstance(first, NarrowLinear)
                                      and first.runs_kernels(), first.weight, first.bias))
            x = _InputWithFields.apply(_anchored(emb.anchor), emb, emb.batch, emb.worker, emb.dim,
                                       _keys_of(keys), dense.cpu(), emb.frozen_key, device)
            return self.mlp(x).squeeze(1)
        pooled = self._fields(keys).to(device)
        return self.mlp(torch.cat([pooled, dense.to(device, torch.float32)], dim=1)).squeeze(1)

    def _fields(self, keys: torch.Tensor) -> torch.Tensor:
        """The single-hot fields' rows, (B, num_fields * dim), pooled a field at a time.
        (The width spelled out: for B = 0, torch refuses -1 as ambiguous.)"""
        return self.embedding(keys.reshape(-1, 1)).reshape(keys.shape[0], self.num_fields * self.embedding.dim)

    def _first_layer(self, device: torch.device) -> Optional[nn.Linear]:
        """The MLP's first layer where _FirstLayer (with multi-hot fields,
        _FirstLayerOnPooled) computes it (_first_linear); else None."""
        return _first_linear(self.mlp, device)

    def _after_first_layer(self, h: torch.Tensor) -> torch.Tensor:
        """The logits from the first layer's output h: the MLP's layers after the first."""
        layers = iter(self.mlp)
        next(layers)
        for layer in layers:
            h = layer(h)
        return h.squeeze(1)

    @property
    def device(self) -> torch.device:
        """Where the MLP's parameters are (the CPU for an MLP without any)."""
        p = next(self.mlp.parameters(), None)
        return p.device if p is not None else torch.device("cpu")


class SparseStep:
    """The rows' step of a model's hps.torch modules, taken where a torch
    optimizer's step is: at ``step()``, for ``torch.amp.GradScaler``.

    Without one, backward is the rows' step (at the pass's end, or at the end of
    the attached batch), before a scaler has looked at any gradient: the rows took
    the scaled gradients, and the steps the scaler skips. Made over a model (or
    modules), its hps.torch modules hold their gradients, as backward computes
    them, until ``step()``; ``scaler.step(rows)`` hands it the scale and whether
    any gradient, the rows' included, is inf or NaN, as to torch's fused
    optimizers. The gradients are divided by the scale, as the scaler divides the
    dense ones, and sent on: summed per key into one push a server, or into the
    batch each lookup read (the batch steps them when it ends, so step() before
    its with block ends). Where the scaler skips the step they are dropped, and
    ``scaler.update()`` lowers the scale for the rows' inf or NaN as for the
    dense ones'::

        rows = hps.torch.SparseStep(model)
        scaler.scale(loss).backward()   # the rows' gradients held, scaled
        scaler.step(opt)
        scaler.step(rows)               # unscaled and sent, or dropped with a skipped step
        scaler.update()

    ``step()`` without a scaler sends them as they are; ``zero_grad()`` drops
    them. The gradients held for a server since the last step go to it as one
    push: one step a key on their sum, as torch's optimizers step a weight on the
    gradients accumulated since their last step (without a SparseStep each
    backward pass steps the rows). ``release()`` gives the modules back their
    own steps."""

    # GradScaler.step(rows) calls step() whatever it found, with grad_scale (None
    # where scaler.unscale_(rows) unscaled the gradients already) and found_inf set.
    _step_supports_amp_scaling = True

    def __init__(self, model):
        modules = [model] if isinstance(model, nn.Module) else list(model)
        bags = []
        for m in modules:
            for sub in m.modules():
                if isinstance(sub, EmbeddingBag) and all(sub is not b for b in bags):
                    bags.append(sub)
        if not bags:
            raise ValueError("SparseStep: the modules given hold no hps.torch.EmbeddingBag")
        for b in bags:
            if b._held is not None and b._held is not self and b._held._pieces:
                raise ValueError(f"SparseStep: {_named(b)} is another SparseStep's, which holds gradients not yet "
                                 f"stepped: call its step() or zero_grad() first")
        for b in bags:
            b._held = self
        self.modules = bags
        self._lock = threading.Lock()  # (lookups on several devices hold from several threads)
        self._pieces: list = []  # (module, batch or None, positions or keys, worker, tensor)
        # The gradients held, each a placeholder parameter's .grad: what GradScaler reads
        # and unscales (unscale_), as an optimizer's.
        self.param_groups = [{"params": []}]

    def _hold(self, module, batch, where, grads, worker: int, tensor: bool) -> None:
        """A lookup's gradients: into `batch` at positions `where`, or (batch None)
        to the module's server for keys `where`. A copy: the scaler unscales it in
        place, and a lookup's gradient may be autograd's own tensor."""
        if isinstance(grads, np.ndarray):
            g = torch.from_numpy(np.array(grads, dtype=np.float32, order="C"))
        else:
            g = grads.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
        p = torch.zeros((), device=g.device).expand(g.shape)  # (no memory of its own)
        p.grad = g
        with self._lock:
            self._pieces.append((module, batch, where, worker, tensor))
            self.param_groups[0]["params"].append(p)

    def _take(self) -> list:
        with self._lock:
            pieces, params = self._pieces, self.param_groups[0]["params"]
            self._pieces, self.param_groups[0]["params"] = [], []
        return [piece + (p.grad,) for piece, p in zip(pieces, params)]

    def step(self, closure=None):
        """Sends the gradients held, divided by the scaler's scale (GradScaler.step),
        or drops them where the scaler found inf or NaN. A push that would wait for
        a batch that waits for this thread is refused first (RuntimeError), and
        nothing is sent."""
        try:
            return self._step(closure)
        except BaseException:
            # GradScaler takes grad_scale and found_inf away after a step that returns;
            # left after one that raised, the next step would read them (a scale
            # squared, a skip that is not this step's).
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        pieces = self._take()
        if found_inf is not None and float(found_inf):
            return loss  # the step the scaler skips
        inverse = None if scale is None else scale.double().reciprocal().float()  # (as GradScaler.unscale_)
        into, direct = [], {}
        for module, batch, where, worker, tensor, g in pieces:
            if inverse is not None:
                g = g * inverse.to(g.device)
            if batch is not None:
                into.append((batch, where, g, worker, tensor))
            else:
                direct.setdefault(module.ps, []).append((module, where, g))
        batched = {id(module.ps) for module, batch, *_ in pieces if batch is not None}
        for ps, parts in direct.items():
            _refuse_direct_push(parts[0][0])
            if id(ps) in batched:  # (a server that does not say which batches are open)
                raise RuntimeError(
                    f"hps.torch: SparseStep holds gradients into a batch of {ps!r} and, from {_named(parts[0][0])}, "
                    f"which has no batch attached, to the server directly, whose push would wait for that batch, "
                    f"which waits for this step; nothing was sent. Attach every hps.torch module on the server to "
                    f"the batch (module.attach(batch, worker)) or none")
        for batch, where, g, worker, tensor in into:
            if tensor:
                batch.accumulate_tensor(where, g, worker=worker)
            else:
                batch.accumulate(where, g.numpy(), worker=worker)
        for ps, parts in direct.items():
            if len(parts) == 1:
                keys, grads = parts[0][1], parts[0][2].numpy()
            else:
                keys, inverse_keys = _core.unique_keys(np.concatenate([k for _, k, _ in parts]))
                grads = _core.sum_by_inverse(inverse_keys, np.concatenate([g.numpy() for _, _, g in parts]), len(keys))
            ps.push(keys, np.ascontiguousarray(grads))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients held."""
        self._take()

    def release(self) -> None:
        """The modules' gradients go to their servers as backward computes them again
        (ValueError while gradients are held: step() or zero_grad() first)."""
        if self._pieces:
            raise ValueError("SparseStep.release: gradients are held, not yet stepped: call step() or zero_grad() "
                             "first")
        for b in self.modules:
            if b._held is self:
                b._held = None

    def __repr__(self) -> str:
        return f"SparseStep({len(self.modules)} hps.torch module(s), {len(self._pieces)} gradient(s) held)"


class WorkerShares:
    """A working batch as one model call over several workers' mini-batches,
    for workers that share one dense replica on one device: the model runs
    once over their examples one worker after another (each share's rows
    consecutive, in worker order), and every lookup and gradient is still
    split by example, each share going to its worker's gather and accumulate
    (so the tier moves and counts each worker's rows as it would for a call of
    its own). `examples` gives each worker's number of examples, in order.

    A lookup's keys and its out or gradients must have a multiple of the
    examples' count as their first dimension (CtrModel's fields, one row an
    example or one a key); positions are each share's, as its batch gave them.
    apply, write_back, finish and abort are the batch's own."""

    def __init__(self, batch: WorkingBatch, workers: Sequence[int], examples: Sequence[int]):
        if len(workers) != len(examples):
            raise ValueError(f"WorkerShares: {len(workers)} worker(s) and {len(examples)} example count(s)")
        self._batch = working_batch(batch)
        self._workers = [int(w) for w in workers]
        self._bounds = np.concatenate([[0], np.cumsum(np.asarray(examples, dtype=np.int64))])
        self.keys = self._batch.keys
        self.wait_seconds = getattr(self._batch, "wait_seconds", 0.0)
        self.gathers_into_columns = self._batch.gathers_into_columns

    def _spans(self, rows: int):
        """(worker, start, stop) of each share among `rows` rows, a multiple of the examples."""
        examples = int(self._bounds[-1])
        if examples == 0 or rows % examples:
            raise ValueError(f"WorkerShares: {rows} rows are not a whole number of rows an example "
                             f"({examples} examples)")
        k = rows // examples
        return [(w, int(a) * k, int(b) * k) for w, a, b in zip(self._workers, self._bounds[:-1], self._bounds[1:])]

    def positions(self, keys: np.ndarray) -> list:
        keys = np.asarray(keys)
        return [self._batch.positions(keys[a:b]) for _, a, b in self._spans(keys.shape[0])]

    def _split(self, positions: list, array_rows: int):
        """Each share's (worker, its positions, its rows of an array of array_rows rows)."""
        counts = [len(p) for p in positions]
        total = sum(counts)
        if array_rows == total:
            ends = np.cumsum([0] + counts)
            return [(w, p, slice(int(a), int(b))) for (w, _, _), p, a, b
                    in zip(self._spans(total), positions, ends[:-1], ends[1:])]
        return [(w, p, slice(a, b)) for (w, a, b), p in zip(self._spans(array_rows), positions)]

    def gather(self, positions: list, out: Optional[np.ndarray] = None, worker: int = 0) -> np.ndarray:
        if out is None:
            return np.concatenate([self._batch.gather(p, worker=w) for w, p in zip(self._workers, positions)])
        for w, p, rows in self._split(positions, out.shape[0]):
            self._batch.gather(p, out[rows], worker=w)
        return out

    def accumulate(self, positions: list, grads: np.ndarray, worker: int = 0) -> None:
        for w, p, rows in self._split(positions, grads.shape[0]):
            self._batch.accumulate(p, grads[rows], worker=w)

    def gather_tensor(self, positions: list, out, worker: int = 0):
        for w, p, rows in self._split(positions, out.shape[0]):
            self._batch.gather_tensor(p, out[rows], worker=w)
        return out

    def accumulate_tensor(self, positions: list, grads, worker: int = 0) -> None:
        for w, p, rows in self._split(positions, grads.shape[0]):
            self._batch.accumulate_tensor(p, grads[rows], worker=w)

    def pull(self, keys: np.ndarray, worker: int = 0) -> np.ndarray:
        return self.gather(self.positions(keys))

    def push(self, keys: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        self.accumulate(self.positions(keys), grads)

    def apply(self) -> None:
        self._batch.apply()

    def write_back(self) -> None:
        self._batch.write_back()

    def finish(self) -> None:
        self._batch.finish()

    def abort(self) -> None:
        self._batch.abort()


class DeviceReplicas:
    """A dense model replicated over a node's worker devices, the data-parallel
    half of the MLSys 2020 paper's node: worker g runs its mini-batch through
    ``replica(g)`` on ``devices[g]``; then ``reduce_gradients()`` adds every
    replica's gradients into replica 0's (in worker order, so the sum is the
    one a single model accumulating the mini-batches one after another gets),
    the one optimizer steps replica 0's parameters, and ``broadcast()`` copies
    them to the other replicas.

    Replica 0 is `model` itself, moved to ``devices[0]``. The others are copies
    that share the submodules named in `shared` (the embedding bags, which hold
    no weights: their rows live in the parameter server). Workers on one device
    share a replica unless ``per_worker`` (what GPUs need, one a device; on the
    CPU it runs the same code as a GPU node, for tests)."""

    def __init__(self, model: nn.Module, devices: Sequence, shared: Sequence[nn.Module] = (),
                 per_worker: bool = False):
        if not devices:
            raise ValueError("DeviceReplicas: give at least one device")
        self.devices = [torch.device(d) for d in devices]
        model.to(self.devices[0])
        self.replicas: list[nn.Module] = [model]
        self._of_worker = [0]
        on_device = {self.devices[0]: 0}  # the replica of each device (workers there share it)
        for device in self.devices[1:]:
            if per_worker or device not in on_device:
                self.replicas.append(copy.deepcopy(model, {id(m): m for m in shared}).to(device))
                on_device.setdefault(device, len(self.replicas) - 1)
            self._of_worker.append(len(self.replicas) - 1 if per_worker else on_device[device])

    def replica(self, worker: int) -> nn.Module:
        return self.replicas[self._of_worker[worker]]

    def __len__(self) -> int:
        return len(self.replicas)

    def _pairs(self, r: int):
        return zip(self.replicas[0].parameters(), self.replicas[r].parameters())

    def reduce_gradients(self) -> None:
        """Every other replica's gradients added into replica 0's, and dropped there."""
        for r in range(1, len(self.replicas)):
            for p0, p in self._pairs(r):
                if p.grad is None:
                    continue
                g = p.grad.to(p0.device, non_blocking=True)
                if p0.grad is None:
                    p0.grad = g.clone() if g is p.grad else g
                else:
                    p0.grad.add_(g)
                p.grad = None

    @torch.no_grad()
    def broadcast(self) -> None:
        """Replica 0's parameters (as its optimizer left them) into every other replica."""
        for r in range(1, len(self.replicas)):
            for p0, p in self._pairs(r):
                p.copy_(p0, non_blocking=True)
