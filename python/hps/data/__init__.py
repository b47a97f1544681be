"""Training data: Criteo-format TSV and Parquet readers, and a synthetic Criteo.

Every source yields :class:`Batch` objects of the same shape, so a trainer does
not care where examples come from:

- ``labels`` float32 (n,), 0.0 or 1.0;
- ``dense``  float32 (n, 13), the integer features I1..I13 as
  ``log(1 + max(x, 0))``; a missing value counts as 0 (so it also maps to 0.0).
  Negative counts are clipped because the log needs x > -1 and Criteo's few
  negative values carry no more signal than 0 (the DLRM convention);
- ``keys``   uint64 (n, 26), one key per categorical field C1..C26 (Criteo is
  single-hot per field, so there are no offsets), from :func:`feature_keys`;
- ``sources``, where the rows came from (file, first line, count), so that an
  error found later can name the input line (:meth:`Batch.locate`).

Sources:

- :class:`CriteoTsv`: the raw Criteo format, one example per line, 40
  tab-separated fields (label, I1..I13, C1..C26), no header; empty fields are
  missing values. Parsed with pyarrow.csv; a per-line Python parser runs only
  on a block that the fast path rejects, to name the bad line, or to skip and
  count bad lines with ``skip_malformed=True``.
- :class:`CriteoParquet`: columns ``label, I1..I13, C1..C26``; categoricals as
  hex strings or integers (the same value gives the same key either way).
- :class:`SyntheticCriteo`: Zipf-skewed ids under a hidden logistic model, so
  that a model can learn something (AUC well above 0.5) without any download.
- :func:`open_criteo` picks the reader from the file names.
- Data of any other columns, laid out by a :class:`Schema` (``[data.schema]``):
  :class:`SchemaCsv` (CSV/TSV, header or not), :class:`SchemaParquet`,
  :class:`Libsvm` (libsvm/libFM text), picked by :func:`open_schema`
  (:mod:`hps.data.tabular`). Any categorical value is a feature
  (:func:`value_keys`); multi-hot fields arrive in ``Batch.bags`` (:class:`Bags`).
- :class:`GrowingDirectory`: a directory whose new files are read as they appear,
  until a stop condition (online training, :mod:`hps.data.online`); each file is
  read once, whole: a file changed after it was read warns
  (:class:`FileChangedWarning`) and the change is not read.
- :class:`Epochs`: several passes over a source through a seeded shuffle buffer;
  :class:`FirstExamples`: the first N rows of each pass; :func:`skip_examples`.

Paths may be local, or any fsspec URL (``s3://``, ``gs://``, ``memory://`` ...),
and may be a list, a glob or a directory (:func:`list_files`); node ``rank`` of
``world`` reads ``files[rank::world]`` (:func:`shard_files`). ``.gz``, ``.bz2`` and
``.zst`` TSV files are decompressed on the fly.

Bad input raises :class:`DataError` (a ValueError) naming file, line and
field: ``train.tsv:1234: field I5: 'abc' is not an integer``. A TSV, libsvm or
CSV file without data (0 bytes), a Parquet file of 0 rows or a CSV file of a header
alone gives no examples and warns, naming it (:class:`EmptyFileWarning`).

This package needs only numpy to import and to generate synthetic data; the
file readers need pyarrow (and fsspec for URLs) and say so when it is missing.
Readers are not thread-safe: give each thread its own reader.

The package by concern: :mod:`hps.data.keys` (the key hash), :mod:`hps.data.examples`
(:class:`Batch`, :class:`Source`), :mod:`hps.data.files` (file discovery,
sharding, :class:`DataError`), :mod:`hps.data.criteo` (the format and its
readers), :mod:`hps.data.synthetic` (:class:`SyntheticCriteo`); every public
name is importable from ``hps.data``.

>>> from hps.data import SyntheticCriteo
>>> gen = SyntheticCriteo(seed=1, batch_size=4, examples=10)
>>> [len(b) for b in gen]
[4, 4, 2]
>>> b = next(iter(gen))
>>> b.keys.shape, b.keys.dtype.name, b.dense.shape, b.labels.dtype.name
((4, 26), 'uint64', (4, 13), 'float32')
"""
from hps.data.criteo import (CATEGORICAL_COLUMNS, COLUMNS, DENSE_COLUMNS, LABEL_COLUMN, CriteoParquet, CriteoTsv,
                             dense_transform, open_criteo)
from hps.data.epochs import Epochs, FirstExamples, skip_examples
from hps.data.examples import Bags, Batch, Source
from hps.data.files import (MAX_MALFORMED_EXAMPLES, DataError, EmptyFileWarning,  # (the first: not in __all__)
                            list_files, shard_files)
from hps.data.keys import SENTINEL_KEY, feature_keys, missing_key, mix64
from hps.data.online import FileChangedWarning, GrowingDirectory
from hps.data.schema import Schema, value_keys
from hps.data.synthetic import DEFAULT_VOCAB_SIZES, SyntheticCriteo
from hps.data.tabular import Libsvm, SchemaCsv, SchemaParquet, open_schema

__all__ = [
    "Bags",
    "Batch",
    "CATEGORICAL_COLUMNS",
    "COLUMNS",
    "CriteoParquet",
    "CriteoTsv",
    "DENSE_COLUMNS",
    "DEFAULT_VOCAB_SIZES",
    "DataError",
    "EmptyFileWarning",
    "Epochs",
    "FileChangedWarning",
    "FirstExamples",
    "GrowingDirectory",
    "LABEL_COLUMN",
    "Libsvm",
    "SENTINEL_KEY",
    "Schema",
    "SchemaCsv",
    "SchemaParquet",
    "Source",
    "SyntheticCriteo",
    "dense_transform",
    "feature_keys",
    "list_files",
    "missing_key",
    "mix64",
    "open_criteo",
    "open_schema",
    "shard_files",
    "skip_examples",
    "value_keys",
]
