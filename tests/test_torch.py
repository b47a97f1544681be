"""hps.torch: EmbeddingBag over a ParameterServer against torch.nn.EmbeddingBag."""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="hps.torch needs torch (pip install torch)")
import hps  # noqa: E402
import hps.torch as ht  # noqa: E402

DIM = 8


def make_ps(tmp_path, lr=0.5, **kw):
    return hps.ParameterServer(hps.ParameterServerConfig(
        dim=DIM, path=str(tmp_path / "ps"), optimizer=hps.SGD(lr=lr), mem_budget="4MiB", **kw))


def torch_twin(ps, vocab):
    """nn.EmbeddingBag holding the parameter server's initial rows of keys 0..vocab-1."""
    ref = torch.nn.EmbeddingBag(vocab, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(ps.pull(np.arange(vocab, dtype=np.uint64))))
    return ref


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_offsets_bags_train_like_torch(tmp_path, mode):
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps, mode=mode)
    ref = torch_twin(ps, 50)
    ref.mode = mode
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    for step in range(5):
        keys = torch.from_numpy(rng.integers(0, 50, 30))
        offsets = torch.tensor([0, 4, 4, 11, 20])  # an empty bag too
        target = torch.from_numpy(rng.standard_normal((5, DIM)).astype(np.float32))
        out = bag(keys, offsets)
        want = ref(keys, offsets)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # summation order differs
        ((out - target) ** 2).sum().backward()
        opt.zero_grad()
        ((want - target) ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(torch.from_numpy(ps.pull(np.arange(50, dtype=np.uint64))), ref.weight.detach(),
                               rtol=1e-5, atol=1e-6)


def test_padded_input_and_weights(tmp_path):
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps, padding_key=-1)
    keys = torch.tensor([[1, 2, -1], [3, -1, -1]])
    w = torch.tensor([[2.0, 1.0, 9.0], [0.5, 9.0, 9.0]])
    rows = torch.from_numpy(ps.pull(np.array([1, 2, 3], np.uint64)))
    out = bag(keys, per_sample_weights=w)
    torch.testing.assert_close(out, torch.stack([2 * rows[0] + rows[1], 0.5 * rows[2]]))
    with pytest.raises(ValueError, match="a 1-D input needs offsets"):
        bag(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="input must be an int64 tensor"):
        bag(torch.tensor([[1.0]]))


def test_per_sample_weights_get_their_gradient_as_in_torch(tmp_path):
    """Weights that require grad get d out / d w (row . the bag's output gradient), as
    nn.EmbeddingBag's do, for offsets and for a padded 2-D input; the rows train as
    before."""
    ps = make_ps(tmp_path)
    ref = torch_twin(ps, 20)
    bag = ht.EmbeddingBag(ps)
    keys = torch.tensor([3, 7, 3, 11, 2, 9])
    offsets = torch.tensor([0, 2, 2, 5])
    w = torch.tensor([0.5, 2.0, -1.0, 1.5, 3.0, 0.25], requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    target = torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM) / 10
    ((bag(keys, offsets, per_sample_weights=w) - target) ** 2).sum().backward()
    ((ref(keys, offsets, per_sample_weights=w_ref) - target) ** 2).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(ps.pull(np.array([3, 7, 11, 2, 9], np.uint64))),
                               ref.weight.detach()[[3, 7, 11, 2, 9]] - 0.5 * ref.weight.grad.to_dense()[[3, 7, 11, 2, 9]],
                               rtol=1e-5, atol=1e-5)

    # 2-D, padded: the padding's weights get none (they weigh nothing); mean divides by the keys kept.
    padded = ht.EmbeddingBag(ps, mode="mean", padding_key=-1)
    rows = torch.from_numpy(ps.pull(np.array([4, 5, 6], np.uint64)))
    w2 = torch.tensor([[2.0, 9.0, 1.0], [9.0, 9.0, 0.5]], requires_grad=True)
    padded(torch.tensor([[4, -1, 5], [-1, -1, 6]]), per_sample_weights=w2).sum().backward()
    want = torch.tensor([[rows[0].sum() / 2, 0.0, rows[1].sum() / 2], [0.0, 0.0, rows[2].sum()]])
    torch.testing.assert_close(w2.grad, want, rtol=1e-5, atol=1e-5)


def test_a_frozen_key_leaves_the_gradient_other_branches_share_alone(tmp_path):
    """Autograd hands an addition's gradient to both its inputs, the same tensor: a
    lookup of one key a bag zeroed the frozen key's rows of it in place, and z,
    added to the lookup, got a zero gradient there. The frozen row still stays."""
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps)
    bag.frozen_key = 7
    before = ps.pull(np.array([7, 3], np.uint64))
    z = torch.zeros(2, DIM, requires_grad=True)
    zz = z * 2.0  # made before the lookup: autograd runs its backward after the lookup's
    out = bag(torch.tensor([[7], [3]]))
    ((out + zz) * torch.full((2, DIM), 3.0)).sum().backward()
    torch.testing.assert_close(z.grad, torch.full((2, DIM), 6.0))
    after = ps.pull(np.array([7, 3], np.uint64))
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(after[1], before[1] - 0.5 * 3.0, rtol=1e-6)


