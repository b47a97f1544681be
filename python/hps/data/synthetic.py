"""SyntheticCriteo: Criteo-like examples from a hidden logistic model, with no download.

Zipf-skewed ids per field, log-normal counts, labels drawn from a logit that
:meth:`SyntheticCriteo.hidden_logit` gives back, so a model can learn something
and its AUC has a known ceiling; ``write_tsv`` writes the stream as a Criteo TSV file.
"""
from __future__ import annotations

import io
import math
from typing import Iterator, Optional, Sequence

import numpy as np

from hps.data.criteo import CATEGORICAL_COLUMNS, DENSE_COLUMNS, dense_transform
from hps.data.examples import Bags, Batch, _check_batching, _Piece, _rebatch, _sources_of
from hps.data.files import _open_binary_for_writing
from hps.data.keys import _MIX2, _field_tag, _field_tags, _keys

#: Criteo Kaggle's per-field cardinalities, clipped to [10, 1_000_000].
DEFAULT_VOCAB_SIZES: tuple[int, ...] = (
    1460, 583, 1_000_000, 1_000_000, 305, 24, 12517, 633, 10, 93145, 5683, 1_000_000, 3194,
    27, 14992, 1_000_000, 10, 5652, 2173, 10, 1_000_000, 18, 15, 286181, 105, 142572,
)

#: What SyntheticCriteo takes (hps.train checks a config's data fields by these).
MAX_VOCABULARY = 1 << 31          # a field's vocabulary, single- or multi-hot
MAX_MEAN_BAG_LENGTH = 1000        # a multi-hot field's mean bag length
BAG_LENGTHS = ("poisson", "geometric", "fixed")

# DO NOT CHANGE these without meaning to change every synthetic stream: the
# example stream is generated in blocks of _BLOCK examples (so it does not
# depend on batch_size), block b of part p from SeedSequence(seed, (p, b)).
_BLOCK = 4096
_PARTS = {"train": 0, "eval": 1}
_CALIBRATION_PART = 2
_PARAMETER_PART = 3
_CALIBRATION_EXAMPLES = 16384
# Ranks up to _ZIPF_HEAD are drawn exactly from a table; above it from the
# continuous power law rounded to the nearest integer, whose probability of k
# is within a(a+1)/(24 k^2) (< 1e-4 here) of the exact Zipf one.
_ZIPF_HEAD = 64
# Cells of the table that maps a uniform to a head rank without a binary search.
_ZIPF_CELLS = 4096
# Scales the hidden weights; sets the Bayes AUC (0.80 to 0.85 with the defaults).
_SIGNAL = 0.65


