"""The examples in docstrings run as written."""
import doctest
import tempfile

import pytest

import hps.admission
import hps.config
import hps.data
import hps.data.keys
import hps.data.synthetic
import hps.embedding
import hps.hash_table
import hps.herald
import hps.mem_cache
import hps.metrics
import hps.parameter_server
import hps.ssd_store

MODULES = [hps.config, hps.hash_table, hps.embedding, hps.ssd_store, hps.mem_cache, hps.parameter_server, hps.data,
           hps.data.keys, hps.data.synthetic, hps.metrics, hps.herald, hps.admission]  # hps.data's testmod skips the submodules' examples


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module, tmp_path, monkeypatch):
    # The examples make their stores with tempfile.mkdtemp, as a user would;
    # here those land under pytest's tmp_path, not left behind in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0
