"""The exceptions a user catches are reachable from the top-level package."""
import pytest

import hps
import hps.data


def test_every_error_is_exported_from_hps():
    for name in ["HpsError", "CorruptionError", "IoError", "CacheFullError", "TableFullError", "DataError",
                 "DivergedError"]:
        assert name in hps.__all__, name
        assert isinstance(getattr(hps, name), type), name
    assert hps.DataError is hps.data.DataError
    # Malformed input is a bad argument (ValueError), not a fault of the system.
    assert issubclass(hps.DataError, ValueError)
    assert not issubclass(hps.DataError, hps.HpsError)


def test_a_malformed_file_raises_hps_data_error(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "short.tsv"
    path.write_text("1\t2\t3\n")  # 3 fields where a Criteo line has 40
    with pytest.raises(hps.DataError) as e:
        for _ in hps.data.CriteoTsv(str(path), batch_size=4):
            pass
    assert e.value.path is not None and e.value.path.endswith("short.tsv")
    assert e.value.line == 1
    assert "short.tsv:1" in str(e.value)
