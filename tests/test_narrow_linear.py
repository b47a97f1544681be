"""hps._core's narrow linear kernels (hps/narrow_linear.h), which compute CtrModel's
first layer on the CPU when it has at most 16 outputs: their products against
numpy's in float64, on the layouts hps.torch hands them (the model's input, a
column range of a wider matrix), and the arrays they refuse, by name."""
import numpy as np
import pytest

from hps import _core


def exact_forward(x, w, b):
    out = x.astype(np.float64) @ w.T.astype(np.float64)
    return out if b is None else out + b


@pytest.mark.parametrize("rows, inputs, outputs", [(1, 1, 1), (4096, 429, 16), (37, 20, 9), (8, 64, 12)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_is_x_times_weight_transposed_plus_bias(rows, inputs, outputs, with_bias):
    rng = np.random.default_rng(rows + inputs)
    x = rng.standard_normal((rows, inputs), dtype=np.float32)
    w = rng.standard_normal((outputs, inputs), dtype=np.float32)
    b = rng.standard_normal(outputs, dtype=np.float32) if with_bias else None
    out = np.full((rows, outputs), np.nan, dtype=np.float32)
    _core.narrow_linear_forward(x, w, b, out)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + 1
    assert (np.abs(out - exact_forward(x, w, b)) <= 1e-6 * inputs * scale).all()


def test_forward_reads_a_column_range_of_a_wider_matrix_and_splits_rows_over_threads():
    rng = np.random.default_rng(1)
    wide = rng.standard_normal((3000, 50), dtype=np.float32)
    x = wide[:, :40]  # rows 50 floats apart
    w = rng.standard_normal((16, 40), dtype=np.float32)
    one, two = np.empty((3000, 16), np.float32), np.empty((3000, 16), np.float32)
    _core.narrow_linear_forward(x, w, None, one, threads=1)
    _core.narrow_linear_forward(x, w, None, two, threads=2)
    np.testing.assert_array_equal(one, two)  # a row's sum does not depend on the split
    np.testing.assert_allclose(one, exact_forward(np.ascontiguousarray(x), w, None), rtol=1e-4, atol=1e-4)


def test_input_grad_fills_the_first_columns_only():
    rng = np.random.default_rng(2)
    grad = rng.standard_normal((300, 16), dtype=np.float32)
    w = rng.standard_normal((16, 45), dtype=np.float32)
    out = np.full((300, 45), 5.0, dtype=np.float32)
    _core.narrow_linear_input_grad(grad, w, 41, out[:, :41])
    exact = grad.astype(np.float64) @ w[:, :41].astype(np.float64)
    np.testing.assert_allclose(out[:, :41], exact, rtol=1e-5, atol=1e-5)
    assert (out[:, 41:] == 5.0).all()


def test_weight_grad_is_grad_transposed_times_x_and_the_bias_grad_its_row_sum():
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((2100, 50), dtype=np.float32)
    x = wide[:, :45]  # rows 50 floats apart, as a column range of the model's input
    grad = rng.standard_normal((2100, 13), dtype=np.float32)
    gw, gb = np.full((13, 45), np.nan, np.float32), np.full(13, np.nan, np.float32)
    _core.narrow_linear_weight_grad(grad, x, gw, gb)
    exact = grad.T.astype(np.float64) @ x.astype(np.float64)
    scale = np.abs(grad).T.astype(np.float64) @ np.abs(x).astype(np.float64)
    assert (np.abs(gw - exact) <= 1e-6 * 2100 * scale).all()
    np.testing.assert_allclose(gb, grad.astype(np.float64).sum(0), rtol=1e-4, atol=1e-4)
    two = np.empty_like(gw)
    _core.narrow_linear_weight_grad(grad, x, two, None, threads=2)  # the columns split, each sum whole
    np.testing.assert_array_equal(two, gw)


def test_bad_arrays_are_refused_by_name():
    x = np.zeros((4, 3), np.float32)
    w = np.zeros((2, 3), np.float32)
    out = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"outputs must be in \[1, 16\], got 17"):
        _core.narrow_linear_forward(x, np.zeros((17, 3), np.float32), None, np.zeros((4, 17), np.float32))
    with pytest.raises(TypeError, match="x must be an array of float32, got float64"):
        _core.narrow_linear_forward(x.astype(np.float64), w, None, out)
    with pytest.raises(ValueError, match=r"weight must have shape \(2, 3\)"):
        _core.narrow_linear_forward(x, np.zeros((2, 4), np.float32), None, out)
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\)"):
        _core.narrow_linear_forward(x, w, np.zeros(3, np.float32), out)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 2\)"):
        _core.narrow_linear_forward(x, w, None, np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="x must have rows of consecutive float32"):
        _core.narrow_linear_forward(np.zeros((4, 6), np.float32)[:, ::2], w, None, out)
    frozen = np.zeros((4, 2), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        _core.narrow_linear_forward(x, w, None, frozen)
    with pytest.raises(ValueError, match=r"got grad \(4, 2\), weight \(2, 3\), out \(4, 2\), columns 3"):
        _core.narrow_linear_input_grad(np.zeros((4, 2), np.float32), w, 3, np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"got grad \(4, 2\), x \(3, 3\), grad_weight \(2, 3\)"):
        _core.narrow_linear_weight_grad(out, np.zeros((3, 3), np.float32), w, None)
    with pytest.raises(ValueError, match=r"grad_bias must have shape \(2,\), got \(3,\)"):
        _core.narrow_linear_weight_grad(out, x, w.copy(), np.zeros(3, np.float32))
    frozen_weight = w.copy()
    frozen_weight.flags.writeable = False
    with pytest.raises(ValueError, match="grad_weight is read-only"):
        _core.narrow_linear_weight_grad(out, x, frozen_weight, None)
    assert _core.narrow_linear_kernel() in ("avx512", "avx2", "portable")
    assert _core.NARROW_LINEAR_MAX_OUTPUTS == 16