def test_embedding_bag_refuses_what_nn_embedding_bag_refuses(tmp_path):
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps)
    before = ps.pull(np.arange(4, dtype=np.uint64))
    # No bag at all: a (0, dim) output, as nn.EmbeddingBag's; no key is in a bag, none trains.
    out = bag(torch.arange(4), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, DIM)
    (out.sum() + 1).backward()
    np.testing.assert_array_equal(ps.pull(np.arange(4, dtype=np.uint64)), before)
    with pytest.raises(ValueError, match="offsets must be a 1-D int64 or int32 tensor, got 1-D torch.float32"):
        bag(torch.arange(4), torch.tensor([0.0, 2.5]))
    with pytest.raises(ValueError, match="offsets must be a 1-D int64 or int32 tensor, got 2-D"):
        bag(torch.arange(4), torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"per_sample_weights must have the input's shape \(2, 2\), got \(4,\)"):
        bag(torch.arange(4).reshape(2, 2), per_sample_weights=torch.ones(4))
    # Masked to 64 bits, 2**70 would be key 0, and key 0's rows would be dropped as padding.
    with pytest.raises(ValueError, match="padding_key must be a 64-bit key"):
        ht.EmbeddingBag(ps, padding_key=2 ** 70)
    model = ht.CtrModel(ps, num_fields=2, num_dense=3, hidden=(4,))
    with pytest.raises(ValueError, match=r"dense must have shape \(2, 3\) \(keys' B, num_dense\), got \(2, 5\)"):
        model(torch.arange(4).reshape(2, 2), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"dense must have shape \(2, 3\).*got \(3, 3\)"):
        model(torch.arange(4).reshape(2, 2), torch.ones(3, 3))


