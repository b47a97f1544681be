"""The exceptions a user catches are reachable from the top-level package; an object
whose constructor raised raises them, never crashes."""
import re

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


def run_child(code: str):
    """`code` in a child process, so that a segfault fails the test and not the run."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stderr[-2000:]}"
    return out.stdout.splitlines()


UNBUILT = r"was never built \(its constructor raised, or only __new__ made it\): make a new one"


@pytest.mark.parametrize("make, calls, name", [
    ("hps.SsdStore(str(tmp / 'ssd'), 0)", ["len(o)", "o.stats()", "o.row_bytes", "o.get(keys)", "o.commit()"],
     "hps.ssd_store.SsdStore"),
    ("hps.HashTable(0, 4)", ["len(o)", "o.capacity", "o.find(keys)", "o.clear()"], "hps.hash_table.HashTable"),
])
def test_the_methods_of_an_object_whose_constructor_raised_raise(tmp_path, make, calls, name):
    """A Python subclass's self outlives its __init__ that raised, in the traceback's
    frame (pytest's and debuggers' reprs of locals call into it): its methods read a
    native object never built (pybind11 handed them uninitialized memory) and the
    process died of a segfault. Each raises ValueError naming the class now."""
    lines = run_child(f"""
import pathlib, numpy as np, hps
tmp, keys = pathlib.Path({str(tmp_path)!r}), np.array([1, 2], np.uint64)
try:
    {make}
except ValueError as e:
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    o = tb.tb_frame.f_locals["self"]
print(repr(o), flush=True)
for call in {calls!r}:
    try:
        eval(call)
        print("no error")
    except ValueError as e:
        print(e, flush=True)
""")
    assert lines[0] == f"{name.rsplit('.', 1)[1]}(not built: its constructor raised)"
    assert len(lines) == 1 + len(calls)
    for line in lines[1:]:
        assert re.fullmatch(f"this {re.escape(name)} {UNBUILT}", line), line


# A call of each class bound in hps._core that reads its native object.
NATIVE_CALLS = {"SparseOptimizer": "o.dim", "HashTable": "len(o)", "SsdStore": "len(o)", "BackingStore": "o.row_bytes",
                "MemCache": "o.stats()", "DeviceTier": "len(o)", "HostBatch": "len(o)", "WorkingSet": "len(o)",
                "Herald": "o.memory_bytes", "AdmissionSketch": "o.width", "TierRoutes": "o.devices",
                "RowAddresses": "len(o)"}


def test_an_object_only_new_made_raises():
    """__new__ alone (X.__new__(X)) makes an object of any bound class without a
    native one; a method, or passing it to another class's (a BackingStore as a
    cache's loader), raises ValueError instead of reading uninitialized memory."""
    from hps import _core
    bound = {n for n, v in vars(_core).items() if isinstance(v, type) and type(v).__name__ == "pybind11_type"}
    assert bound == set(NATIVE_CALLS)  # a class bound later gets a call here
    lines = run_child(f"""
from hps import _core
for name, call in {NATIVE_CALLS!r}.items():
    o = getattr(_core, name).__new__(getattr(_core, name))
    try:
        eval(call)
        print(name, "no error")
    except ValueError as e:
        print(name, e, flush=True)
backing = _core.BackingStore.__new__(_core.BackingStore)
try:
    _core.MemCache(8, 2, loader=backing)
except ValueError as e:
    print("loader", e, flush=True)
""")
    assert len(lines) == len(NATIVE_CALLS) + 1
    for line, name in zip(lines, [*NATIVE_CALLS, "loader"]):
        cls = "BackingStore" if name == "loader" else name
        assert re.fullmatch(f"{name} this hps._core.{cls} {UNBUILT}", line), line
