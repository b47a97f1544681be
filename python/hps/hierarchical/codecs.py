"""Compression codecs for Hierarchical Training's traffic (KDD 2021, section 4.3).

Each codec turns a float32 array into a :class:`Encoded` payload and back:

  ``none``   float32 as is (4 bytes a value; exact).
  ``bf16``   bfloat16, the top 16 bits of each float32 rounded to nearest even
             (2 bytes a value). Error bound: |x - x'| <= 2**-8 |x| for every normal
             x (|x| >= 2**-126) whose rounding stays below float32's largest value,
             and |x - x'| <= 2**-134 (half bfloat16's step there) for a subnormal x
             (NaN stays NaN, +-inf stays +-inf).
  ``int8``   one signed byte a value with one float32 scale a row (the last axis):
             scale = max|row| / 127, q = round(x / scale). Error bound:
             |x - x'| <= scale / 2 = max|row| / 254, up to float32's rounding (of the
             scale, x / scale and the decoded value: at most a relative 2**-15 more),
             for every row whose scale is a normal float32
             (max|row| >= 127 * 2**-126, about 1.5e-36; below that the scale loses
             bits and the error can reach max|row|); a zero row is exact, and a row
             at float32's largest values decodes finite. Non-finite values are refused
             (they have no scale).
  ``topk``   top-k sparsification with error feedback: the stream adds the residual
             it kept from the previous step, sends the k = ceil(ratio * size) values
             of largest magnitude (int32 index + float32 value, 8 bytes each) and keeps
             the rest as the next residual. Exactly: decode(encode(g)) + new residual
             == g + old residual, bit for bit. A TopK object is one stream: use one per
             tensor that is sent every step. Not for ``averaging`` (an EASGD exchange
             sends the replica, not an update; hps.hierarchical.easgd refuses it).
             ``TopK(ratio, feedback=False)`` keeps no residual: each message sends
             its own k largest values and drops the rest. :class:`CodecStreams`
             uses it for ``activations`` and ``gradients``: their rows are a new
             batch's examples every step, and a residual carried over would add
             one example's unsent values into another's (the forward outputs of a
             batch would depend on the batches before it).

Traffic kinds (what HT sends): ``activations`` (forward, trainer <-> group PS),
``gradients`` (backward), ``averaging`` (dense EASGD exchange with the centre),
``sparse_rows`` and ``sparse_grads`` (embedding rows between ranks).
:class:`ByteCounter` counts the bytes of each kind before and after its codec.

>>> import numpy as np
>>> c = make_codec("int8")
>>> x = np.array([[1.0, -0.5, 0.25]], np.float32)
>>> enc = c.encode(x); enc.nbytes, x.nbytes
(7, 12)
>>> bool(np.all(np.abs(c.decode(enc) - x) <= 1.0 / 254))
True
"""
from __future__ import annotations

import abc
import math
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

import numpy as np

__all__ = ["TRAFFIC_KINDS", "PER_EXAMPLE_KINDS", "Encoded", "Codec", "NoCodec", "BFloat16", "Int8RowScale", "TopK",
           "ByteCounter", "CodecStreams", "decode", "make_codec", "refuse_unsendable"]

TRAFFIC_KINDS = ("activations", "gradients", "averaging", "sparse_rows", "sparse_grads")
# Kinds whose messages hold a batch's examples, other ones every step: no top-k residual.
PER_EXAMPLE_KINDS = ("activations", "gradients")


@dataclass
class Encoded:
    """A codec's payload: what crosses the network. `arrays` are the buffers sent;
    `shape` the decoded array's shape."""
    codec: str
    shape: tuple
    arrays: tuple

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays))