def test_ctr_model_trains_inside_a_batch(tmp_path):
    ps = make_ps(tmp_path, lr=0.1, devices=2)
    model = ht.CtrModel(ps, num_fields=3, num_dense=2, hidden=(8,), seed=1)
    opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    rng = np.random.default_rng(1)
    keys = torch.from_numpy(rng.integers(0, 20, (16, 3)))
    dense = torch.from_numpy(rng.standard_normal((16, 2)).astype(np.float32))
    labels = torch.from_numpy((rng.random(16) < 0.5).astype(np.float32))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    before = ps.pull(np.arange(20, dtype=np.uint64))
    losses = []
    for _ in range(30):
        with ps.batch(keys.numpy()) as b:
            model.embedding.attach(b, worker=0)
            loss = loss_fn(model(keys, dense), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.embedding.attach(None)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert not np.array_equal(ps.pull(np.arange(20, dtype=np.uint64)), before)
    with pytest.raises(ValueError, match=r"keys must have shape \(B, 3\)"):
        model(keys[:, :2], dense)


def test_ctr_model_on_host_batches_trains_exactly_like_on_the_device_tier(tmp_path):
    """On a host batch, CtrModel gathers the fields' rows straight into the MLP's
    input and takes their gradient from it; through a device tier it pools and
    concatenates. Same losses, rows and MLP after every step, bit for bit."""
    runs = {}
    for in_place in (True, False):
        ps = make_ps(tmp_path / str(in_place), lr=0.2, host_in_place=in_place)
        model = ht.CtrModel(ps, num_fields=3, num_dense=2, hidden=(8,), seed=1)
        opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        losses, rows = [], []
        for step in range(5):
            rng = np.random.default_rng(step)
            keys = rng.integers(0, 30, (16, 3)).astype(np.uint64)
            dense = torch.from_numpy(rng.standard_normal((16, 2)).astype(np.float32))
            labels = torch.from_numpy((rng.random(16) < 0.5).astype(np.float32))
            with ps.batch(keys) as b:
                model.embedding.attach(b)
                loss = loss_fn(model(torch.from_numpy(keys.view(np.int64)), dense), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.embedding.attach(None)
            losses.append(loss.item())
            rows.append(ps.pull(np.arange(30, dtype=np.uint64)))
        runs[in_place] = (losses, rows, [p.detach().clone() for p in model.mlp.parameters()])
    assert runs[True][0] == runs[False][0]
    for step, (a, b) in enumerate(zip(runs[True][1], runs[False][1])):
        np.testing.assert_array_equal(a, b, err_msg=f"after step {step}")
    for a, b in zip(runs[True][2], runs[False][2]):
        assert torch.equal(a, b)
    assert not np.array_equal(runs[True][1][0], runs[True][1][-1])


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_host_batches_train_exactly_like_the_device_tier(tmp_path, mode):
    """hps.torch on a host batch gathers rows by the prefetch's positions and adds
    gradients per example; through a device tier it pulls distinct keys and pushes
    their sums. Same parameters after every batch, bit for bit."""
    runs = {}
    for in_place in (True, False):
        ps = make_ps(tmp_path / str(in_place), lr=0.3, host_in_place=in_place)
        bag = ht.EmbeddingBag(ps, mode=mode)
        kinds, rows = set(), []
        for step in range(6):
            keys = np.random.default_rng(step).integers(0, 40, (32, 3)).astype(np.uint64)
            weights = torch.from_numpy(np.random.default_rng(step).random((32, 3)).astype(np.float32))
            with ps.batch(keys) as b:
                kinds.add(type(b).__name__)
                bag.attach(b)
                out = bag(torch.from_numpy(keys.view(np.int64)), per_sample_weights=weights)
                (out * torch.arange(1, DIM + 1, dtype=torch.float32)).sum().backward()
                bag.attach(None)
            rows.append(ps.pull(np.arange(40, dtype=np.uint64)))
        runs[in_place] = (kinds, rows)
    assert runs[True][0] == {"HostBatch"} and runs[False][0] == {"Batch"}
    for step, (a, b) in enumerate(zip(runs[True][1], runs[False][1])):
        np.testing.assert_array_equal(a, b, err_msg=f"after batch {step}")
    assert not np.array_equal(runs[True][1][0], runs[True][1][-1])


def graph_nodes(tensor, as_nodes: bool = False):
    """The names of the autograd nodes behind `tensor` (a set); as_nodes: the nodes themselves (a list)."""
    nodes, seen, todo = [], set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return nodes if as_nodes else {node.name() for node in nodes}


@pytest.mark.parametrize("hidden, host_in_place", [((16,), True), ((24, 8), True), ((16,), False)])
def test_ctr_model_trains_like_plain_torch(tmp_path, hidden, host_in_place):
    """CtrModel on a batch against plain torch (nn.Embedding, the same MLP, torch
    autograd throughout). On the CPU CtrModel runs the first layer itself
    (_FirstLayer: the input's gradient for the embedding columns only); the rows
    and the MLP follow torch's to float tolerance, on a host batch and through the
    device tier, and a frozen key's row does not move."""
    vocab, fields, n_dense, frozen = 40, 3, 2, 7
    ps = make_ps(tmp_path, lr=0.3, host_in_place=host_in_place)
    model = ht.CtrModel(ps, num_fields=fields, num_dense=n_dense, hidden=hidden, seed=3)
    model.embedding.frozen_key = frozen
    before = ps.pull(np.arange(vocab, dtype=np.uint64))
    emb_ref = torch.nn.Embedding(vocab, DIM)
    with torch.no_grad():
        emb_ref.weight.copy_(torch.from_numpy(before))
    mlp_ref = ht.mlp(fields * DIM + n_dense, hidden, seed=3)
    opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    opt_ref = torch.optim.Adam(mlp_ref.parameters(), lr=0.01)
    sgd_ref = torch.optim.SGD(emb_ref.parameters(), lr=0.3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(4):
        rng = np.random.default_rng(step)
        keys = rng.integers(0, vocab, (64, fields))
        keys[0, 1] = frozen
        dense = torch.from_numpy(rng.standard_normal((64, n_dense)).astype(np.float32))
        labels = torch.from_numpy((rng.random(64) < 0.5).astype(np.float32))
        with ps.batch(keys.astype(np.uint64)) as b:
            model.embedding.attach(b)
            logits = model(torch.from_numpy(keys), dense)
            assert "_FirstLayerBackward" in graph_nodes(logits)
            loss = loss_fn(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.embedding.attach(None)
        x = torch.cat([emb_ref(torch.from_numpy(keys)).reshape(64, -1), dense], 1)
        loss_ref = loss_fn(mlp_ref(x).squeeze(1), labels)
        opt_ref.zero_grad()
        sgd_ref.zero_grad()
        loss_ref.backward()
        emb_ref.weight.grad[frozen] = 0.0
        opt_ref.step()
        sgd_ref.step()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    rows = ps.pull(np.arange(vocab, dtype=np.uint64))
    torch.testing.assert_close(torch.from_numpy(rows), emb_ref.weight.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(model.mlp.parameters(), mlp_ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rows[frozen], before[frozen])
    assert (rows != before).any(axis=1).sum() == vocab - 1  # every other key was drawn and trained


def test_a_wide_first_layer_pads_its_input_rows_and_keeps_the_weight_gradient_to_its_columns(tmp_path):
    """Above 16 units _FirstLayer gathers its input into rows a multiple of 16 floats
    apart (26 columns here: 32), zeros after the columns, and _weight_grad multiplies
    over the whole rows and hands back the weight's columns only; at 16 units (hps's
    own kernels) the rows are as long as the input."""
    fields, n_dense = 3, 2
    for hidden, stride in (((24, 8), 32), ((16,), fields * DIM + n_dense)):
        ps = make_ps(tmp_path / str(hidden[0]))
        model = ht.CtrModel(ps, num_fields=fields, num_dense=n_dense, hidden=hidden, seed=3)
        keys = np.arange(10 * fields, dtype=np.uint64).reshape(10, fields)
        with ps.batch(keys) as b:
            model.embedding.attach(b)
            logits = model(torch.from_numpy(keys.astype(np.int64)), torch.ones(10, n_dense))
            (node,) = [n for n in graph_nodes(logits, as_nodes=True) if n.name() == "_FirstLayerBackward"]
            x = node.saved_tensors[0]
            assert x.shape == (10, fields * DIM + n_dense) and x.stride() == (stride, 1)
            if stride > x.shape[1]:
                whole = x.as_strided((10, stride), (stride, 1))
                assert (whole[:, x.shape[1]:] == 0).all()
            model.embedding.attach(None)
    # The padding never reaches the gradient, whatever it holds.
    rows = torch.randn(7, 48)
    x, grad = rows[:, :29], torch.randn(7, 5)
    got = ht._weight_grad(grad, x)
    assert got.shape == (5, 29) and got.is_contiguous()
    torch.testing.assert_close(got, grad.t().mm(x.contiguous()))
    torch.testing.assert_close(ht._weight_grad(grad, x.contiguous()), grad.t().mm(x.contiguous()))
    every_other = torch.randn(13, 40)[::2, :29]  # rows 80 floats apart; the last one's end is the storage's
    torch.testing.assert_close(ht._weight_grad(grad, every_other), grad.t().mm(every_other.contiguous()))


def test_ctr_model_leaves_a_frozen_first_layer_alone(tmp_path):
    """A first layer whose parameters do not require gradients (frozen by the user)
    gets none, while the embeddings and the layers after it still train."""
    ps = make_ps(tmp_path, lr=0.3)
    model = ht.CtrModel(ps, num_fields=2, num_dense=1, hidden=(8,), seed=0)
    model.mlp[0].requires_grad_(False)
    keys = np.arange(12, dtype=np.uint64).reshape(6, 2)
    before = ps.pull(keys.reshape(-1))
    with ps.batch(keys) as b:
        model.embedding.attach(b)
        model(torch.from_numpy(keys.view(np.int64)), torch.ones(6, 1)).sum().backward()
        model.embedding.attach(None)
    assert model.mlp[0].weight.grad is None and model.mlp[0].bias.grad is None
    assert model.mlp[2].weight.grad is not None and model.mlp[2].weight.grad.abs().sum() > 0
    assert (ps.pull(keys.reshape(-1)) != before).any(axis=1).all()


class _PlusTensor(torch.nn.Module):
    """x + other: a model that passes its input on unchanged, as autograd sees it (an
    addition hands both inputs the one gradient tensor it got)."""

    def __init__(self, other):
        super().__init__()
        self.other = other

    def forward(self, x):
        return x + self.other


@pytest.mark.parametrize("into_columns, n_dense", [(True, 2), (False, 0)])
def test_ctr_model_leaves_the_input_gradient_another_branch_shares_alone(tmp_path, into_columns, n_dense):
    """A first layer that is not a Linear: the batch's input x goes through
    _InputWithFields, whose backward zeroed the frozen key's columns in place, in
    the gradient autograd handed it; z, added to x, got a zero gradient there too (on a
    batch gathering into columns, and on one made to gather into a tensor of its own,
    as a GPU's does, the embedding columns the whole input). The frozen row still stays."""
    fields, frozen, examples = 2, 7, 4
    cols = fields * DIM + n_dense
    ps = make_ps(tmp_path, lr=0.3)
    model = ht.CtrModel(ps, num_fields=fields, num_dense=n_dense, hidden=(8,), seed=0)
    model.embedding.frozen_key = frozen
    z = torch.zeros(examples, cols, requires_grad=True)
    zz = z * 2.0  # made before the model's input: autograd runs its backward after _InputWithFields's
    linear = torch.nn.Linear(cols, 1)
    model.mlp = torch.nn.Sequential(_PlusTensor(zz), linear)
    keys = np.array([[frozen, 1], [2, 3], [4, frozen], [5, 6]], np.uint64)
    before = ps.pull(keys.reshape(-1))
    with ps.batch(keys) as b:
        b.gathers_into_columns = into_columns
        model.embedding.attach(b)
        logits = model(torch.from_numpy(keys.view(np.int64)), torch.ones(examples, n_dense))
        assert "_InputWithFieldsBackward" in graph_nodes(logits)
        (logits * 3.0).sum().backward()
        model.embedding.attach(None)
    torch.testing.assert_close(z.grad, 6.0 * linear.weight.detach().expand(examples, cols))
    after = ps.pull(keys.reshape(-1))
    frozen_at = keys.reshape(-1) == frozen
    np.testing.assert_array_equal(after[frozen_at], before[frozen_at])
    assert (after[~frozen_at] != before[~frozen_at]).any(axis=1).all()


def test_ctr_model_with_bags_trains_like_plain_torch(tmp_path):
    """With multi-hot fields CtrModel pools each field and puts the first layer's input
    together with torch.cat; on the CPU the first layer is _FirstLayerOnPooled, which
    hands each piece the gradient of its own columns. Rows, MLP and the dense features'
    gradient (asked for here) follow plain torch's to float tolerance."""
    vocab, fields = 30, 2
    ps = make_ps(tmp_path, lr=0.3)
    model = ht.CtrModel(ps, num_fields=fields, num_dense=3, hidden=(16, 4), seed=5, num_bags=1)
    before = ps.pull(np.arange(vocab, dtype=np.uint64))
    table = torch.nn.Parameter(torch.from_numpy(before.copy()))
    mlp_ref = ht.mlp((fields + 1) * DIM + 3, (16, 4), seed=5)
    opt = torch.optim.SGD(model.mlp.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD([table, *mlp_ref.parameters()], lr=0.1)
    for step in range(3):
        rng = np.random.default_rng(step)
        keys = torch.from_numpy(rng.integers(0, vocab, (8, fields)))
        bag_keys = torch.from_numpy(rng.integers(0, vocab, 20))
        offsets = torch.tensor([0, 2, 2, 5, 9, 12, 15, 18])
        dense = torch.from_numpy(rng.standard_normal((8, 3)).astype(np.float32)).requires_grad_(True)
        dense_ref = dense.detach().clone().requires_grad_(True)
        logits = model(keys, dense, [(bag_keys, offsets, None)])
        assert "_FirstLayerOnPooledBackward" in graph_nodes(logits)
        opt.zero_grad()
        (logits ** 2).sum().backward()
        opt.step()
        x = torch.cat([table[keys].reshape(8, -1),
                       torch.nn.functional.embedding_bag(bag_keys, table, offsets, mode="sum"), dense_ref], 1)
        opt_ref.zero_grad()
        (mlp_ref(x).squeeze(1) ** 2).sum().backward()
        with torch.no_grad():  # the rows step by the server's SGD (lr 0.3), the MLP by opt_ref
            table -= 0.3 * table.grad
        table.grad = None
        opt_ref.step()
        torch.testing.assert_close(dense.grad, dense_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(ps.pull(np.arange(vocab, dtype=np.uint64))), table.detach(),
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(model.mlp.parameters(), mlp_ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_narrow_linear_is_nn_linear_on_hps_kernels():
    """NarrowLinear (CtrModel's first layer) gives nn.Linear's outputs and gradients
    to float tolerance, with the same parameters and state_dict; wider layers and
    float64 inputs are nn.Linear's own. The peers' mlp() keeps torch's nn.Linear."""
    torch.manual_seed(0)
    for outputs in (1, 9, 16):
        narrow, plain = ht.NarrowLinear(429, outputs), torch.nn.Linear(429, outputs)
        plain.load_state_dict(narrow.state_dict())
        assert narrow.runs_kernels()
        x = torch.randn(300, 429)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = narrow(xa), plain(xb)
        assert ya.grad_fn.name() == "_NarrowLinearProductsBackward"
        torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(narrow.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(narrow.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)
    wide = ht.NarrowLinear(8, 17)
    assert not wide.runs_kernels() and wide(torch.randn(3, 8)).grad_fn.name() == "AddmmBackward0"
    narrow = ht.NarrowLinear(8, 4)
    assert not narrow.runs_kernels(torch.randn(3, 8, dtype=torch.float64))
    assert narrow.double()(torch.randn(3, 8, dtype=torch.float64)).dtype == torch.float64
    assert type(ht.mlp(10, (16,))[0]) is torch.nn.Linear
    assert type(ht.mlp(10, (16,), narrow_kernels=True)[0]) is ht.NarrowLinear
    assert type(ht.mlp(10, (16,), narrow_kernels=True)[2]) is torch.nn.Linear


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_lookups_of_one_backward_pass_step_each_key_once_on_its_summed_gradient(tmp_path, optimizer):
    """Without a batch, two modules on one server and one of them looking up twice,
    some keys in every lookup and twice in one: torch's sparse embedding sums a key's
    gradients of the pass and its optimizer steps once on the sum. Each lookup's
    backward pushed on its own, so a key in two lookups took two steps, which SGD
    cannot tell from one but AdaGrad and Adam can (state updated twice, Adam's t
    counted twice). The pass's gradients now go to the server summed per key, once,
    at its end. The reference is a dense table under torch.optim's AdaGrad and Adam:
    every key is in every step, so their steps are the rows' own."""
    vocab = 6
    opt = hps.AdaGrad(lr=0.1) if optimizer == "adagrad" else hps.Adam(lr=0.1)
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=DIM, path=str(tmp_path / "ps"), optimizer=opt,
                                                       mem_budget="4MiB"))
    user, item = ht.EmbeddingBag(ps), ht.EmbeddingBag(ps, mode="mean")
    ref = torch.nn.EmbeddingBag(vocab, DIM)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(ps.pull(np.arange(vocab, dtype=np.uint64))))
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1) if optimizer == "adagrad" else \
        torch.optim.Adam(ref.parameters(), lr=0.1)
    scale = torch.arange(1, DIM + 1, dtype=torch.float32)
    rng = np.random.default_rng(3)
    for step in range(4):
        first = torch.from_numpy(rng.permutation(vocab).reshape(2, 3))
        second = torch.from_numpy(rng.integers(0, vocab, (2, 2)))
        bags = torch.from_numpy(np.concatenate([rng.integers(0, vocab, 5), [1, 1]]))  # key 1 twice in a bag
        offsets = torch.tensor([0, 3])

        def loss(a, b):
            return (a(first) * scale).sum() + (a(second) ** 2).sum() + (b(bags, offsets) ** 3).sum()
        loss(user, item).backward()
        assert ps.step == step + 1
        ref_opt.zero_grad()
        ref.mode = "sum"
        plain_sum = (ref(first) * scale).sum() + (ref(second) ** 2).sum()
        ref.mode = "mean"
        (plain_sum + (ref(bags, offsets) ** 3).sum()).backward()
        ref_opt.step()
        torch.testing.assert_close(torch.from_numpy(ps.pull(np.arange(vocab, dtype=np.uint64))),
                                   ref.weight.detach(), rtol=1e-5, atol=1e-6)
    ps.close()


def test_an_error_of_the_push_at_a_passs_end_reaches_backwards_caller_and_a_failed_pass_pushes_nothing(tmp_path):
    """The pass's push runs after its last node (a callback of torch's engine): what it
    raises comes out of backward(). A pass that fails in another node before its end
    pushes nothing (no row moves, no step), and the passes after it push as before.
    (When each lookup pushed in its own backward, the failed pass had stepped the
    rows of the lookup whose backward ran before the failing node.)"""
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps)
    keys = torch.tensor([[1, 2]])
    before = ps.pull(np.array([1, 2], np.uint64))

    def refused(keys, grads, **kw):
        raise RuntimeError("push refused")
    ps.push, push = refused, ps.push
    with pytest.raises(RuntimeError, match="push refused"):
        bag(keys).sum().backward()
    ps.push = push

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("a node failed")
    # The second lookup's backward runs first (made last), then Fails' raises.
    with pytest.raises(ValueError, match="a node failed"):
        (Fails.apply(bag(keys)).sum() + bag(keys).sum()).backward()
    np.testing.assert_array_equal(ps.pull(np.array([1, 2], np.uint64)), before)
    assert ps.step == 0
    bag(keys).sum().backward()
    np.testing.assert_allclose(ps.pull(np.array([1, 2], np.uint64)), before - 0.5, rtol=1e-6)
    assert ps.step == 1
    # The failed pass's gradients (and a reference to the server) stayed for the
    # life of the process; they go once torch frees the pass.
    assert ht._PENDING == {}
    ps.close()


def test_copying_or_pickling_a_module_is_refused_naming_what_to_save(tmp_path):
    """A module's rows live in the server, which a copy cannot take (a second server
    over the same files): deepcopy, pickle and torch.save of the module said "cannot
    pickle 'hps._core.SparseOptimizer' object". They are refused naming the module and
    what to do; the state_dict (the dense parameters) saves and loads, and a deepcopy
    that shares the module (DeviceReplicas' memo) works."""
    import copy
    import io
    import pickle
    ps = make_ps(tmp_path)
    model = ht.CtrModel(ps, num_fields=2, num_dense=1, hidden=(4,))
    for what, call in [("deepcopy", lambda: copy.deepcopy(model)), ("pickle", lambda: pickle.dumps(model.embedding)),
                       ("torch.save", lambda: torch.save(model, io.BytesIO()))]:
        with pytest.raises(TypeError, match=r"hps.torch.EmbeddingBag .*ParameterServer.*state_dict\(\).*"
                                            r"ps.checkpoint\(\)"):
            call()
    shared = {id(model.embedding): model.embedding}
    twin = copy.deepcopy(model, shared)
    assert twin.embedding is model.embedding and twin.mlp[0].weight is not model.mlp[0].weight
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    twin.load_state_dict(torch.load(buf))
    keys, dense = torch.tensor([[1, 2]]), torch.ones(1, 1)
    assert torch.equal(twin(keys, dense), model(keys, dense))
    ps.close()


def test_ctr_model_takes_an_empty_batch_and_names_its_keys(tmp_path):
    """No example: a (0,) output and no row trained, as on a batch (the server's path
    reshaped (0, fields * dim) to (0, -1), which torch refuses). Keys of another dtype
    are refused naming CtrModel's argument, keys (not EmbeddingBag's input)."""
    ps = make_ps(tmp_path)
    for bags in (0, 1):
        model = ht.CtrModel(ps, num_fields=2, num_dense=1, hidden=(4,), num_bags=bags)
        keys, dense = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 1)
        inputs = [(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None)] if bags else None
        out = model(keys, dense, inputs)
        assert out.shape == (0,)
        out.sum().backward()
    with pytest.raises(TypeError, match="keys must be an int64 tensor.*got torch.int32"):
        model(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 1), inputs)
    with ps.batch(np.arange(4, dtype=np.uint64)) as b:
        model = ht.CtrModel(ps, num_fields=2, num_dense=1, hidden=(4,))
        model.embedding.attach(b)
        with pytest.raises(TypeError, match="keys must be an int64 tensor.*got torch.int32"):
            model(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 1))
        model.embedding.attach(None)
    ps.close()


def test_gradients_asked_of_other_tensors_train_no_row(tmp_path):
    """torch.autograd.grad, or backward(inputs=...), asks for the gradients of the
    tensors it names and of no others: nn.EmbeddingBag's weight gets no .grad then. A
    lookup's backward ran for them (per_sample_weights' gradient, the MLP's through
    CtrModel's first layer) and pushed the rows' gradients all the same: a gradient
    penalty or a saliency read of the weights took an optimizer step a key."""
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps)
    keys, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    ids = np.array([1, 2, 3], np.uint64)
    before = ps.pull(ids)
    w = torch.tensor([0.5, 2.0, 1.0], requires_grad=True)
    ref = torch_twin(ps, 4)
    (g,) = torch.autograd.grad(bag(keys, offsets, per_sample_weights=w).sum(), [w])
    (g_ref,) = torch.autograd.grad(ref(keys, offsets, per_sample_weights=w).sum(), [w])
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    assert ref.weight.grad is None
    np.testing.assert_array_equal(ps.pull(ids), before, err_msg="autograd.grad w.r.t. per_sample_weights")
    bag(keys, offsets, per_sample_weights=w).sum().backward(inputs=[w])
    np.testing.assert_array_equal(ps.pull(ids), before, err_msg="backward(inputs=[per_sample_weights])")

    # CtrModel in a batch: its first layer's backward runs for the MLP's gradients.
    model = ht.CtrModel(ps, num_fields=2, num_dense=1, hidden=(4,))
    ctr_keys, dense = torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 1)
    ids = np.array([1, 2, 3, 4], np.uint64)
    before = ps.pull(ids)
    for how in ("autograd.grad", "backward(inputs=mlp)"):
        with ps.batch(ctr_keys.numpy()) as b:
            model.embedding.attach(b)
            loss = model(ctr_keys, dense).sum()
            assert "_FirstLayerBackward" in graph_nodes(loss)
            if how == "autograd.grad":
                grads = torch.autograd.grad(loss, list(model.mlp.parameters()))
                assert all(g is not None for g in grads)
            else:
                loss.backward(inputs=list(model.mlp.parameters()))
            model.embedding.attach(None)
        np.testing.assert_array_equal(ps.pull(ids), before, err_msg=how)
    # A plain backward trains them as before.
    with ps.batch(ctr_keys.numpy()) as b:
        model.embedding.attach(b)
        model(ctr_keys, dense).sum().backward()
        model.embedding.attach(None)
    assert not np.array_equal(ps.pull(ids), before)
    ps.close()


