"""hps.hierarchical.codecs: each codec round-trips within its stated bound, top-k's
error feedback carries the residual exactly, bytes are counted per traffic kind,
and bad inputs are refused naming what is wrong."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from hps.hierarchical.codecs import (TRAFFIC_KINDS, BFloat16, ByteCounter, CodecStreams, Encoded, Int8RowScale,
                                     NoCodec, TopK, decode, make_codec)


def _data(shape=(64, 33), seed=0):
    rng = np.random.default_rng(seed)
    # Magnitudes over many decades, and exact zeros, so that bounds are tested at every scale.
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-20, 20, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(np.float32)


def test_none_is_exact():
    x = _data()
    c = NoCodec()
    enc = c.encode(x)
    assert enc.nbytes == x.nbytes
    np.testing.assert_array_equal(c.decode(enc), x)


def test_bf16_within_relative_bound_and_half_the_bytes():
    x = _data()
    c = BFloat16()
    enc = c.encode(x)
    assert enc.nbytes == x.nbytes // 2
    y = c.decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8)
    # Values that bf16 holds exactly come back unchanged; the loss is real otherwise.
    exact = np.array([1.0, -2.5, 0.0, 3.0 * 2**-40], np.float32)
    np.testing.assert_array_equal(c.decode(c.encode(exact)), exact)
    assert np.any(y != x)


def test_bf16_rounds_to_nearest_even_and_keeps_specials():
    c = BFloat16()
    one = np.float32(1.0).view(np.uint32)
    # Exactly half-way between 1.0 and the next bf16 (1 + 2^-7): ties go to the even one, 1.0.
    tie_down = np.array([one + 0x8000], np.uint32).view(np.float32)
    # Half-way above 1 + 2^-7 (odd mantissa): ties go up to 1 + 2^-6.
    tie_up = np.array([one + 0x18000], np.uint32).view(np.float32)
    above = np.array([one + 0x8001], np.uint32).view(np.float32)
    assert c.decode(c.encode(tie_down))[0] == 1.0
    assert c.decode(c.encode(tie_up))[0] == np.float32(1 + 2**-6)
    assert c.decode(c.encode(above))[0] == np.float32(1 + 2**-7)
    sp = np.array([np.inf, -np.inf, np.nan], np.float32)
    y = c.decode(c.encode(sp))
    assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2])


def test_int8_within_half_a_step_per_row():
    x = _data()
    c = Int8RowScale()
    enc = c.encode(x)
    assert enc.nbytes == x.size + 4 * x.shape[0]
    y = c.decode(enc)
    bound = np.abs(x).max(axis=1, keepdims=True) / 254
    assert np.all(np.abs(y - x) <= bound * (1 + 1e-6))
    # Each row's largest magnitude is exact up to float rounding of the scale.
    i = np.abs(x).argmax(axis=1)
    np.testing.assert_allclose(y[np.arange(len(x)), i], x[np.arange(len(x)), i], rtol=1e-6)
    zero = np.zeros((3, 5), np.float32)
    np.testing.assert_array_equal(c.decode(c.encode(zero)), zero)


def test_int8_rows_run_along_the_last_axis():
    x = _data((4, 5, 6))
    c = Int8RowScale()
    enc = c.encode(x)
    assert enc.arrays[1].shape == (20,)
    y = c.decode(enc)
    assert y.shape == x.shape
    assert np.all(np.abs(y - x) <= np.abs(x).max(axis=2, keepdims=True) / 254 * (1 + 1e-6))


def test_topk_sends_the_largest_and_carries_the_residual_exactly():
    rng = np.random.default_rng(1)
    c = TopK(0.1)
    residual = np.zeros(300, np.float32)
    for step in range(5):
        g = rng.standard_normal((30, 10)).astype(np.float32)
        enc = c.encode(g)
        assert len(enc.arrays[0]) == 30 and enc.nbytes == 30 * 8
        sent = c.decode(enc)
        acc = g.reshape(-1) + residual
        # What was sent is the 30 largest |g + residual|, and nothing is lost: bit for bit,
        # sent + new residual == g + old residual.
        nz = np.flatnonzero(sent.reshape(-1))
        assert np.abs(acc[nz]).min() >= np.abs(np.delete(acc, nz)).max()
        np.testing.assert_array_equal(sent.reshape(-1) + c.residual, acc)
        np.testing.assert_array_equal(c.residual[nz], 0)
        residual = c.residual.copy()
    assert np.abs(residual).sum() > 0


def test_topk_over_steps_delivers_everything_in_the_end():
    # A constant gradient through a 1/4 top-k stream: after 4 steps of zeros every entry went out.
    c = TopK(0.25)
    g = np.arange(1, 9, dtype=np.float32)
    total = c.decode(c.encode(g))
    for _ in range(3):
        total = total + c.decode(c.encode(np.zeros(8, np.float32)))
    np.testing.assert_array_equal(total, g)
    np.testing.assert_array_equal(c.residual, 0)


def test_byte_counter_per_kind():
    bc = ByteCounter()
    x = _data((8, 16))
    bc.encode(BFloat16(), "gradients", x)
    bc.encode(Int8RowScale(), "activations", x)
    bc.encode(Int8RowScale(), "activations", x)
    d = bc.as_dict()
    assert set(d) == set(TRAFFIC_KINDS)
    assert d["gradients"] == {"before": 512, "after": 256}
    assert d["activations"] == {"before": 1024, "after": 2 * (128 + 32)}
    assert d["averaging"] == {"before": 0, "after": 0}
    with pytest.raises(ValueError, match="unknown traffic kind 'dense'"):
        bc.add("dense", 1, 1)


def test_make_codec_names():
    assert isinstance(make_codec("none"), NoCodec)
    assert isinstance(make_codec("bf16"), BFloat16)
    assert isinstance(make_codec("int8"), Int8RowScale)
    t = make_codec("topk:0.05")
    assert isinstance(t, TopK) and t.ratio == 0.05
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        make_codec("fp8")
    with pytest.raises(ValueError, match="topk needs a ratio"):
        make_codec("topk")
    with pytest.raises(ValueError, match="bf16 takes no argument"):
        make_codec("bf16:2")
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 1.5"):
        make_codec("topk:1.5")
    with pytest.raises(TypeError, match="codec must be a string"):
        make_codec(8)


@pytest.mark.parametrize("codec", [NoCodec(), BFloat16(), Int8RowScale(), TopK(0.5)])
def test_bad_inputs_are_named(codec):
    with pytest.raises(TypeError, match=f"{codec.name}: x must be float32, got float64"):
        codec.encode(np.zeros((2, 3)))
    with pytest.raises(TypeError, match=f"{codec.name}: x must be a numpy array, got list"):
        codec.encode([1.0, 2.0])
    with pytest.raises(TypeError, match="expected an Encoded payload"):
        codec.decode(np.zeros(3, np.float32))
    other = BFloat16() if codec.name != "bf16" else NoCodec()
    with pytest.raises(ValueError, match=f"was encoded by '{other.name}'"):
        codec.decode(other.encode(np.zeros(3, np.float32)))


def test_bad_payloads_and_shapes_are_named():
    with pytest.raises(ValueError, match="int8.encode: x must have at least one axis"):
        Int8RowScale().encode(np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="int8.encode: row 1 holds a non-finite value"):
        Int8RowScale().encode(np.array([[1, 2], [np.inf, 0]], np.float32))
    enc = Int8RowScale().encode(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"int8.decode: values \(2, 3\) and scales \(1,\) do not make"):
        Int8RowScale().decode(Encoded("int8", (2, 3), (enc.arrays[0], enc.arrays[1][:1])))
    with pytest.raises(ValueError, match="bf16.decode: 3 values of uint16 for shape"):
        BFloat16().decode(Encoded("bf16", (2, 2), (np.zeros(3, np.uint16),)))
    with pytest.raises(ValueError, match=r"topk.decode: an index outside \[0, 4\)"):
        TopK(0.5).decode(Encoded("topk", (4,), (np.array([4], np.int32), np.ones(1, np.float32))))
    t = TopK(0.5)
    t.encode(np.ones(6, np.float32))
    with pytest.raises(ValueError, match=r"carries a residual of 6 values, got an array of shape \(7,\)"):
        t.encode(np.ones(7, np.float32))


def test_codec_streams_keep_a_residual_per_tensor():
    # (A kind whose top-k keeps a residual: not activations or gradients, which keep none.)
    s = CodecStreams({"averaging": "topk:0.5", "activations": "int8"})
    a, b = s.get("averaging", "a"), s.get("averaging", "b")
    assert a is not b and s.get("averaging", "a") is a
    assert s.get("activations", 0).name == "int8" and s.get("gradients", 0).name == "none"
    a.encode(np.ones(4, np.float32))
    b.encode(np.ones(6, np.float32))  # another tensor's stream: no clash of residual shapes
    assert a.residual.shape == (4,) and b.residual.shape == (6,)
    with pytest.raises(ValueError, match="codecs: unknown traffic kind.s. dense"):
        CodecStreams({"dense": "bf16"})
    with pytest.raises(ValueError, match="codecs: gradients: unknown codec 'fp4'"):
        CodecStreams({"gradients": "fp4"})
    with pytest.raises(ValueError, match="unknown traffic kind 'x'"):
        s.get("x", 0)


def test_decode_reads_any_payload():
    x = _data((4, 8))
    for c in (NoCodec(), BFloat16(), Int8RowScale(), TopK(0.25)):
        enc = c.encode(x)
        np.testing.assert_array_equal(decode(enc), c.decode(enc))
    with pytest.raises(ValueError, match="decode: a payload of unknown codec 'zstd'"):
        decode(Encoded("zstd", (1,), ()))


def test_topk_without_feedback_sends_each_message_on_its_own():
    c = TopK(0.25, feedback=False)
    a = np.array([8, 1, 2, 3], np.float32)
    np.testing.assert_array_equal(c.decode(c.encode(a)), [8, 0, 0, 0])
    # Nothing carried: the 3 left out above does not come back, and any shape goes.
    np.testing.assert_array_equal(c.decode(c.encode(np.array([0, 1, 2, 0], np.float32))), [0, 0, 2, 0])
    assert c.residual is None
    assert c.decode(c.encode(np.ones(8, np.float32))).sum() == 2
    s = CodecStreams({"activations": "topk:0.5", "gradients": "topk:0.5", "averaging": "topk:0.5"})
    assert not s.get("activations", 0).feedback and not s.get("gradients", 0).feedback
    assert s.get("averaging", 0).feedback  # (refused by hps.hierarchical.easgd)


FLT_MAX = float(np.finfo(np.float32).max)
_finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
_rows = arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 9)), elements=_finite)


@settings(max_examples=400, deadline=None)
@given(_rows)
@example(np.array([[FLT_MAX, -FLT_MAX / 3], [-FLT_MAX, 1.0]], np.float32))  # decoded as inf before
@example(np.array([[3.6055052e16, 5.0043623e16]], np.float32))  # a tie, and the decoded value's rounding
def test_int8_bound_holds_over_all_of_float32(x):
    # The module's stated bound: max|row| / 254, up to float32's rounding (a relative
    # 2**-15 more), for every row whose scale is a normal float32; every row decodes finite.
    c = Int8RowScale()
    y = c.decode(c.encode(x))
    assert np.isfinite(y).all()
    amax = np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    err = np.abs(y.astype(np.float64) - x)
    normal = amax >= 127 * 2.0**-126
    assert np.all((err <= amax / 254 * (1 + 2.0**-15)) | ~normal), (x, y)
    assert np.all(err <= amax)  # (below: the scale loses bits, never more than the row's size)


@settings(max_examples=400, deadline=None)
@given(arrays(np.float32, st.integers(1, 16), elements=st.floats(width=32)))
@example(np.array([2.0**-149, 3e-40, 1.2e-38, -1e-39], np.float32))  # subnormals: half bf16's step
def test_bf16_bound_holds_over_all_of_float32(x):
    c = BFloat16()
    y = c.decode(c.encode(x))
    assert np.array_equal(np.isnan(y), np.isnan(x))
    keep = np.isfinite(x) & np.isfinite(y)  # (a rounding past float32's largest value goes to inf)
    assert np.all(y[np.isinf(x)] == x[np.isinf(x)])
    err = np.abs(y[keep].astype(np.float64) - x[keep])
    xs = np.abs(x[keep].astype(np.float64))
    assert np.all(np.where(xs >= 2.0**-126, err <= xs * 2.0**-8, err <= 2.0**-134)), (x, y)
    assert np.all(np.isinf(y[np.isfinite(x) & ~keep]) & (np.abs(x[np.isfinite(x) & ~keep]) > 3.3e38))


@pytest.mark.parametrize("ratio, size, k", [(0.07, 100, 7), (0.1, 30, 3), (0.1, 31, 4), (1 / 3, 3, 1), (0.5, 3, 2),
                                            (0.001, 10, 1), (1.0, 7, 7), (0.25, 0, 0)])
def test_topk_sends_ceil_of_the_ratio_as_written_times_the_size(ratio, size, k):
    # In floats 0.07 * 100 is 7.000000000000001: its ceiling sent 8 of 100 values.
    codec = TopK(ratio)
    assert codec.k_of(size) == k
    if size:
        enc = codec.encode(np.arange(1, size + 1, dtype=np.float32))
        assert len(enc.arrays[0]) == k
