"""SSD-PS against a dict model, across reopens, and its errors."""
import contextlib
import os
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import hps

ROW_BYTES = 12  # 3 float32


def u64(values):
    return np.asarray(values, dtype=np.uint64)


def takes_o_direct(directory):
    """Whether the filesystem at `directory` lets a file be created with O_DIRECT."""
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    os.close(fd)
    return True


def open_io_urings():
    """This process's io_uring instances: each is a descriptor on an anonymous inode."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return links.count("anon_inode:[io_uring]")


def rows_for(keys, salt):
    keys = np.asarray(keys, dtype=np.float64)
    return np.stack([keys % 997, keys % 13 + salt, np.full(keys.size, salt)], axis=1).astype(np.float32)


class StoreMachine(RuleBasedStateMachine):
    """Random put / get / commit / reopen. A reopen keeps exactly what was
    committed, whatever was put after it."""

    def __init__(self):
        super().__init__()
        self.dir = None
        self.store = None
        self.model = {}
        self.committed = {}
        self.salt = 0.0

    io = {}

    def open(self):
        self.store = hps.SsdStore(self.dir, ROW_BYTES, file_records=50, compaction_trigger=1.2,
                                  **self.io)

    @rule(seed=st.integers(0, 2**32), size=st.sampled_from([0, 1, 30, 120]),
          universe=st.sampled_from([20, 500]))
    def put(self, seed, size, universe):
        self.ensure_open()
        keys = np.random.default_rng(seed).integers(0, universe, size).astype(np.uint64)
        self.salt += 1
        rows = rows_for(keys, self.salt)
        self.store.put(keys, rows)
        for k, row in zip(keys.tolist(), rows):  # the last duplicate wins
            self.model[k] = row

    @rule(seed=st.integers(0, 2**32), size=st.sampled_from([1, 40, 300]))
    def get(self, seed, size):
        self.ensure_open()
        keys = np.random.default_rng(seed).integers(0, 520, size).astype(np.uint64)
        rows, found = self.store.get(keys, np.float32)
        for i, k in enumerate(keys.tolist()):
            assert found[i] == (k in self.model)
            np.testing.assert_array_equal(rows[i], self.model.get(k, np.zeros(3, np.float32)))

    @rule(wait=st.booleans())
    def commit(self, wait):
        """Without waiting, the background compaction this may start runs on
        under the puts, gets and reopens that follow."""
        self.ensure_open()
        self.store.commit()
        self.committed = dict(self.model)
        if wait:
            self.store.wait_for_compaction()
            self.check_space_bound()

    @rule()
    def compact(self):
        self.ensure_open()
        self.store.compact()  # commits first
        self.committed = dict(self.model)
        self.check_space_bound()
        s = self.store.stats()
        assert s["compaction_failures"] == 0, s["last_error"]

    def check_space_bound(self):
        s = self.store.stats()
        assert s["live_records"] + s["stale_records"] <= 2 * s["live_records"], s

    @rule()
    def reopen(self):
        self.ensure_open()
        del self.store
        self.open()
        self.model = dict(self.committed)

    @invariant()
    def sizes_match(self):
        if self.store is not None:
            assert len(self.store) == len(self.model)
            s = self.store.stats()
            assert s["live_records"] == len(self.model)

    def ensure_open(self):
        if self.store is None:
            self.open()


IO_PATHS = [
    {"use_io_uring": True, "direct_io": True},
    {"use_io_uring": False, "direct_io": False, "background_compaction": False},
]


@pytest.fixture(params=IO_PATHS, ids=["io_uring+direct+background", "pread+inline"])
def store_machine(tmp_path, request):
    counter = iter(range(10**6))

    class Machine(StoreMachine):
        io = request.param

        def __init__(self):
            super().__init__()
            self.dir = tmp_path / f"store{next(counter)}"

    return Machine


def test_store_against_dict_model(store_machine):
    store_machine.TestCase.settings = settings(
        max_examples=30, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    store_machine.TestCase().runTest()


@pytest.mark.parametrize("use_io_uring", [True, False])
@pytest.mark.parametrize("direct_io", [True, False])
def test_stale_records_and_read_amplification(tmp_path, use_io_uring, direct_io):
    refused = direct_io and not takes_o_direct(tmp_path)
    with pytest.warns(hps.IoPathWarning, match="O_DIRECT refused") if refused else contextlib.nullcontext():
        store = hps.SsdStore(tmp_path / "s", 16, file_records=100, use_io_uring=use_io_uring,
                             direct_io=direct_io)
    keys = u64(range(1000))
    store.put(keys, np.zeros((1000, 4), np.float32))
    store.put(keys[:300], np.ones((300, 4), np.float32))
    s = store.stats()
    assert (s["files"], s["live_records"], s["stale_records"]) == (13, 1000, 300)
    rows, found = store.get(keys[::100].copy(), np.float32)
    assert found.all() and (rows[:3] == 1).all() and (rows[3:] == 0).all()
    s = store.stats()
    assert s["rows_read"] == 10 and s["bytes_requested"] == 160
    assert s["bytes_read"] == 10 * 4096  # one block per scattered row
    # The fallbacks when asked for; otherwise io_uring in a build with liburing
    # (a kernel that refuses it would have warned above), O_DIRECT where the
    # filesystem takes it.
    expected = "io_uring" if use_io_uring and hps.liburing_compiled() else "pread"
    expected += "+O_DIRECT" if direct_io and not refused else ""
    assert s["io_path"] == expected
    assert (s["io_fallback"] != "") == refused, s["io_fallback"]
    # Everything read back through this path is right, not only the sample.
    rows, found = store.get(keys, np.float32)
    assert found.all() and (rows[:300] == 1).all() and (rows[300:] == 0).all()


def test_a_get_of_more_blocks_than_the_ring_holds(tmp_path):
    """3000 scattered blocks in one get: more reads than io_uring's ring takes at
    once (512), so completions must make room for the rest; every row comes back."""
    store = hps.SsdStore(tmp_path / "s", 4096, file_records=10_000)
    keys = u64(range(6000))
    rows = np.arange(6000, dtype=np.float32)[:, None] + np.arange(1024, dtype=np.float32)
    store.put(keys, rows)
    wanted = keys[::2].copy()  # every other row of one 4 KiB block: 3000 reads, none adjacent
    got, found = store.get(wanted, np.float32)
    assert found.all()
    np.testing.assert_array_equal(got, rows[::2])
    s = store.stats()
    assert s["rows_read"] == 3000 and s["bytes_read"] == 3000 * 4096


def test_compaction_rewrites_stale_files_and_keeps_every_row(tmp_path):
    path = tmp_path / "s"
    store = hps.SsdStore(path, 16, file_records=100, compaction_trigger=1.5)
    keys = u64(range(1000))
    expected = np.zeros(1000, np.float32)
    for round_ in range(1, 9):
        # A rotating window of 600 keys: victims keep some live records to move.
        window = np.random.default_rng(round_).permutation((np.arange(600) + 300 * round_) % 1000)
        store.put(keys[window], np.full((600, 4), round_, np.float32))
        expected[window] = round_
        store.commit()
        store.wait_for_compaction()
        s = store.stats()
        assert not s["compaction_running"]
        assert s["live_records"] + s["stale_records"] <= 1.5 * s["live_records"]
    s = store.stats()
    assert s["compactions"] >= 2 and s["compacted_records"] > 0 and s["compaction_failures"] == 0
    assert len([f for f in os.listdir(path) if f.endswith(".hpf")]) == s["files"]
    for reopened in (store, hps.SsdStore(path, 16)):
        rows, found = reopened.get(keys, np.float32)
        assert found.all()
        np.testing.assert_array_equal(rows[:, 0], expected)


def test_compaction_trigger_is_checked(tmp_path):
    with pytest.raises(ValueError, match="compaction_trigger must be >= 1"):
        hps.SsdStore(tmp_path / "s", 8, compaction_trigger=0.5)


def test_uncommitted_files_are_removed_on_open(tmp_path):
    path = tmp_path / "s"
    store = hps.SsdStore(path, 8, file_records=10)
    store.put(u64(range(25)), np.zeros((25, 2), np.float32))
    store.commit()
    store.put(u64(range(100, 150)), np.zeros((50, 2), np.float32))
    files_before = len([f for f in os.listdir(path) if f.endswith(".hpf")])
    assert files_before == 3 + 5
    del store
    reopened = hps.SsdStore(path, 8)
    assert len(reopened) == 25
    assert len([f for f in os.listdir(path) if f.endswith(".hpf")]) == 3
    assert not reopened.get(u64([120]))[1].any()


# ---------------------------------------------------------------- errors

def test_bad_keys_and_rows(tmp_path):
    store = hps.SsdStore(tmp_path / "s", 8)
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        store.put(u64([1, hps.EMPTY_KEY]), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="rows must be a 2-D array of 2 rows of 8 bytes each"):
        store.put(u64([1, 2]), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="rows must be C-contiguous"):
        store.put(u64([1, 2]), np.zeros((2, 4), np.float32)[:, ::2])
    with pytest.raises(TypeError, match="keys must be an array of uint64 or int64"):
        store.get(np.array([1.5]))
    assert len(store) == 0


def test_paths_that_are_not_stores(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("hello")
    with pytest.raises(ValueError, match="is not a directory, so not an hps store"):
        hps.SsdStore(a_file, 8)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not an hps store .no STORE file. and is not empty"):
        hps.SsdStore(foreign, 8)
    with pytest.raises(ValueError, match="row_bytes must be > 0"):
        hps.SsdStore(tmp_path / "new", 0)


def test_row_size_is_fixed_for_the_store(tmp_path):
    hps.SsdStore(tmp_path / "s", 8).commit()
    with pytest.raises(ValueError, match="holds rows of 8 bytes, not 16"):
        hps.SsdStore(tmp_path / "s", 16)


def test_a_corrupt_file_is_named(tmp_path):
    path = tmp_path / "s"
    store = hps.SsdStore(path, 8)
    store.put(u64(range(10)), np.zeros((10, 2), np.float32))
    store.commit()
    del store
    (victim,) = [f for f in os.listdir(path) if f.endswith(".hpf")]
    with open(path / victim, "r+b") as f:
        f.seek(4096 + 3)  # inside the keys region
        f.write(b"\xff")
    with pytest.raises(hps.CorruptionError, match=f"{victim}: not a valid hps parameter file: keys CRC"):
        hps.SsdStore(path, 8)


def test_a_missing_live_file_is_named(tmp_path):
    path = tmp_path / "s"
    store = hps.SsdStore(path, 8)
    store.put(u64([1]), np.zeros((1, 2), np.float32))
    store.commit()
    del store
    (victim,) = [f for f in os.listdir(path) if f.endswith(".hpf")]
    os.remove(path / victim)
    with pytest.raises(hps.CorruptionError, match=f"{victim}: listed as live in .*MANIFEST but missing"):
        hps.SsdStore(path, 8)


def test_a_lost_manifest_raises_and_removes_no_file(tmp_path):
    """With MANIFEST gone, open once took every parameter file for an
    uncommitted stray and deleted it: all committed rows lost, no error."""
    path = tmp_path / "s"
    store = hps.SsdStore(path, 8)
    store.put(u64([1, 2]), np.ones((2, 2), np.float32))
    store.commit()
    del store
    files = sorted(f for f in os.listdir(path) if f.endswith(".hpf"))
    manifest = path / "MANIFEST"
    saved = manifest.read_bytes()
    manifest.unlink()
    with pytest.raises(hps.CorruptionError, match=r"MANIFEST: missing, yet .* holds 1 parameter files"):
        hps.SsdStore(path, 8)
    assert sorted(f for f in os.listdir(path) if f.endswith(".hpf")) == files
    manifest.write_bytes(saved)
    assert hps.SsdStore(path, 8).get(u64([1, 2]))[1].all()


def test_damage_inside_the_manifest_raises_and_removes_no_file(tmp_path):
    """Replay once stopped silently at a damaged record before the log's end,
    and open then removed every file the shortened log did not name: here 3 of
    4 committed files, 75,000 of 100,000 rows."""
    path = tmp_path / "s"
    store = hps.SsdStore(path, 16)
    for part in range(4):
        keys = u64(range(part * 25_000, (part + 1) * 25_000))
        store.put(keys, np.stack([keys.astype(np.float32)] * 4, 1))
        store.commit()
    del store
    files = sorted(f for f in os.listdir(path) if f.endswith(".hpf"))
    assert len(files) == 4
    manifest = path / "MANIFEST"
    at = manifest.stat().st_size // 3
    original = manifest.read_bytes()
    manifest.write_bytes(original[:at] + bytes([original[at] ^ 0x5A]) + original[at + 1:])
    with pytest.raises(hps.CorruptionError,
                       match=rf"MANIFEST: record at byte \d+: .*damaged before its end") as raised:
        hps.SsdStore(path, 16)
    record = int(str(raised.value).split("record at byte ")[1].split(":")[0])
    assert record <= at < record + 25  # the record holding the flipped byte (an add is 25 bytes)
    assert sorted(f for f in os.listdir(path) if f.endswith(".hpf")) == files
    assert manifest.read_bytes()[at] != original[at]  # the log itself left as found
    manifest.write_bytes(original)
    keys = u64(range(100_000))
    rows, found = hps.SsdStore(path, 16).get(keys, np.float32)
    assert found.all()
    np.testing.assert_array_equal(rows[:, 0], keys.astype(np.float32))


@pytest.mark.skipif(not hps.liburing_compiled(), reason="this build has no liburing: SSD-PS reads with pread")
def test_io_uring_really_moves_the_rows(tmp_path):
    """The default path in a build with liburing is io_uring (with O_DIRECT where
    the filesystem takes it): a ring is open in this process, and the store says
    so; a silent fall back to pread fails here."""
    before = open_io_urings()
    store = hps.SsdStore(tmp_path / "s", 4096, file_records=64)
    assert open_io_urings() == before + 1
    keys = u64(range(200))
    rows = np.arange(200, dtype=np.float32)[:, None] + np.zeros(1024, np.float32)
    store.put(keys, rows)
    got, found = store.get(keys[::3].copy(), np.float32)
    assert found.all()
    np.testing.assert_array_equal(got, rows[::3])
    s = store.stats()
    assert s["io_path"] == ("io_uring+O_DIRECT" if takes_o_direct(tmp_path) else "io_uring")
    assert s["io_fallback"] == "" and store.io_fallback == ""
    pread = hps.SsdStore(tmp_path / "p", 8, use_io_uring=False, direct_io=False)
    assert open_io_urings() == before + 1  # the fallback asked for opens none
    assert pread.stats()["io_path"] == "pread"


def bytes_read_by_syscalls():
    """rchar of /proc/self/io: the bytes this process's read and pread calls
    returned. io_uring's reads are not syscalls of that kind and add nothing."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not hps.liburing_compiled(), reason="this build has no liburing: SSD-PS reads with pread")
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no /proc/self/io to count read syscalls")
def test_compaction_reads_its_rows_through_io_uring(tmp_path):
    """Compaction reads the rows of its victims on the gets' path, not with
    pread: the megabytes it reads leave /proc/self/io's rchar (bytes returned
    by read syscalls) all but unmoved, where pread would add each of them."""
    store = hps.SsdStore(tmp_path / "s", 4096, file_records=256, background_compaction=False,
                         compaction_trigger=100.0)
    if not store.stats()["io_path"].startswith("io_uring"):
        pytest.skip(f"io_uring refused here: {store.io_fallback}")
    keys = u64(range(1024))
    rows = np.arange(1024, dtype=np.float32)[:, None] + np.zeros(1024, np.float32)
    store.put(keys, rows)
    store.commit()
    stale = keys % 4 != 0
    store.put(keys[stale], rows[stale] + 0.5)  # three quarters of each file stale: all compacted
    store.commit()
    before, read_before = bytes_read_by_syscalls(), store.stats()["bytes_read"]
    store.compact()
    s = store.stats()
    read = s["bytes_read"] - read_before
    assert s["compactions"] >= 1 and read >= 256 * 4096  # the live quarters' rows, at least
    by_syscalls = bytes_read_by_syscalls() - before
    # The keys (8 bytes a record) and the new files' headers and CRC tables
    # are read with pread; the rows must not be.
    assert by_syscalls < read / 8, f"{by_syscalls} bytes by read syscalls for {read} bytes of rows"
    got, found = store.get(keys, np.float32)
    assert found.all()
    expected = rows.copy()
    expected[stale] += 0.5
    np.testing.assert_array_equal(got, expected)


