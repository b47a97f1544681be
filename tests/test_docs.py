"""The examples in docstrings run as written."""
import doctest

import pytest

import hps.embedding
import hps.hash_table
import hps.ssd_store


@pytest.mark.parametrize("module", [hps.hash_table, hps.embedding, hps.ssd_store], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0