def test_a_pass_into_a_batch_and_to_the_server_directly_is_refused(tmp_path):
    """Two modules on one server, one attached to its batch and one not (forgotten):
    the pass's end pushed the other's gradients to the server, whose push waits for
    the batch in flight to finish, which waits for this backward, forever. It is
    refused, naming the fix, and nothing reaches the server (the batch, aborted by
    its with block, drops the rest)."""
    import threading
    ps = make_ps(tmp_path)
    user, item = ht.EmbeddingBag(ps), ht.EmbeddingBag(ps)
    keys = torch.tensor([[1, 2], [3, 4]])
    ids = np.array([1, 2, 3, 4], np.uint64)
    before = ps.pull(ids)
    raised = []

    def backward():
        try:
            (user(keys).sum() + item(keys).sum()).backward()
        except RuntimeError as e:
            raised.append(e)
    with pytest.raises(RuntimeError, match="batch abort"):
        with ps.batch(keys.numpy()) as b:
            user.attach(b)
            t = threading.Thread(target=backward, daemon=True)
            t.start()
            t.join(timeout=60)  # (a hang guard: the push waited for this batch)
            assert not t.is_alive(), "the backward pass still waits for the batch it is part of"
            user.attach(None)
            assert len(raised) == 1
            raise RuntimeError("batch abort")
    assert "attach" in str(raised[0]) and "to the server directly" in str(raised[0])
    np.testing.assert_array_equal(ps.pull(ids), before)
    assert ht._PENDING == {}
    # Both attached, or neither: the pass trains.
    with ps.batch(keys.numpy()) as b:
        user.attach(b)
        item.attach(b)
        (user(keys).sum() + item(keys).sum()).backward()
        user.attach(None)
        item.attach(None)
    np.testing.assert_allclose(ps.pull(ids), before - 2 * 0.5, rtol=1e-6)
    (user(keys).sum() + item(keys).sum()).backward()
    np.testing.assert_allclose(ps.pull(ids), before - 4 * 0.5, rtol=1e-5)
    ps.close()