class SyntheticCriteo:
    """Criteo-like examples from a hidden logistic model; deterministic by seed.

    Field f (0..len(vocab_sizes)-1) takes ids in [0, vocab_sizes[f]): a rank
    r >= 1 is drawn with P(r) ~ r**-zipf_a (truncated to the vocabulary) and
    mapped to an id by a fixed permutation of the field (an affine map mod the
    vocabulary size, so ids are not ordered by frequency and nothing is
    stored). A value is missing with probability ``cat_missing``. Dense
    features are log-normal counts, missing with probability
    ``dense_missing``.

    The label is Bernoulli(sigmoid(logit)), where logit = bias + sum over
    fields of w(key) + dense . v, see :meth:`hidden_logit`. w(key) comes from
    hashing (seed, key) into a uniform value of unit variance times a
    per-field scale: a vocabulary of a million costs no memory. The bias is
    solved at construction so that the expected CTR is ``ctr`` (with the
    defaults, the CTR of 100k examples is within 0.25 +- 0.01 for seeds 0-7).
    Frequent ids are seen often enough to learn their weights; tail ids are
    noise, as in real logs. The hidden logit ranks the labels with an AUC of
    0.80 to 0.85 (seeds 0-7), the ceiling for any model of these data.

    ``part`` selects an independent example stream of the same model: train a
    model on "train" and measure it on "eval". ``rank``/``world`` split a
    stream among nodes by blocks of 4096 examples (node r gets blocks r,
    r + world, ...); ``examples`` is the total over all nodes (None: endless).
    The stream does not depend on batch_size. ``write_tsv`` writes it as a
    Criteo TSV file, which :class:`CriteoTsv` reads back to the same batches.

    ``multi_hot``: (vocabulary size, mean bag length) of each multi-hot field,
    whose bags come in ``Batch.bags`` (fields numbered after the single-hot ones).
    A bag's length is drawn by ``bag_length``: "poisson" (of the mean),
    "geometric" (0, 1, 2, ... with that mean: a long tail) or "fixed"; its ids
    are skewed to the small ones (V * u**3, u uniform) and its share of the
    logit is the sum of its keys' weights over the square root of its length. Bags are drawn from their own seeds,
    so the rest of the stream is the same with or without them.

    >>> gen = SyntheticCriteo(seed=7, batch_size=1000, examples=2000)
    >>> a, b = list(gen), list(SyntheticCriteo(seed=7, batch_size=500, examples=2000))
    >>> bool((a[1].keys[500:] == b[3].keys).all())
    True
    """

    def __init__(self, seed: int = 0, *, vocab_sizes: Sequence[int] = DEFAULT_VOCAB_SIZES,
                 zipf_a: float = 1.1, n_dense: int = 13, batch_size: int = 4096,
                 examples: Optional[int] = None, part: str = "train", rank: int = 0, world: int = 1,
                 drop_last: bool = False, ctr: float = 0.25, cat_missing: float = 0.05,
                 dense_missing: float = 0.1, multi_hot: Sequence[tuple[int, float]] = (),
                 bag_length: str = "poisson"):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        _check_batching(batch_size, rank, world)
        if part not in _PARTS:
            raise ValueError(f"part must be one of {sorted(_PARTS)}, got {part!r}")
        vocab = np.asarray(vocab_sizes, dtype=np.int64)
        if vocab.ndim != 1 or len(vocab) == 0 or (vocab < 1).any() or (vocab > MAX_VOCABULARY).any():
            raise ValueError("vocab_sizes must be a non-empty list of ints in [1, 2**31]")
        if not zipf_a >= 0:
            raise ValueError(f"zipf_a must be >= 0, got {zipf_a}")
        if not 0 < ctr < 1:
            raise ValueError(f"ctr must be in (0, 1), got {ctr}")
        for name, p in (("cat_missing", cat_missing), ("dense_missing", dense_missing)):
            if not 0 <= p < 1:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if examples is not None and examples < 0:
            raise ValueError(f"examples must be >= 0 or None, got {examples}")
        if n_dense < 0:
            raise ValueError(f"n_dense must be >= 0, got {n_dense}")
        for j, field in enumerate(multi_hot):
            if (not isinstance(field, (tuple, list)) or len(field) != 2 or not 1 <= field[0] <= MAX_VOCABULARY
                    or not 0 <= field[1] <= MAX_MEAN_BAG_LENGTH):
                raise ValueError(f"multi_hot[{j}] must be (vocabulary size in [1, 2**31], mean bag length in "
                                 f"[0, 1000]), got {field!r}")
        if bag_length not in BAG_LENGTHS:
            raise ValueError(f"bag_length must be 'poisson', 'geometric' or 'fixed', got {bag_length!r}")
        self.multi_hot = tuple((int(v), float(m)) for v, m in multi_hot)
        self.bag_length = bag_length
        self.seed, self.part, self.rank, self.world = int(seed), part, int(rank), int(world)
        self.vocab_sizes = tuple(int(v) for v in vocab)
        self.zipf_a, self.n_dense, self.ctr = float(zipf_a), int(n_dense), float(ctr)
        self.cat_missing, self.dense_missing = float(cat_missing), float(dense_missing)
        self.batch_size, self.drop_last = int(batch_size), bool(drop_last)
        self.examples = None if examples is None else int(examples)
        n_cat = len(vocab)
        self._tags = _field_tags(n_cat)

        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_PARAMETER_PART,)))
        # Permutation id = (rank - 1) * mul + add (mod V), mul coprime to V.
        self._perm_mul = np.empty(n_cat, np.int64)
        self._perm_add = np.empty(n_cat, np.int64)
        for f, v in enumerate(self.vocab_sizes):
            mul = int(rng.integers(1, v)) if v > 1 else 1
            while math.gcd(mul, v) != 1:
                mul += 1
            # (rank - 1) * mul + add == rank * mul + (add - mul): one pass less.
            self._perm_mul[f], self._perm_add[f] = mul, (int(rng.integers(0, v)) - mul) % v
        # Field weight scales: a few fields carry most of the signal, as in real logs.
        self._field_scale = _SIGNAL * (0.15 + 0.55 * rng.random(n_cat) ** 2)
        self._dense_mu = rng.uniform(0.5, 4.0, self.n_dense)
        self._dense_sigma = rng.uniform(0.5, 1.5, self.n_dense)
        self._dense_weight = rng.normal(0.0, 0.25, self.n_dense)
        self._weight_salt = np.uint64(int(rng.integers(0, (1 << 63) - 1)) * 2 + 1)
        # Drawn from a generator of their own: the draws above stay the same with multi-hot fields.
        bag_rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_PARAMETER_PART, 1)))
        self._bag_scale = _SIGNAL * (0.3 + 0.7 * bag_rng.random(len(self.multi_hot)))
        self._u_weight = self._field_scale * math.sqrt(12.0) * 2.0 ** -53
        self._u_offset = -0.5 * math.sqrt(12.0) * float(self._field_scale.sum())
        self._setup_zipf()
        self.bias = 0.0
        self.bias = self._calibrate()

    # -- the hidden model

    def hidden_logit(self, batch: Batch) -> np.ndarray:
        """The ground-truth logit (float64, (n,)) of the model that drew the labels.

        Reads only ``batch.keys`` and ``batch.dense``, so it also works on the
        batches a reader gets from this generator's ``write_tsv`` output.
        """
        keys = np.asarray(batch.keys, np.uint64)
        if keys.ndim != 2 or keys.shape[1] != len(self.vocab_sizes):
            raise ValueError(f"keys must have shape (n, {len(self.vocab_sizes)}), got {keys.shape}")
        # w(key) = scale[f] * sqrt(12) * (u - 1/2), u uniform on [0, 1) from the
        # top 53 bits of (key ^ salt) * odd: the key is already a strong hash, so
        # one multiplication decorrelates the seeds. The constant part of the
        # sum and the scales are folded into _u_weight and _u_offset.
        with np.errstate(over="ignore"):
            h = (keys ^ self._weight_salt) * _MIX2
        logit = (h >> np.uint64(11)).astype(np.float64) @ self._u_weight + (self.bias + self._u_offset)
        for j, bags in enumerate(getattr(batch, "bags", ())[:len(self.multi_hot)]):
            # The mean of the bag's keys' weights (centred uniforms, as above); an empty bag adds 0.
            with np.errstate(over="ignore"):
                hb = (np.asarray(bags.keys, np.uint64) ^ self._weight_salt) * _MIX2
            w = ((hb >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 - 0.5) * (math.sqrt(12.0) * self._bag_scale[j])
            lengths = np.diff(bags.offsets)
            rows = np.repeat(np.arange(len(lengths)), lengths)
            # Summed over the bag and scaled by 1/sqrt(length), so that a bag weighs as much as a
            # single-hot field whatever its length.
            logit += np.bincount(rows, weights=w, minlength=len(lengths)) / np.sqrt(np.maximum(lengths, 1))
        if self.n_dense:
            # Roughly centred, so that the dense term shifts the bias little.
            centre = np.maximum(self._dense_mu, 0.0) * (1.0 - self.dense_missing)
            logit += (np.asarray(batch.dense, np.float64) - centre) @ self._dense_weight
        return logit

    def _calibrate(self) -> float:
        """The bias that makes the mean predicted CTR equal self.ctr (bisection)."""
        raw = self._raw(np.random.SeedSequence(self.seed, spawn_key=(_CALIBRATION_PART,)), _CALIBRATION_EXAMPLES)
        piece = self._piece_of(raw, np.zeros(0, np.int64), draw_labels=False,
                               bags=self._bags(_CALIBRATION_PART, 0, _CALIBRATION_EXAMPLES))
        logit0 = self.hidden_logit(Batch(piece.labels, piece.dense, piece.keys, (), piece.bags))
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(logit0 + mid)))) < self.ctr:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    # -- Zipf ranks

    def _setup_zipf(self):
        a = self.zipf_a
        cdf = np.cumsum(np.arange(1, _ZIPF_HEAD + 1, dtype=np.float64) ** -a)
        self._zipf_cdf = np.append(cdf, np.inf)  # the inf stops the correction at the last head rank
        # The rank at the start of each of _ZIPF_CELLS equal cells of [0, cdf[-1]),
        # and how many rank boundaries a cell may hold (1 unless zipf_a is large).
        starts = np.arange(_ZIPF_CELLS) * (cdf[-1] / _ZIPF_CELLS)
        self._zipf_cell = np.searchsorted(cdf, starts, side="right").astype(np.int64) + 1
        self._zipf_cell_scale = _ZIPF_CELLS / cdf[-1]
        ends = np.append(self._zipf_cell[1:], _ZIPF_HEAD)
        self._zipf_steps = int((ends - self._zipf_cell).max(initial=0))
        # The first boundary after each cell's start: with one boundary per cell
        # (the usual case) the rank is _zipf_cell[c] + (t >= _zipf_bound[c]).
        self._zipf_bound = cdf[self._zipf_cell - 1]
        vocab = np.asarray(self.vocab_sizes, np.float64)
        self._zipf_h = np.minimum(vocab, _ZIPF_HEAD)
        self._zipf_head_mass = cdf[self._zipf_h.astype(np.int64) - 1]
        self._zipf_f_h = self._zipf_F(self._zipf_h + 0.5)
        tail = np.where(vocab > _ZIPF_HEAD, self._zipf_F(vocab + 0.5) - self._zipf_f_h, 0.0)
        self._zipf_total = self._zipf_head_mass + tail
        self._zipf_lo = self._zipf_h.astype(np.int64) + 1
        self._zipf_hi = np.asarray(self.vocab_sizes, np.int64)
        # The tail inverse, F^-1(F(h + 1/2) + max(t - head_mass, 0)), as
        # exp(k * log(c * max(t - head_mass, 0) + d)): one log and one exp
        # (numpy's float ** is several times slower).
        if a == 1.0:
            self._zipf_c, self._zipf_d, self._zipf_k = 1.0, self._zipf_h + 0.5, 1.0
        else:
            self._zipf_c, self._zipf_d, self._zipf_k = 1.0 - a, (1.0 - a) * self._zipf_f_h, 1.0 / (1.0 - a)

    def _zipf_F(self, x):
        """An antiderivative of x**-a."""
        a = self.zipf_a
        return np.log(x) if a == 1.0 else x ** (1.0 - a) / (1.0 - a)

    def _ranks(self, t: np.ndarray) -> np.ndarray:
        """Zipf ranks (1-based, int64) from t, uniform on [0, _zipf_total[f]) in column f.

        Head ranks: the rank at the start of t's cell, moved up past the CDF
        boundaries inside the cell. Tail ranks: the continuous inverse, rounded.
        In-place operations: this is the generator's hottest loop.
        """
        cdf = self._zipf_cdf
        cell = (t * self._zipf_cell_scale).astype(np.int64)
        np.minimum(cell, _ZIPF_CELLS - 1, out=cell)
        ranks = self._zipf_cell[cell]
        if self._zipf_steps:
            ranks += t >= self._zipf_bound[cell]
        for _ in range(self._zipf_steps - 1):
            ranks += t >= cdf[ranks - 1]
        if (self._zipf_hi > _ZIPF_HEAD).any():
            y = t - self._zipf_head_mass
            np.maximum(y, 0.0, out=y)
            if self.zipf_a == 1.0:  # F = log: F^-1(log(h + 1/2) + s) = (h + 1/2) * exp(s)
                np.exp(y, out=y)
                y *= self._zipf_d
            else:
                y *= self._zipf_c
                y += self._zipf_d
                np.log(y, out=y)
                y *= self._zipf_k
                np.exp(y, out=y)
            y += 0.5
            tail = y.astype(np.int64)  # y > 0: truncation is floor
            np.minimum(tail, self._zipf_hi, out=tail)  # (np.clip is slower than the two)
            np.maximum(tail, self._zipf_lo, out=tail)
            ranks = np.where(t >= self._zipf_head_mass, tail, ranks)  # (faster than copyto(where=))
        return ranks

    # -- examples

    def _raw(self, seq: np.random.SeedSequence, n: int):
        """Raw values of n examples: (ids, cat_missing, dense_counts, dense_missing, label_uniforms)."""
        rng = np.random.default_rng(seq)
        n_cat = len(self.vocab_sizes)
        # One uniform u per value decides both: missing if u < m, else the rank
        # from (u - m) / (1 - m), which is uniform given u >= m.
        u = rng.random((n, n_cat))
        cat_missing = u < self.cat_missing
        u -= self.cat_missing
        u *= self._zipf_total / (1.0 - self.cat_missing)
        np.maximum(u, 0.0, out=u)
        ranks = self._ranks(u)
        ranks *= self._perm_mul
        ranks += self._perm_add
        ids = ranks % self._zipf_hi
        t = rng.standard_normal((n, self.n_dense), dtype=np.float32)
        t *= self._dense_sigma.astype(np.float32)
        t += self._dense_mu.astype(np.float32)
        np.maximum(t, np.float32(0), out=t)
        counts = np.expm1(t, out=t)
        np.floor(counts, out=counts)
        dense_missing = rng.random((n, self.n_dense), dtype=np.float32) < self.dense_missing
        counts[dense_missing] = 0
        return ids.view(np.uint64), cat_missing, counts, dense_missing, rng.random(n)

    def _bags(self, part: int, block: int, n: int) -> tuple:
        """The multi-hot fields' bags of the first n examples of a block (drawn whole, then cut)."""
        if not self.multi_hot:
            return ()
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(part, block, 1)))
        out, drawn = [], max(n, _BLOCK)
        for j, (vocab, mean) in enumerate(self.multi_hot):
            if self.bag_length == "poisson":
                lengths = rng.poisson(mean, drawn)
            elif self.bag_length == "geometric":
                lengths = rng.geometric(1.0 / (1.0 + mean), drawn) - 1  # support 0, 1, ...; mean `mean`
            else:
                lengths = np.full(drawn, int(round(mean)))
            ids = (vocab * rng.random(int(lengths.sum())) ** 3).astype(np.uint64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            keys = _keys(_field_tag(len(self.vocab_sizes) + j), ids, None)
            out.append(Bags(keys[:offsets[n]], offsets[:n + 1]))
        return tuple(out)

    def widths(self) -> tuple[int, int, int]:
        """(dense features, single-hot fields, multi-hot fields): the model's shape."""
        return self.n_dense, len(self.vocab_sizes), len(self.multi_hot)

    def _piece_of(self, raw, lines: np.ndarray, draw_labels: bool = True, bags: tuple = ()) -> _Piece:
        ids, cat_missing, counts, _, label_u = raw
        keys = _keys(self._tags, ids, cat_missing)
        dense = dense_transform(counts)
        labels = np.zeros(len(ids), np.float32)
        piece = _Piece(labels, dense, keys, _sources_of(f"synthetic:{self.part}", lines), bags)
        if draw_labels:
            p = 1.0 / (1.0 + np.exp(-self.hidden_logit(Batch(labels, dense, keys, (), bags))))
            labels[:] = label_u < p
        return piece

    def _blocks(self, total: Optional[int]) -> Iterator[tuple[int, int]]:
        """(block index, examples used from it) of this node's blocks among the first `total` examples
        of the stream (None: all)."""
        b = self.rank
        while total is None or b * _BLOCK < total:
            yield b, _BLOCK if total is None else min(_BLOCK, total - b * _BLOCK)
            b += self.world

    def _raw_blocks(self, total: Optional[int]):
        """(block index, raw values) of this node's blocks. A block is always drawn
        whole and then cut, so that a shorter stream is a prefix of a longer one."""
        part = _PARTS[self.part]
        for b, n in self._blocks(total):
            raw = self._raw(np.random.SeedSequence(self.seed, spawn_key=(part, b)), _BLOCK)
            yield b, tuple(r[:n] for r in raw)

    def _pieces(self) -> Iterator[_Piece]:
        for b, raw in self._raw_blocks(self.examples):
            start = b * _BLOCK + 1
            yield self._piece_of(raw, np.arange(start, start + len(raw[0])),
                                 bags=self._bags(_PARTS[self.part], b, len(raw[0])))

    def __iter__(self) -> Iterator[Batch]:
        """The stream from its start (every iteration yields the same batches)."""
        return _rebatch(self._pieces(), self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per pass on this node (a TypeError for an endless stream)."""
        if self.examples is None:
            raise TypeError("an endless SyntheticCriteo (examples=None) has no length")
        mine = sum(n for _, n in self._blocks(self.examples))
        return mine // self.batch_size if self.drop_last else -(-mine // self.batch_size)

    def write_tsv(self, path: str, examples: int) -> int:
        """Writes this node's first ``examples`` examples as a Criteo TSV file; returns the count.

        The file holds the raw values (counts and 8-digit hex ids; missing ones
        empty), so reading it with :class:`CriteoTsv` gives this generator's
        batches (the same as ``SyntheticCriteo(..., examples=examples)``'s on one
        node). ``path`` may be an fsspec URL; a ``.gz``, ``.bz2`` or ``.zst`` path is compressed.
        Needs 13 dense and 26 categorical fields and no multi-hot ones.
        """
        if self.multi_hot:
            raise ValueError("the Criteo format has no multi-hot fields; this generator has "
                             f"{len(self.multi_hot)}")
        if self.n_dense != len(DENSE_COLUMNS) or len(self.vocab_sizes) != len(CATEGORICAL_COLUMNS):
            raise ValueError(f"the Criteo format has {len(DENSE_COLUMNS)} dense and {len(CATEGORICAL_COLUMNS)} "
                             f"categorical fields; this generator has {self.n_dense} and {len(self.vocab_sizes)}")
        if examples < 0:
            raise ValueError(f"examples must be >= 0, got {examples}")
        out = _open_binary_for_writing(path)  # compressed as its name says, as CriteoTsv reads it
        written = 0
        with out:
            for _, raw in self._raw_blocks(None):
                if written >= examples:
                    break
                piece = self._piece_of(raw, np.zeros(0, np.int64))
                k = min(len(piece), examples - written)
                out.write(_tsv_lines(piece.labels[:k], tuple(r[:k] for r in raw)))
                written += k
        return written

    def __repr__(self) -> str:
        return (f"SyntheticCriteo(seed={self.seed}, part={self.part!r}, examples={self.examples}, "
                f"batch_size={self.batch_size}, fields={len(self.vocab_sizes)}, zipf_a={self.zipf_a})")


_HEX_CHARS = np.frombuffer(b"0123456789abcdef", np.uint8)


def _tsv_lines(labels: np.ndarray, raw) -> bytes:
    """Criteo TSV text of examples given as labels and SyntheticCriteo._raw values."""
    ids, cat_missing, counts, dense_missing, _ = raw
    n = len(labels)
    # 8 hex digits per id, built as a byte matrix rather than by formatting each one.
    nibbles = (ids[:, :, None] >> (np.arange(28, -1, -4, dtype=np.uint64))) & np.uint64(15)
    hexes = _HEX_CHARS[nibbles.astype(np.intp)].view("S8")[:, :, 0]
    hexes = np.where(cat_missing, b"", hexes)
    ints = np.where(dense_missing, b"", counts.astype(np.int64).astype("S20"))
    cols = [np.where(labels > 0, b"1", b"0")] + [ints[:, j] for j in range(ints.shape[1])] + \
           [hexes[:, j] for j in range(hexes.shape[1])]
    out = io.BytesIO()
    for fields in zip(*(c.tolist() for c in cols), strict=True):
        out.write(b"\t".join(fields))
        out.write(b"\n")
    return out.getvalue() if n else b""