def _check_input(x, who: str, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{who}: {what} must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{who}: {what} must be float32, got {x.dtype}")
    return x


def _check_payload(enc: Encoded, name: str, count: int) -> None:
    if not isinstance(enc, Encoded):
        raise TypeError(f"{name}.decode: expected an Encoded payload, got {type(enc).__name__}")
    if enc.codec != name:
        raise ValueError(f"{name}.decode: the payload was encoded by {enc.codec!r}")
    if len(enc.arrays) != count:
        raise ValueError(f"{name}.decode: a payload of {len(enc.arrays)} arrays, expected {count}")


class Codec(abc.ABC):
    """Encodes float32 arrays for the network and decodes them back."""
    name = "codec"

    @abc.abstractmethod
    def encode(self, x: np.ndarray) -> Encoded: ...

    @abc.abstractmethod
    def decode(self, enc: Encoded) -> np.ndarray: ...

    def __repr__(self) -> str:
        return self.name


class NoCodec(Codec):
    name = "none"

    def encode(self, x: np.ndarray) -> Encoded:
        x = _check_input(x, self.name, "x")
        return Encoded(self.name, x.shape, (np.ascontiguousarray(x),))

    def decode(self, enc: Encoded) -> np.ndarray:
        _check_payload(enc, self.name, 1)
        (a,) = enc.arrays
        if a.dtype != np.float32 or a.size != math.prod(enc.shape):
            raise ValueError(f"none.decode: {a.size} values of {a.dtype} for shape {enc.shape}")
        return a.reshape(enc.shape)


class BFloat16(Codec):
    name = "bf16"
    # The largest float32 that rounds to a finite bfloat16 (0x7F7F7FFF): from
    # 0x7F7F8000 on, the rounding carries into the exponent and gives infinity.
    largest_finite_input = float(np.array(0x7F7F7FFF, np.uint32).view(np.float32))

    def encode(self, x: np.ndarray) -> Encoded:
        x = _check_input(x, self.name, "x")
        bits = np.ascontiguousarray(x).view(np.uint32)
        # Round to nearest, ties to even, on the 16 bits dropped; NaN keeps a quiet NaN
        # (the rounding could carry a NaN's payload into the infinity pattern).
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        out = (rounded >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            out[nan] = np.uint16(0x7FC0)
        return Encoded(self.name, x.shape, (out,))

    def decode(self, enc: Encoded) -> np.ndarray:
        _check_payload(enc, self.name, 1)
        (a,) = enc.arrays
        if a.dtype != np.uint16 or a.size != math.prod(enc.shape):
            raise ValueError(f"bf16.decode: {a.size} values of {a.dtype} for shape {enc.shape} (expected uint16)")
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(enc.shape)


def refuse_unsendable(x: np.ndarray, codec: str, what: str, why: str) -> None:
    """Raises DivergedError where x (float32, any shape) holds a NaN or an infinity,
    or, under the codec named "bf16", a finite value that bfloat16 rounds to an
    infinity (past BFloat16.largest_finite_input): "<what> holds N values that ...
    (index I first: V): training diverged (<why>)", `why` saying where the codec
    would carry them. For a sender to call before x leaves it: bf16 and none carry such a
    value as it is (int8 refuses one, top-k sends it). One pass over x."""
    flat = x.reshape(-1)
    if codec == "bf16":
        ok = np.abs(flat) <= np.float32(BFloat16.largest_finite_input)  # (False for a NaN too)
    else:
        ok = np.isfinite(flat)
    if ok.all():
        return
    from hps.errors import DivergedError
    bad = np.flatnonzero(~ok)
    n, first = len(bad), int(bad[0])
    said = "1 value" if n == 1 else f"{n} values"
    is_are = "is" if n == 1 else "are"
    if codec == "bf16" and np.isfinite(flat[bad]).any():
        kind = (f"that bfloat16 rounds to an infinity (past {BFloat16.largest_finite_input:.7g}) or that {is_are} "
                f"not a number")
    else:
        kind = "that " + is_are + " not finite"
    raise DivergedError(f"{what} holds {said} {kind} (index {first} first: {flat[first]!s}): training diverged "
                        f"({why})")


class Int8RowScale(Codec):
    name = "int8"

    def encode(self, x: np.ndarray) -> Encoded:
        x = _check_input(x, self.name, "x")
        if x.ndim == 0:
            raise ValueError("int8.encode: x must have at least one axis (rows run along the last), got a scalar")
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1]) if x.size else x.reshape(-1, max(1, x.shape[-1]))
        if rows.size and not np.isfinite(rows).all():
            bad = int(np.nonzero(~np.isfinite(rows).all(axis=1))[0][0])
            raise ValueError(f"int8.encode: row {bad} holds a non-finite value (no scale can represent it)")
        amax = np.abs(rows).max(axis=1) if rows.size else np.zeros(len(rows), np.float32)
        scale = (amax / np.float32(127)).astype(np.float32)
        # A scale rounded up past FLT_MAX / 127 would decode a row's largest value as
        # inf: one step down (the quotient then clips to 127, a rounding's worth off).
        with np.errstate(over="ignore"):
            over = np.isinf(scale * np.float32(127))
        if over.any():
            scale[over] = np.nextafter(scale[over], np.float32(0))
        safe = np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
        return Encoded(self.name, x.shape, (q, scale))

    def decode(self, enc: Encoded) -> np.ndarray:
        _check_payload(enc, self.name, 2)
        q, scale = enc.arrays
        if q.dtype != np.int8 or scale.dtype != np.float32:
            raise ValueError(f"int8.decode: expected int8 values and float32 scales, got {q.dtype}, {scale.dtype}")
        if q.ndim != 2 or scale.shape != (q.shape[0],) or q.size != math.prod(enc.shape):
            raise ValueError(f"int8.decode: values {q.shape} and scales {scale.shape} do not make shape {enc.shape}")
        return (q.astype(np.float32) * scale[:, None]).reshape(enc.shape)