def test_micro_batches_in_one_batch_take_one_step_and_without_one_a_step_each(tmp_path):
    """docs/training.md, "In your own trainer": gradients accumulated torch's way (two
    backward passes, one opt.step) reach the rows, inside one batch, as one AdaGrad
    step a key on their sum, as torch's Adagrad steps an nn.EmbeddingBag; without a
    batch each backward pass is a step of its own (AdaGrad's state updated twice)."""
    vocab = 6
    keys = torch.tensor([[0, 1, 2], [1, 3, 4], [1, 5, 0], [2, 2, 3]])
    scale = torch.arange(1, DIM + 1, dtype=torch.float32)
    for in_batch in (True, False):
        ps = hps.ParameterServer(hps.ParameterServerConfig(dim=DIM, path=str(tmp_path / f"ps{in_batch}"),
                                                           optimizer=hps.AdaGrad(lr=0.1), mem_budget="4MiB"))
        bag = ht.EmbeddingBag(ps)
        ref = torch.nn.EmbeddingBag(vocab, DIM)
        with torch.no_grad():
            ref.weight.copy_(torch.from_numpy(ps.pull(np.arange(vocab, dtype=np.uint64))))
        opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
        for part in (slice(0, 2), slice(2, 4)):
            ((ref(keys[part]) * scale) ** 2).sum().backward()
            if not in_batch:
                opt.step()
                opt.zero_grad()
        opt.step()
        with ps.batch(keys.numpy()) if in_batch else contextlib.nullcontext() as b:
            bag.attach(b)
            for part in (slice(0, 2), slice(2, 4)):
                ((bag(keys[part]) * scale) ** 2).sum().backward()
            bag.attach(None)
        torch.testing.assert_close(torch.from_numpy(ps.pull(np.arange(vocab, dtype=np.uint64))), ref.weight.detach(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"in_batch={in_batch}: {m}")
        ps.close()


def _finishes(scenario, timeout=60):
    """scenario() in a thread of its own: what it returned or raised, or an
    AssertionError where it still runs after `timeout` seconds (a hang guard: the
    suite goes on, the thread is left waiting)."""
    import threading
    done = []

    def run():
        try:
            done.append(("returned", scenario()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            done.append(("raised", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the backward pass still waits for a batch that waits for it"
    return done[0]


@pytest.mark.parametrize("host_in_place", [True, False])
@pytest.mark.parametrize("how", ["inside", "forward_before", "applied", "pipeline"])
def test_a_backward_pass_of_a_module_with_no_batch_attached_while_a_batch_of_its_server_is_open_is_refused(
        tmp_path, host_in_place, how):
    """A module with no batch attached pushes its gradients to the server at the
    pass's end, and the server's push waits for every batch made to finish: one
    that this thread has yet to step (inside its with block, whether the forward
    ran there or before it; made here and applied, not yet written back; a
    pipeline's, in its train step) finishes after this pass, so the backward hung.
    It is refused at once, naming the module and the fix, and nothing reaches the
    server; the module trains once the batch is finished."""
    from types import SimpleNamespace
    from hps.pipeline import Pipeline
    ps = make_ps(tmp_path, host_in_place=host_in_place)
    bag = ht.EmbeddingBag(ps)
    keys = torch.tensor([[1, 2], [3, 4]])
    ids = np.array([1, 2, 3, 4], np.uint64)
    before = ps.pull(ids)

    def scenario():
        if how == "inside":
            with ps.batch(keys.numpy()):
                bag(keys).sum().backward()
        elif how == "forward_before":
            loss = bag(keys).sum()
            with ps.batch(keys.numpy()):
                loss.backward()
        elif how == "applied":
            b = ps.batch(keys.numpy())
            b.apply()
            try:
                bag(keys).sum().backward()
            finally:
                b.write_back()
        else:
            def step(loaded):
                bag(keys).sum().backward()
            Pipeline(ps, step, devices=1).run([SimpleNamespace(keys=keys.numpy(), labels=np.zeros(2))])
    outcome, error = _finishes(scenario)
    assert outcome == "raised" and isinstance(error, RuntimeError), (outcome, error)
    said = str(error)
    assert "EmbeddingBag(dim=8, mode='sum')" in said and repr(ps) in said, said
    assert "no batch attached" in said and "module.attach(batch, worker)" in said, said
    np.testing.assert_array_equal(ps.pull(ids), before)
    assert ht._PENDING == {}
    bag(keys).sum().backward()  # the batch finished: the pass's push goes ahead
    np.testing.assert_allclose(ps.pull(ids), before - 0.5, rtol=1e-6)
    ps.close()


def _scaled_run(tmp_path, name, steps, scaler=None, in_batch=None, skip_first=False):
    """CtrModel trained over `steps` (SGD on the rows and the MLP, which scaling
    changes, as AdaGrad and Adam would not): without a scaler as docs/training.md's
    own trainer does, or with torch.amp.GradScaler and an hps.torch.SparseStep.
    in_batch: None, no batch (backward is the rows' step), else each step inside a
    batch, host_in_place = in_batch. Returns the server, the model and the losses."""
    ps = make_ps(tmp_path / name, lr=0.3, host_in_place=bool(in_batch))
    model = ht.CtrModel(ps, num_fields=3, num_dense=2, hidden=(16,), seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = ht.SparseStep(model) if scaler is not None else None
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    losses = []
    for step in steps:
        rng = np.random.default_rng(step)
        keys = torch.from_numpy(rng.integers(0, 40, (64, 3)))
        dense = torch.from_numpy(rng.standard_normal((64, 2)).astype(np.float32))
        labels = torch.from_numpy((rng.random(64) < 0.5).astype(np.float32))
        with ps.batch(keys.numpy()) if in_batch is not None else contextlib.nullcontext() as b:
            model.embedding.attach(b)
            opt.zero_grad()
            loss = loss_fn(model(keys, dense), labels)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.step(rows)
                scaler.update()
            model.embedding.attach(None)
        losses.append(loss.item())
    return ps, model, losses


def _assert_same_training(a, b):
    (ps_a, model_a, losses_a), (ps_b, model_b, losses_b) = a, b
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-5)
    ids = np.arange(40, dtype=np.uint64)
    np.testing.assert_allclose(ps_a.pull(ids), ps_b.pull(ids), rtol=1e-5, atol=1e-6)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_batch", [None, True, False])
def test_a_grad_scaler_trains_the_rows_as_training_without_one(tmp_path, in_batch):
    """docs/training.md, "In your own trainer": torch.amp.GradScaler scales the loss
    (65536 here), so every gradient backward computes. The rows took theirs as
    computed: a step 65536 times too long. With a SparseStep the rows' gradients
    wait for scaler.step(rows), which unscales them as it unscales the MLP's, and
    the run is the run without a scaler, to float tolerance: without a batch and
    inside one (on a host batch and through the device tier)."""
    plain = _scaled_run(tmp_path, "plain", range(3), in_batch=in_batch)
    scaled = _scaled_run(tmp_path, "scaled", range(3), torch.amp.GradScaler("cpu"), in_batch=in_batch)
    _assert_same_training(plain, scaled)


@pytest.mark.parametrize("in_batch", [None, True, False])
def test_a_step_the_grad_scaler_skips_is_skipped_by_the_rows(tmp_path, in_batch):
    """A scale that overflows (infinite, here: every gradient is inf or NaN) makes
    the scaler skip the step and lower the scale. The rows took the step anyway, or
    refused it as diverged (DivergedError), ending the run where the scaler would
    have gone on. With a SparseStep the rows skip it too and keep their values; the
    run after it is the run without a scaler over the same later batches."""
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    ps, model, _ = _scaled_run(tmp_path, "skipped", [0], scaler, in_batch=in_batch)
    fresh_ps, fresh_model, _ = _scaled_run(tmp_path, "fresh", [], in_batch=in_batch)
    ids = np.arange(40, dtype=np.uint64)
    np.testing.assert_array_equal(ps.pull(ids), fresh_ps.pull(ids))  # no row stepped
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    ps.close()
    fresh_ps.close()
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    steps = [0, 1, 2]

    class Rescaled:  # the scaler after its skip, at a scale that fits
        def __iter__(self):
            for i, step in enumerate(steps):
                yield step
                if i == 0:
                    assert scaler.get_scale() == float("inf") * 0.5  # update() backed off
                    scaler.update(2.0 ** 10)
    scaled = _scaled_run(tmp_path, "scaled", Rescaled(), scaler, in_batch=in_batch)
    plain = _scaled_run(tmp_path, "plain", steps[1:], in_batch=in_batch)
    _assert_same_training((scaled[0], scaled[1], scaled[2][1:]), plain)


def test_the_grad_scaler_sees_the_rows_gradients(tmp_path):
    """Rows alone, no dense optimizer: a gradient of the rows that overflows makes
    scaler.step(rows) skip their step and scaler.update() lower the scale, as it
    would for an nn.EmbeddingBag's weight in a torch optimizer. Without a scaler
    rows.step() takes the held gradients as they are. A step whose push would wait
    for a batch that waits for it is refused as backward's is; the scale the scaler
    handed that step was left on it, and the next step, without a scaler, divided
    by it."""
    ps = make_ps(tmp_path)
    bag = ht.EmbeddingBag(ps)
    rows = ht.SparseStep(bag)
    keys = torch.tensor([[1, 2], [3, 4]])
    ids = np.array([1, 2, 3, 4], np.uint64)
    before = ps.pull(ids)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    scaler.scale(bag(keys).sum() * 2.0 ** 120).backward()  # gradients 2**136: inf in float32
    np.testing.assert_array_equal(ps.pull(ids), before)  # held until the step
    scaler.step(rows)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 15
    np.testing.assert_array_equal(ps.pull(ids), before)
    scaler.scale(bag(keys).sum()).backward()
    scaler.step(rows)
    scaler.update()
    np.testing.assert_allclose(ps.pull(ids), before - 0.5, rtol=1e-6)
    bag(keys).sum().backward()
    rows.step()
    np.testing.assert_allclose(ps.pull(ids), before - 1.0, rtol=1e-6)
    # Its push waits for a batch of the server open on this thread as backward's
    # does: refused, and the scaler's scale and verdict not left to the next step.
    with pytest.raises(RuntimeError, match="batch abort"):
        with ps.batch(keys.numpy()):
            scaler.scale(bag(keys).sum()).backward()
            outcome, error = _finishes(lambda: scaler.step(rows))  # (the hang guard)
            assert outcome == "raised" and "EmbeddingBag(dim=8, mode='sum')" in str(error), (outcome, error)
            assert "has no batch attached" in str(error)
            raise RuntimeError("batch abort")
    np.testing.assert_allclose(ps.pull(ids), before - 1.0, rtol=1e-6)
    bag(keys).sum().backward()
    rows.step()
    np.testing.assert_allclose(ps.pull(ids), before - 1.5, rtol=1e-6)
    rows.release()  # backward is the rows' step again
    bag(keys).sum().backward()
    np.testing.assert_allclose(ps.pull(ids), before - 2.0, rtol=1e-6)
    ps.close()