def test_gets_run_alongside_puts_and_background_compaction(tmp_path):
    """Readers see, for every key, a row some put wrote for it, never a torn
    or foreign one, while a writer overwrites keys and compactions swap files."""
    import threading

    store = hps.SsdStore(tmp_path / "s", 16, file_records=64, compaction_trigger=1.2)
    n = 2000
    keys = u64(range(n))

    def rows(version):
        return np.stack([keys.astype(np.float32), np.full(n, version, np.float32),
                         keys.astype(np.float32) * 2, np.full(n, -version, np.float32)], 1)

    store.put(keys, rows(0))
    store.commit()
    errors, stop = [], threading.Event()

    def reader(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ask = rng.choice(keys, 300)
            got, found = store.get(ask, np.float32)
            ok = (found.all() and (got[:, 0] == ask).all() and (got[:, 2] == 2 * ask).all()
                  and (got[:, 3] == -got[:, 1]).all())
            if not ok:
                errors.append((ask, got, found))
                return

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for version in range(1, 30):
        subset = np.random.default_rng(version).permutation(n)[: n // 2]
        store.put(keys[subset], rows(version)[subset])
        store.commit()
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    store.wait_for_compaction()
    s = store.stats()
    assert s["compactions"] >= 3 and s["compaction_failures"] == 0, s
    assert 0 < s["compaction_lock_max_us"] < 1e6
    assert s["live_records"] + s["stale_records"] <= 1.2 * n
    final = hps.SsdStore(tmp_path / "s", 16).get(keys, np.float32)[0]
    expected = np.zeros(n, np.float32)
    for version in range(1, 30):
        expected[np.random.default_rng(version).permutation(n)[: n // 2]] = version
    np.testing.assert_array_equal(final[:, 1], expected)


def test_reopening_with_a_smaller_file_records(tmp_path):
    """Files may hold more records than a later open's file_records (written
    under a larger setting, or merged by compaction); reopening must still index
    them. This once crashed the SIGKILL test's writer."""
    path = tmp_path / "s"
    big = hps.SsdStore(path, 8, file_records=1000)
    keys = u64(range(3000))
    big.put(keys, np.arange(6000, dtype=np.float32).reshape(3000, 2))
    big.commit()
    del big
    small = hps.SsdStore(path, 8, file_records=10)
    small.put(keys[:50], np.zeros((50, 2), np.float32))  # new files, handles beside the big ones
    small.commit()
    rows, found = small.get(keys, np.float32)
    assert found.all()
    np.testing.assert_array_equal(rows[50:, 0], np.arange(100, 6000, 2, dtype=np.float32))
    assert (rows[:50] == 0).all()
    assert small.stats()["stale_records"] == 50


@pytest.mark.parametrize("use_io_uring", [True, False])
@pytest.mark.parametrize("direct_io", [True, False])
def test_a_flipped_row_byte_fails_the_get_that_reads_it(tmp_path, use_io_uring, direct_io):
    """Issue 14: a get reads single 4 KiB blocks, so the whole-region rows CRC
    never saw them; each block's own CRC is now checked on every read, on every
    I/O path. Only gets that touch the bad block fail."""
    path = tmp_path / "s"
    row_bytes = 64  # 64 rows a block: 200 rows are 4 blocks, the last one part padding
    store = hps.SsdStore(path, row_bytes, file_records=200)
    near = u64(range(200))  # one file
    far = u64(range(1000, 1200))  # another
    rows_of = {int(k): np.full(16, float(k), np.float32) for k in np.concatenate([near, far])}
    store.put(near, np.stack([rows_of[int(k)] for k in near]))
    store.commit()
    store.put(far, np.stack([rows_of[int(k)] for k in far]))
    store.commit()
    del store

    # Find the file and slot of key 70 from the format (docs/ssd_format.md, version 2).
    def keys_of(name):
        return np.fromfile(path / name, dtype=np.uint64, count=200, offset=4096)

    (victim,) = [f for f in os.listdir(path) if f.endswith(".hpf") and 70 in keys_of(f)]
    slot = int(np.flatnonzero(keys_of(victim) == 70)[0])
    def round_up(n):
        return -(-n // 4096) * 4096

    rows_offset = 4096 + round_up(200 * 8) + round_up(round_up(200 * row_bytes) // 4096 * 4)
    assert os.path.getsize(path / victim) == rows_offset + round_up(200 * row_bytes)
    block = slot * row_bytes // 4096
    with open(path / victim, "r+b") as f:
        f.seek(rows_offset + slot * row_bytes + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    same_block = [int(k) for k in keys_of(victim) if k != 70 and
                  int(np.flatnonzero(keys_of(victim) == k)[0]) * row_bytes // 4096 == block]
    other_blocks = [int(k) for k in keys_of(victim) if k not in same_block and k != 70]

    with warnings.catch_warnings():
        # A filesystem or kernel that refuses O_DIRECT or io_uring warns of the
        # fallback (hps.IoPathWarning); the reads must be checked on it all the same.
        warnings.simplefilter("ignore", RuntimeWarning)
        store = hps.SsdStore(path, row_bytes, use_io_uring=use_io_uring, direct_io=direct_io)
        message = rf"{re.escape(victim)}: rows block {block} \(file offset {rows_offset + block * 4096}\)" \
                  rf".* reading key 70\b"
        with pytest.raises(hps.CorruptionError, match=message):
            store.get(u64([70]), np.float32)
        # A row that shares the bad block fails with its own key; the bytes
        # that differ are not its own.
        with pytest.raises(hps.CorruptionError, match=rf"rows block {block} .* reading key {same_block[0]}\b"):
            store.get(u64([same_block[0]]), np.float32)
        # Among many keys, one in the bad block fails the whole get.
        with pytest.raises(hps.CorruptionError, match=rf"{re.escape(victim)}: rows block {block} "):
            store.get(u64(far.tolist() + [70] + other_blocks), np.float32)
        # Everything else reads, and reads right: the other blocks of that
        # file and the whole other file.
        healthy = u64(other_blocks + far.tolist())
        got, found = store.get(healthy, np.float32)
        assert found.all()
        np.testing.assert_array_equal(got, np.stack([rows_of[int(k)] for k in healthy]))
        del store
        # verify_rows_on_open finds it at open instead.
        with pytest.raises(hps.CorruptionError, match=rf"{re.escape(victim)}: .*rows block {block} .*CRC mismatch"):
            hps.SsdStore(path, row_bytes, verify_rows_on_open=True, use_io_uring=use_io_uring,
                         direct_io=direct_io)


@pytest.mark.parametrize("use_io_uring", [True, False])
@pytest.mark.parametrize("direct_io", [True, False])
def test_a_compaction_meeting_a_flipped_row_byte_raises_corruption_and_compacts_on(tmp_path, use_io_uring,
                                                                                     direct_io):
    """A background compaction over a file with a flipped row byte raised
    hps.IoError from the next commit, and so did every commit after it: each
    compaction chose that file again, and the stale records of every other
    file piled up. The next commit now raises hps.CorruptionError naming the
    file, the block and the key, once; the file is left as it is (its bad row
    still raises at each get, after a reopen too, and its sound rows read),
    the other files are compacted, and later commits compact on."""
    path = tmp_path / "s"
    row_bytes = 64  # 64 rows a block
    near = u64(range(200))  # one file
    far = u64(range(1000, 1200))  # another

    def rows(keys, version):
        return np.stack([np.full(16, float(k) + version / 4, np.float32) for k in keys])

    store = hps.SsdStore(path, row_bytes, file_records=200, compaction_trigger=100)
    store.put(near, rows(near, 1))
    store.commit()
    store.put(far, rows(far, 1))
    store.commit()
    everything = np.concatenate([near, far])
    most = everything[everything % 4 != 2]  # three quarters of both files; key 66 stays in its first
    store.put(most, rows(most, 2))
    store.commit()
    del store

    def keys_of(name):
        return np.fromfile(path / name, dtype=np.uint64, count=200, offset=4096)

    (victim,) = [f for f in os.listdir(path) if f.endswith(".hpf") and 66 in keys_of(f)]
    slot = int(np.flatnonzero(keys_of(victim) == 66)[0])

    def round_up(n):
        return -(-n // 4096) * 4096

    rows_offset = 4096 + round_up(200 * 8) + round_up(round_up(200 * row_bytes) // 4096 * 4)
    block = slot * row_bytes // 4096
    with open(path / victim, "r+b") as f:
        f.seek(rows_offset + slot * row_bytes + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    named = rf"{re.escape(victim)}: rows block {block} \(file offset {rows_offset + block * 4096}\).* reading key 66\b"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an I/O fallback's hps.IoPathWarning
        store = hps.SsdStore(path, row_bytes, use_io_uring=use_io_uring, direct_io=direct_io)
        store.commit()  # 700 records on disk for 400 live: a compaction starts in the background
        store.wait_for_compaction()
        with pytest.raises(hps.CorruptionError, match="a background compaction failed: .*" + named):
            store.commit()
        store.commit()  # told once
        stats = store.stats()
        assert stats["corrupt_files"] == 1
        assert re.search(named, stats["last_error"]), stats["last_error"]
        assert (stats["compactions"], stats["compacted_records"]) == (1, 50), "far's live quarter, compacted all the same"
        assert (path / victim).exists()
        with pytest.raises(hps.CorruptionError, match=named):
            store.get(u64([66]), np.float32)
        sound = everything[(everything % 4 == 2) & ((everything < 64) | (everything >= 128))]  # not block 1
        got, found = store.get(sound, np.float32)
        assert found.all()
        np.testing.assert_array_equal(got, rows(sound, 1))
        got, _ = store.get(most, np.float32)
        np.testing.assert_array_equal(got, rows(most, 2))

        store.put(far, rows(far, 3))  # over the trigger again
        store.commit()
        store.wait_for_compaction()
        store.commit()
        stats = store.stats()
        assert (stats["compactions"], stats["compaction_failures"]) == (2, 1), stats["last_error"]
        got, _ = store.get(far, np.float32)
        np.testing.assert_array_equal(got, rows(far, 3))
        # compact() tries the file again, and raises again; the row stays, damaged.
        with pytest.raises(hps.CorruptionError, match=named):
            store.compact()
        del store
        store = hps.SsdStore(path, row_bytes, use_io_uring=use_io_uring, direct_io=direct_io)
        with pytest.raises(hps.CorruptionError, match=named):
            store.get(u64([66]), np.float32)
        assert store.stats()["live_records"] == 400


def test_a_bound_cutting_through_a_flipped_row_byte_leaves_the_cut_undone_and_is_told_once(tmp_path):
    """A checkpoint of a bounded table bounds the store, then commits it. When
    the rows a bound's cap would rewrite held a flipped byte, bound() raised
    hps.CorruptionError and changed nothing, at every checkpoint from then on.
    Now it takes the older stamps all the same and leaves the cut undone (the
    file as it is: its bad row still raises, its sound rows read), and the
    commit after it raises hps.CorruptionError naming the file, the block and
    the key, once: the next checkpoint's bound and commit go through."""
    path = tmp_path / "s"
    row_bytes = 64  # 64 rows a block
    store = hps.SsdStore(path, row_bytes, file_records=200, compaction_trigger=100)

    def rows(keys):
        return np.stack([np.full(16, float(k), np.float32) for k in keys])

    for stamp, first in ((1, 0), (2, 1000), (3, 2000)):  # files 1, 2, 3
        store.set_stamp(stamp)
        keys = u64(range(first, first + 200))
        store.put(keys, rows(keys))
    store.commit()
    victim = "000000000002.hpf"  # key 1000 + s at slot s
    rows_offset = 3 * 4096  # header, 1600 bytes of keys, 16 bytes of block CRCs
    with open(path / victim, "r+b") as f:
        f.seek(rows_offset + 150 * row_bytes + 5)  # key 1150's row, in block 2
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    named = rf"{re.escape(victim)}: rows block 2 \(file offset {rows_offset + 2 * 4096}\).* reading key 11\d\d\b"

    # 600 keys, at most 300: stamp 1 goes whole, then stamp 2 would be cut
    # (1000..1099 erased, 1100..1199 rewritten, block 2 among them).
    gone = store.bound(0, 300)
    np.testing.assert_array_equal(gone["capped"], u64(range(200)))
    assert (gone["files_dropped"], gone["records_rewritten"]) == (1, 0)
    with pytest.raises(hps.CorruptionError, match=r"bound\(\) met a damaged file: .*" + named):
        store.commit()
    store.commit()  # told once
    assert store.stats()["corrupt_files"] == 1
    gone = store.bound(0, 300)  # the next checkpoint's: the cut is left undone again, silently
    assert len(gone["capped"]) == 0
    store.commit()
    assert len(store) == 400
    with pytest.raises(hps.CorruptionError, match=named):
        store.get(u64([1150]), np.float32)
    sound = u64(range(1000, 1128))  # blocks 0 and 1
    got, found = store.get(sound, np.float32)
    assert found.all()
    np.testing.assert_array_equal(got, rows(sound))


def test_a_rolled_manifest_replays_in_python():
    """The store rolls a long MANIFEST into one log opened by a base record
    (commits, highest sequence; docs/ssd_format.md, "Manifest"). jobdir's replay,
    which pins checkpoints and reshards stores, refused that record's type."""
    import struct

    from hps import jobdir
    base = struct.pack("<BQQ", 4, 41, 9)
    rolled = struct.pack("<II", len(base), jobdir.crc32c(base)) + base + jobdir.encode_manifest({3: 10, 7: 4})
    assert jobdir.replay_manifest(rolled) == {3: 10, 7: 4}
    assert jobdir.committed_length(rolled) == len(rolled)
    # Anywhere else a base record is damage, as natively.
    with pytest.raises(ValueError, match="record at byte 34: unknown type 4"):
        jobdir.replay_manifest(jobdir.encode_manifest({3: 10}) + rolled)
