"""hps.hierarchical.easgd against a NumPy transcription of EASGD (Zhang, Choromanska
and LeCun 2015) written here from the paper's equations, for 2 and 3 groups."""
from __future__ import annotations

import numpy as np
import pytest

from hps.hierarchical.easgd import Easgd, EasgdConfig

ETA = 0.05


def grad(g: int, t: int, x: np.ndarray) -> np.ndarray:
    """Group g's stochastic gradient at step t: of 0.5 |x - target_g|^2 plus noise."""
    target = np.linspace(-1, 1, x.size).astype(np.float32) * (g + 1)
    noise = np.random.default_rng(31 * g + t).standard_normal(x.size).astype(np.float32) * 0.1
    return (x - target + noise).astype(np.float32)


def reference_sync(x0, G, alpha, tau, steps):
    """Synchronous EASGD, the paper's eqs. (5)-(6) applied every tau steps with
    eta*rho = alpha:  x_i <- x_i - alpha (x_i - xt);  xt <- xt + alpha sum_i (x_i - xt),
    both from the values before the round; SGD steps x_i <- x_i - eta g_i otherwise."""
    x = [x0.astype(np.float64).copy() for _ in range(G)]
    xt = x0.astype(np.float64).copy()
    for t in range(1, steps + 1):
        for i in range(G):
            x[i] = x[i] - ETA * grad(i, t, x[i].astype(np.float32))
        if t % tau == 0:
            old = [xi.copy() for xi in x]
            x = [xi - alpha * (xi - xt) for xi in old]
            xt = xt + alpha * sum(xi - xt for xi in old)
    return x, xt


def reference_async(x0, G, alpha, tau, steps):
    """Asynchronous EASGD (the paper's Algorithm 1), workers visiting the master in
    the order 0..G-1 at each step where t mod tau == 0: worker i reads xt, computes
    e = alpha (x_i - xt), sets x_i <- x_i - e, the master sets xt <- xt + e."""
    x = [x0.astype(np.float64).copy() for _ in range(G)]
    xt = x0.astype(np.float64).copy()
    for t in range(1, steps + 1):
        for i in range(G):
            x[i] = x[i] - ETA * grad(i, t, x[i].astype(np.float32))
            if t % tau == 0:
                e = alpha * (x[i] - xt)
                x[i] = x[i] - e
                xt = xt + e
    return x, xt


@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("tau", [1, 3])
def test_sync_rounds_match_the_paper(G, tau):
    x0 = np.linspace(0.5, -0.5, 12).astype(np.float32)
    alpha, steps = 0.3, 9
    e = Easgd(x0, G, EasgdConfig(alpha=alpha, period=tau, mode="sync"))
    xs = [x0.copy() for _ in range(G)]
    for t in range(1, steps + 1):
        for i in range(G):
            xs[i] -= np.float32(ETA) * grad(i, t, xs[i])
        if t % tau == 0:
            e.exchange_all(xs)
    ref_x, ref_c = reference_sync(x0, G, alpha, tau, steps)
    for i in range(G):
        np.testing.assert_allclose(xs[i], ref_x[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e.centre, ref_c, rtol=1e-5, atol=1e-6)
    assert e.exchanges == G * (steps // tau)


@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("tau", [1, 2])
def test_async_exchanges_match_the_paper(G, tau):
    x0 = np.linspace(-0.3, 0.7, 10).astype(np.float32)
    alpha, steps = 0.2, 8
    e = Easgd(x0, G, EasgdConfig(alpha=alpha, period=tau))
    xs = [x0.copy() for _ in range(G)]
    exchanged = 0
    for t in range(1, steps + 1):
        for i in range(G):
            xs[i] -= np.float32(ETA) * grad(i, t, xs[i])
            exchanged += e.after_step(i, xs[i])
    ref_x, ref_c = reference_async(x0, G, alpha, tau, steps)
    for i in range(G):
        np.testing.assert_allclose(xs[i], ref_x[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e.centre, ref_c, rtol=1e-5, atol=1e-6)
    assert exchanged == G * (steps // tau)
    # The replicas were pulled together: closer to each other than without averaging.
    spread = max(np.abs(x - y).max() for x in xs for y in xs)
    free = [x0.astype(np.float64).copy() for _ in range(G)]
    for t in range(1, steps + 1):
        for i in range(G):
            free[i] = free[i] - ETA * grad(i, t, free[i].astype(np.float32))
    assert spread < 0.8 * max(np.abs(f - h).max() for f in free for h in free)


def test_an_exchange_keeps_the_sum():
    e = Easgd(np.zeros(4, np.float32), 2, EasgdConfig(alpha=0.37))
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([-4, 0, 1, 9], np.float32)
    before = a + b + e.centre
    e.exchange(1, b)
    e.exchange(0, a)
    np.testing.assert_allclose(a + b + e.centre, before, rtol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"alpha \(elasticity\) must be in \(0, 1\], got 0"):
        Easgd(np.zeros(2, np.float32), 2, EasgdConfig(alpha=0))
    with pytest.raises(ValueError, match="period must be an int >= 1, got 0"):
        EasgdConfig(period=0).check()
    with pytest.raises(ValueError, match="mode must be 'async' or 'sync', got 'bsp'"):
        EasgdConfig(mode="bsp").check()
    with pytest.raises(TypeError, match="centre must be a float32 numpy array, got float64"):
        Easgd(np.zeros(2), 2)
    e = Easgd(np.zeros(2, np.float32), 2)
    with pytest.raises(ValueError, match=r"group 2 out of range \[0, 2\)"):
        e.exchange(2, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"group 1's replica must be float32 of shape \(2,\), got float32 \(3,\)"):
        e.exchange(1, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="3 replicas for 2 groups"):
        e.exchange_all([np.zeros(2, np.float32)] * 3)