class TopK(Codec):
    """One stream of top-k sparsification with error feedback (see the module's
    docstring). `ratio` in (0, 1]: the share of values sent each step.
    `feedback` False: no residual is kept (each message on its own)."""
    name = "topk"

    def __init__(self, ratio: float, feedback: bool = True):
        if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
            raise ValueError(f"topk: ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self.feedback = bool(feedback)
        self.residual: Optional[np.ndarray] = None

    def __repr__(self) -> str:
        return f"topk:{self.ratio:g}"

    def k_of(self, size: int) -> int:
        """ceil(ratio * size), at least 1, of the ratio as written (its shortest
        decimal): in floats, 0.07 * 100 is 7.000000000000001, which took 8 values."""
        if not size:
            return 0
        exact = Fraction(repr(self.ratio))
        return min(size, max(1, -(-exact.numerator * size // exact.denominator)))

    def encode(self, x: np.ndarray) -> Encoded:
        x = _check_input(x, self.name, "x")
        flat = x.reshape(-1)
        if not self.feedback:
            acc = flat  # (only read)
        elif self.residual is None:
            acc = flat.copy()  # (becomes the residual)
        elif self.residual.shape != flat.shape:
            raise ValueError(f"topk.encode: this stream carries a residual of {self.residual.size} values, got "
                             f"an array of shape {x.shape} ({flat.size} values); use one TopK per tensor")
        else:
            acc = flat + self.residual
        k = self.k_of(acc.size)
        if k == acc.size:
            idx = np.arange(acc.size, dtype=np.int64)
        else:
            idx = np.argpartition(np.abs(acc), acc.size - k)[acc.size - k:]
            idx.sort()
        values = acc[idx]
        if self.feedback:
            acc[idx] = 0.0
            self.residual = acc
        return Encoded(self.name, x.shape, (idx.astype(np.int32), values.astype(np.float32)))

    def decode(self, enc: Encoded) -> np.ndarray:
        _check_payload(enc, self.name, 2)
        idx, values = enc.arrays
        size = math.prod(enc.shape)
        if idx.dtype != np.int32 or values.dtype != np.float32 or idx.shape != values.shape:
            raise ValueError(f"topk.decode: expected int32 indices and float32 values of one length, got "
                             f"{idx.dtype}{idx.shape}, {values.dtype}{values.shape}")
        if len(idx) and (idx.min() < 0 or idx.max() >= size):
            raise ValueError(f"topk.decode: an index outside [0, {size}) for shape {enc.shape}")
        out = np.zeros(size, np.float32)
        out[idx] = values
        return out.reshape(enc.shape)


def make_codec(spec: str) -> Codec:
    """A codec from its config name: "none", "bf16", "int8" or "topk:RATIO"."""
    if not isinstance(spec, str):
        raise TypeError(f"codec must be a string ('none', 'bf16', 'int8', 'topk:0.1'), got {spec!r}")
    name, _, arg = spec.partition(":")
    if name == "topk":
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(f"codec {spec!r}: topk needs a ratio, e.g. 'topk:0.1'") from None
        return TopK(ratio)
    if arg:
        raise ValueError(f"codec {spec!r}: {name} takes no argument")
    known = {"none": NoCodec, "bf16": BFloat16, "int8": Int8RowScale}
    if name not in known:
        raise ValueError(f"unknown codec {spec!r}; known: none, bf16, int8, topk:RATIO")
    return known[name]()


_DECODERS = {"none": NoCodec(), "bf16": BFloat16(), "int8": Int8RowScale(), "topk": TopK(1.0)}


def decode(enc: Encoded) -> np.ndarray:
    """Decodes any codec's payload (decoding keeps no state, top-k's included)."""
    if not isinstance(enc, Encoded):
        raise TypeError(f"decode: expected an Encoded payload, got {type(enc).__name__}")
    if enc.codec not in _DECODERS:
        raise ValueError(f"decode: a payload of unknown codec {enc.codec!r}")
    return _DECODERS[enc.codec].decode(enc)


class CodecStreams:
    """The codec of each traffic kind, one stream per (kind, key): a top-k codec
    keeps each tensor's residual apart. `spec` maps kinds to codec names; a kind
    not named is sent as float32. Top-k of ``activations`` and ``gradients`` keeps
    no residual (:data:`PER_EXAMPLE_KINDS`: a message's rows are other examples
    every step).

    >>> s = CodecStreams({"activations": "int8", "gradients": "topk:0.1"})
    >>> s.get("activations", 3).name, s.get("averaging", 0).name
    ('int8', 'none')
    """

    def __init__(self, spec: Optional[dict] = None):
        spec = dict(spec or {})
        unknown = sorted(set(spec) - set(TRAFFIC_KINDS))
        if unknown:
            raise ValueError(f"codecs: unknown traffic kind(s) {', '.join(unknown)}; known: {', '.join(TRAFFIC_KINDS)}")
        for kind, name in spec.items():
            try:
                make_codec(name)
            except (TypeError, ValueError) as e:
                raise ValueError(f"codecs: {kind}: {e}") from None
        self.spec = {k: spec.get(k, "none") for k in TRAFFIC_KINDS}
        self._streams: dict = {}
        self._lock = threading.Lock()

    def get(self, kind: str, key) -> Codec:
        if kind not in self.spec:
            raise ValueError(f"unknown traffic kind {kind!r}; known: {', '.join(TRAFFIC_KINDS)}")
        with self._lock:
            c = self._streams.get((kind, key))
            if c is None:
                c = make_codec(self.spec[kind])
                if isinstance(c, TopK) and kind in PER_EXAMPLE_KINDS:
                    c.feedback = False
                self._streams[kind, key] = c
            return c


@dataclass
class ByteCounter:
    """Bytes per traffic kind before (float32) and after its codec. Thread-safe."""
    before: dict = field(default_factory=lambda: {k: 0 for k in TRAFFIC_KINDS})
    after: dict = field(default_factory=lambda: {k: 0 for k in TRAFFIC_KINDS})

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, kind: str, raw: int, sent: int) -> None:
        if kind not in self.before:
            raise ValueError(f"unknown traffic kind {kind!r}; known: {', '.join(TRAFFIC_KINDS)}")
        with self._lock:
            self.before[kind] += int(raw)
            self.after[kind] += int(sent)

    def encode(self, codec: Codec, kind: str, x: np.ndarray) -> Encoded:
        """codec.encode(x), counted under `kind`."""
        enc = codec.encode(x)
        self.add(kind, x.nbytes, enc.nbytes)
        return enc

    def as_dict(self) -> dict:
        with self._lock:
            return {k: {"before": self.before[k], "after": self.after[k]} for k in TRAFFIC_KINDS}
