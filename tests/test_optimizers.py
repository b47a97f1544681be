"""Fused sparse optimizers against a NumPy reference, step by step, and the
deterministic (seed, key) initialiser."""
import numpy as np
import pytest

import hps

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# ---------------------------------------------------------------- reference

def mix64(k):
    k = np.asarray(k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        k = k ^ (k >> np.uint64(33))
        k = k * np.uint64(0xFF51AFD7ED558CCD)
        k = k ^ (k >> np.uint64(33))
        k = k * np.uint64(0xC4CEB9FE1A85EC53)
        k = k ^ (k >> np.uint64(33))
    return k


def unit_float(seed, keys, column):
    with np.errstate(over="ignore"):
        h = mix64(mix64(keys ^ mix64(np.uint64(seed))) +
                  np.uint64(0x9E3779B97F4A7C15) * np.uint64(column + 1))
    return (h >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def reference_init(keys, dim, init, scale, seed):
    cols = []
    for j in range(dim):
        if init == "zeros":
            cols.append(np.zeros(len(keys), np.float32))
        elif init == "uniform":
            cols.append(np.float32(scale) * (np.float32(2) * unit_float(seed, keys, j) - np.float32(1)))
        else:
            u1 = np.float32(1) - unit_float(seed, keys, 2 * j)
            u2 = unit_float(seed, keys, 2 * j + 1)
            cols.append(np.float32(scale) * np.sqrt(np.float32(-2) * np.log(u1)) *
                        np.cos(np.float32(2 * np.pi) * u2))
    return np.stack(cols, axis=1).astype(np.float32)


class Reference:
    """The optimizer formulas of hps.optim, written independently in NumPy."""

    def __init__(self, dim, optimizer, init_rows):
        self.dim, self.opt, self.init_rows = dim, optimizer, init_rows
        self.emb, self.state = {}, {}

    def _ensure(self, key):
        if key not in self.emb:
            self.emb[key] = self.init_rows(np.array([key], np.uint64))[0, :self.dim].astype(np.float64)
            o = self.opt
            if isinstance(o, hps.RowWiseAdaGrad):
                self.state[key] = {"h": float(o.initial_accumulator_value)}
            elif isinstance(o, hps.AdaGrad):
                self.state[key] = {"h": np.full(self.dim, o.initial_accumulator_value)}
            elif isinstance(o, hps.Adam):
                self.state[key] = {"m": np.zeros(self.dim), "v": np.zeros(self.dim), "t": 0}
            else:
                self.state[key] = {}

    def pull(self, keys):
        for k in keys.tolist():
            self._ensure(k)
        return np.array([self.emb[k] for k in keys.tolist()])

    def push(self, keys, grads):
        summed = {}
        for k, g in zip(keys.tolist(), grads.astype(np.float64)):
            summed[k] = summed.get(k, 0) + g
        o = self.opt
        for k, g in summed.items():
            self._ensure(k)
            w, s = self.emb[k], self.state[k]
            if isinstance(o, hps.RowWiseAdaGrad):
                s["h"] += np.mean(g * g)
                w -= o.lr * g / (np.sqrt(s["h"]) + o.eps)
            elif isinstance(o, hps.AdaGrad):
                s["h"] += g * g
                w -= o.lr * g / (np.sqrt(s["h"]) + o.eps)
            elif isinstance(o, hps.Adam):
                s["t"] += 1
                s["m"] = o.beta1 * s["m"] + (1 - o.beta1) * g
                s["v"] = o.beta2 * s["v"] + (1 - o.beta2) * g * g
                step = o.lr / (1 - o.beta1 ** s["t"])
                w -= step * s["m"] / (np.sqrt(s["v"]) / np.sqrt(1 - o.beta2 ** s["t"]) + o.eps)
            else:
                w -= o.lr * g


OPTIMIZERS = [
    hps.SGD(lr=0.1),
    hps.AdaGrad(lr=0.05, eps=1e-8, initial_accumulator_value=0.1),
    hps.RowWiseAdaGrad(lr=0.05, eps=1e-8),
    hps.Adam(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8),
    hps.Adam(lr=0.01, beta1=0.0, beta2=0.99, eps=1e-6),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: repr(o))
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_numpy_reference_step_by_step(optimizer, threads):
    dim = 8
    emb = hps.EmbeddingTable(40_000, dim, optimizer=optimizer, initializer=hps.Normal(0.1),
                             seed=7, threads=threads)
    ref = Reference(dim, optimizer, emb.native_optimizer.initial_rows)
    rng = np.random.default_rng(1)
    for step in range(12):
        # Skewed keys: many duplicates per push, some keys updated every step.
        n = 12_000 if step % 3 == 0 else 500
        keys = (rng.zipf(1.3, n) % 20_000).astype(np.uint64)
        grads = rng.normal(0, 1, (n, dim)).astype(np.float32)
        # float32 sums of up to ~1000 duplicate gradients vs float64: ~1e-6 apart.
        np.testing.assert_allclose(emb.pull(keys), ref.pull(keys), rtol=1e-5, atol=2e-5)
        emb.push(keys, grads)
        ref.push(keys, grads)
    all_keys = np.array(sorted(ref.emb), np.uint64)
    np.testing.assert_allclose(emb.pull(all_keys), ref.pull(all_keys), rtol=1e-5, atol=2e-5)
    assert len(emb) == len(ref.emb)


def test_row_layout_holds_optimizer_state():
    dim = 4
    assert hps.EmbeddingTable(8, dim, optimizer=hps.SGD()).table.row_floats == dim
    assert hps.EmbeddingTable(8, dim, optimizer=hps.AdaGrad()).table.row_floats == 2 * dim
    assert hps.EmbeddingTable(8, dim, optimizer=hps.RowWiseAdaGrad()).table.row_floats == dim + 1
    adam = hps.EmbeddingTable(8, dim, optimizer=hps.Adam(), initializer=hps.Zeros())
    adam.push(np.array([5, 5], np.uint64), np.ones((2, dim), np.float32))
    rows, _ = adam.table.find(np.array([5], np.uint64))
    m, v, t = rows[0, dim:2 * dim], rows[0, 2 * dim:3 * dim], rows[0, 3 * dim]
    np.testing.assert_allclose(m, 0.1 * 2.0, rtol=1e-6)  # (1 - beta1) * summed gradient 2
    np.testing.assert_allclose(v, 0.001 * 4.0, rtol=1e-4)  # 1 - 0.999 in float32
    assert t == 1.0                                     # one step for the two duplicates


def test_push_of_unseen_keys_starts_from_their_initial_rows():
    emb = hps.EmbeddingTable(64, 3, optimizer=hps.SGD(lr=1.0), initializer=hps.Uniform(0.5), seed=3)
    keys = np.array([10, 11], np.uint64)
    init = emb.native_optimizer.initial_rows(keys)
    emb.push(keys, np.ones((2, 3), np.float32))
    np.testing.assert_allclose(emb.pull(keys), init - 1.0, rtol=1e-6)


@pytest.mark.parametrize("optimizer, grad, said", [
    (hps.SGD(lr=10.0), 1e38, "its embedding, column 1, would be -inf"),
    (hps.AdaGrad(lr=0.1), 1e20, "its AdaGrad sum of squared gradients, column 1, would be inf"),
    (hps.RowWiseAdaGrad(lr=0.1), 1e20, "its row-wise AdaGrad sum of squared gradients would be inf"),
    (hps.Adam(lr=0.1), 1e30, "its Adam second moment, column 1, would be inf"),
], ids=["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_step_that_would_leave_a_row_not_finite_is_refused_naming_the_key(optimizer, grad, said):
    """A finite gradient can still step a row past float32: SGD's lr * g (-inf), the
    squares of AdaGrad and Adam (a sum of squares or second moment of inf, after which
    the row never moves again). The row was stored and served so, with no error. The
    step refuses the push now, naming the key and the value, before any row changes;
    a key the table lacks is not made either; then the table trains on."""
    emb = hps.EmbeddingTable(64, 4, optimizer=optimizer, seed=3)
    keys = np.array([5, 6], np.uint64)
    emb.pull(keys)
    before, _ = emb.table.find(keys)
    grads = np.ones((2, 4), np.float32)
    grads[1, 1] = grad
    with pytest.raises(hps.DivergedError, match=rf"^apply_gradients: the step of 1 key would leave a value that is "
                                                rf"not finite in its row \(key 6 first: {said}\): training diverged "
                                                rf"\(a learning rate, or finite gradient sums, too large for "
                                                rf"float32\); no row was stepped$"):
        emb.push(keys, grads)
    np.testing.assert_array_equal(emb.table.find(keys)[0], before)
    with pytest.raises(hps.DivergedError, match=r"the step of 1 key .* \(key 7 first: "):
        emb.push(np.array([7], np.uint64), grads[1:])
    assert len(emb) == 2
    emb.push(keys, np.ones((2, 4), np.float32))
    assert np.isfinite(emb.table.find(keys)[0]).all()


def rows_by_key(table):
    """A table's keys, sorted, and their rows."""
    keys, rows = table.export()
    order = np.argsort(keys)
    return keys[order], rows[order]


def push_that_fills_the_table_midway(device, threads, present):
    """A table of `present` keys and a push of those and more keys it lacks than it
    has free slots. The push must be refused, changing no row and claiming no slot;
    with room made (its rows moved to a larger table), the push again steps each key
    once, as in a table that had room from the start."""
    optimizer = hps.AdaGrad(lr=0.1)
    emb = hps.EmbeddingTable(present, 4, optimizer=optimizer, seed=3, threads=threads, device=device)
    free = emb.table.capacity - present
    assert free > 0
    keys = np.arange(1, present + free + 6, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    emb.pull(keys[:present])
    before = rows_by_key(emb.table)
    grads = (np.arange(len(keys) * 4, dtype=np.float32).reshape(-1, 4) % 5) + np.float32(0.25)
    with pytest.raises(hps.TableFullError) as full:
        emb.push(keys, grads)
    assert len(emb) == present
    after = rows_by_key(emb.table)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert str(full.value) == (f"apply_gradients: hash table full: the step needs a slot for each of {free + 5} keys "
                               f"the table lacks, and {free} are free (capacity {emb.table.capacity}, size "
                               f"{present}); no row was stepped")

    larger = hps.EmbeddingTable(2 * len(keys), 4, optimizer=optimizer, seed=3, threads=threads, device=device)
    roomy = hps.EmbeddingTable(2 * len(keys), 4, optimizer=optimizer, seed=3, threads=threads, device=device)
    larger.table.insert(*emb.table.export())
    roomy.pull(keys[:present])
    larger.push(keys, grads)
    roomy.push(keys, grads)
    for got, want in zip(rows_by_key(larger.table), rows_by_key(roomy.table)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads, present", [(1, 3), (2, 5_997)], ids=["one_thread", "two_threads"])
def test_a_push_that_fills_the_table_midway_steps_no_row_and_its_retry_steps_each_key_once(threads, present):
    """A push claims a slot for each key the table lacks as it steps the keys: where the
    table filled midway, the keys stepped before the full one kept their step (and
    their slots), the rest had none, and the TableFullError did not say which, so a
    retry after making room stepped the first ones twice. (5,997 keys: the step runs in
    parts on two threads.)"""
    push_that_fills_the_table_midway("cpu", threads, present)


# ---------------------------------------------------------------- initialiser

@pytest.mark.parametrize("init, scale", [("uniform", 0.05), ("normal", 0.2), ("zeros", 0.0)])
def test_initial_rows_match_reference_formula(init, scale):
    initializer = {"uniform": hps.Uniform(scale), "normal": hps.Normal(scale), "zeros": hps.Zeros()}[init]
    emb = hps.EmbeddingTable(8, 6, optimizer=hps.SGD(), initializer=initializer, seed=99)
    keys = np.array([0, 1, 2**63, 2**64 - 2, 12345], np.uint64)
    np.testing.assert_allclose(emb.native_optimizer.initial_rows(keys),
                               reference_init(keys, 6, init, scale, 99), rtol=2e-6, atol=1e-7)


def test_initialisation_is_a_pure_function_of_seed_and_key():
    keys = np.random.default_rng(0).integers(0, 2**62, 20_000, dtype=np.uint64)
    a = hps.EmbeddingTable(50_000, 8, initializer=hps.Normal(0.1), seed=5, threads=1)
    b = hps.EmbeddingTable(30_000, 8, initializer=hps.Normal(0.1), seed=5, threads=2)
    c = hps.EmbeddingTable(50_000, 8, initializer=hps.Normal(0.1), seed=6)
    first = a.pull(keys)
    b.pull(keys[::-1].copy())        # another order, another thread split, another capacity
    np.testing.assert_array_equal(b.pull(keys), first)
    assert not np.allclose(c.pull(keys), first)


def test_initialiser_distributions():
    keys = np.arange(200_000, dtype=np.uint64)
    uniform = hps.EmbeddingTable(300_000, 4, initializer=hps.Uniform(0.5)).pull(keys)
    assert uniform.min() >= -0.5 and uniform.max() < 0.5
    assert abs(uniform.mean()) < 0.003 and abs(uniform.std() - 0.5 / np.sqrt(3)) < 0.003
    normal = hps.EmbeddingTable(300_000, 4, initializer=hps.Normal(0.2)).pull(keys)
    assert abs(normal.mean()) < 0.002 and abs(normal.std() - 0.2) < 0.002
    # Columns are independent streams, not copies of one another.
    assert abs(np.corrcoef(normal[:, 0], normal[:, 1])[0, 1]) < 0.01


# ---------------------------------------------------------------- bad settings

@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": hps.SGD(lr=0.0)}, "lr must be a finite number > 0"),
    ({"optimizer": hps.SGD(lr=float("nan"))}, "lr must be a finite number > 0"),
    ({"optimizer": hps.Adam(beta1=1.0)}, r"beta1 must be in \[0, 1\)"),
    ({"optimizer": hps.Adam(beta2=-0.1)}, r"beta2 must be in \[0, 1\)"),
    ({"optimizer": hps.AdaGrad(eps=-1.0)}, "eps must be a finite number > 0"),
    ({"optimizer": hps.AdaGrad(eps=0.0)}, "eps must be a finite number > 0"),
    ({"optimizer": hps.RowWiseAdaGrad(eps=0.0)}, "eps must be a finite number > 0"),
    ({"optimizer": hps.Adam(eps=0.0)}, "eps must be a finite number > 0"),
    ({"optimizer": hps.Adam(eps=float("inf"))}, "eps must be a finite number > 0"),
    ({"optimizer": hps.Adam(beta1=float("nan"))}, r"beta1 must be in \[0, 1\)"),
    ({"optimizer": hps.SGD(lr=float("inf"))}, "lr must be a finite number > 0"),
    ({"optimizer": hps.AdaGrad(initial_accumulator_value=-1.0)}, "initial_accumulator must be"),
    ({"initializer": hps.Normal(-1.0)}, "initializer scale must be"),
])
def test_bad_optimizer_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hps.EmbeddingTable(8, 4, **kwargs)


def test_bad_optimizer_arguments():
    with pytest.raises(ValueError, match="dim must be > 0"):
        hps.EmbeddingTable(8, 0)
    # Adam's row of 3 x dim + 1 floats overflowed int32 (a signed overflow in the
    # native row width); larger dims failed in the binding's conversion.
    with pytest.raises(ValueError, match="optimizer: dim must be at most 715827882, got 715827883"):
        hps.EmbeddingTable(8, 715_827_883, optimizer=hps.Adam())
    with pytest.raises(ValueError, match=r"optimizer: dim must be > 0 and below 2\*\*31, got 1099511627776"):
        hps.EmbeddingTable(8, 2 ** 40)
    with pytest.raises(TypeError, match="optimizer must be hps.SGD"):
        hps.EmbeddingTable(8, 4, optimizer="adam")
    with pytest.raises(TypeError, match="initializer must be hps.Uniform"):
        hps.EmbeddingTable(8, 4, initializer=0.1)
    # Named here, not left to the binding's list of overloads.
    with pytest.raises(TypeError, match="optimizer: lr must be a number, got '0.1'"):
        hps.EmbeddingTable(8, 4, optimizer=hps.SGD(lr="0.1"))
    with pytest.raises(TypeError, match="optimizer: initializer scale must be a number, got None"):
        hps.EmbeddingTable(8, 4, initializer=hps.Uniform(scale=None))
    for seed in (-1, 2 ** 64, 1.5, True):
        with pytest.raises(ValueError, match=f"seed must be an integer from 0 to 2\\*\\*64 - 1, got {seed}"):
            hps.EmbeddingTable(8, 4, seed=seed)
    assert hps.EmbeddingTable(8, 4, seed=2 ** 64 - 1).pull(np.array([1], np.uint64)).shape == (1, 4)


def test_optimizer_must_match_the_table_rows():
    emb = hps.EmbeddingTable(8, 4, optimizer=hps.Adam())
    sgd = hps.EmbeddingTable(8, 4, optimizer=hps.SGD()).native_optimizer
    with pytest.raises(ValueError, match="needs rows of 4 floats, but the table's rows have 13"):
        emb.table.lookup_or_init(np.array([1], np.uint64), sgd)


def test_gradient_shape_is_checked():
    emb = hps.EmbeddingTable(8, 4)
    with pytest.raises(ValueError, match=r"grads must have shape \(2, 4\), got \(2, 8\)"):
        emb.push(np.array([1, 2], np.uint64), np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="reserved empty-slot key"):
        emb.push(np.array([hps.EMPTY_KEY], np.uint64), np.ones((1, 4), np.float32))
    assert len(emb) == 0
