"""SSD-PS under faults: a process killed at random moments (mid-put, mid-commit,
mid-compaction), and a full disk.

Both run the store in a child process: SIGKILL must not take the test runner
with it, and RLIMIT_FSIZE (which makes writes past a size fail with EFBIG, a
full disk in all but name) must not limit the runner's own files.
"""
import os
import random
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hps

ROW_BYTES = 16
UNIVERSE = 3000


def batch(n):
    """The n-th put of the writer: deterministic, so any commit's state can be rebuilt."""
    rng = np.random.default_rng(n)
    keys = rng.integers(0, UNIVERSE, 400).astype(np.uint64)
    rows = np.stack([keys.astype(np.float32), np.full(keys.size, n, np.float32),
                     rng.random(keys.size, dtype=np.float32), np.ones(keys.size, np.float32)], 1)
    return keys, rows


def state_after(commits):
    model = {}
    for n in range(1, commits + 1):
        keys, rows = batch(n)
        for k, row in zip(keys.tolist(), rows):
            model[k] = row
    return model


WRITER = textwrap.dedent("""
    import sys
    import hps
    sys.path.insert(0, {tests!r})
    from test_ssd_faults import batch, ROW_BYTES
    store = hps.SsdStore(sys.argv[1], ROW_BYTES, file_records=150)
    n = int(sys.argv[2])
    while True:
        n += 1
        keys, rows = batch(n)
        store.put(keys, rows)
        store.commit()
        print(n, flush=True)
""").format(tests=os.path.dirname(os.path.abspath(__file__)))


def stored_state(path):
    store = hps.SsdStore(path, ROW_BYTES)
    keys = np.arange(UNIVERSE, dtype=np.uint64)
    rows, found = store.get(keys, np.float32)
    return {k: rows[k] for k in keys[found].tolist()}


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_sigkill_at_random_moments_reopens_to_a_committed_state(tmp_path):
    path = str(tmp_path / "store")
    rng = random.Random(7)
    reported = 0
    for attempt in range(8):
        child = subprocess.Popen([sys.executable, "-c", WRITER, path, str(reported)],
                                 stdout=subprocess.PIPE, text=True)
        # Let it commit a few batches, then kill it at an arbitrary instant.
        for _ in range(rng.randint(1, 6)):
            # A writer that hangs fails the test instead of hanging it (poll: the
            # runner may hold descriptors past select()'s limit of 1024).
            poller = select.poll()
            poller.register(child.stdout, select.POLLIN)
            if not poller.poll(60_000):
                child.kill()
                pytest.fail(f"attempt {attempt}: the writer printed nothing for 60 s")
            line = child.stdout.readline()
            assert line, f"writer died on its own (exit {child.wait()})"
            reported = int(line)
        time.sleep(rng.random() * 0.03)
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate()
        for line in rest.split():
            reported = int(line)
        # The kill may land after a commit returned but before it was reported.
        got = stored_state(path)
        if same(got, state_after(reported + 1)):
            reported += 1
        else:
            assert same(got, state_after(reported)), f"attempt {attempt}: not commit {reported} or {reported + 1}"
        # No file of an unfinished put or compaction survives the reopen; a
        # compaction that the kill cut short, run again, brings disk under 2x live.
        store = hps.SsdStore(path, ROW_BYTES)
        s = store.stats()
        files = len([f for f in os.listdir(path) if f.endswith(".hpf")])
        assert files == s["files"]
        store.commit()
        store.wait_for_compaction()
        s = store.stats()
        assert s["compaction_failures"] == 0, s["last_error"]
        assert s["live_records"] + s["stale_records"] <= 2 * s["live_records"], s
        del store
    assert reported >= 8


FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    import numpy as np
    import hps
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead
    path = sys.argv[1]
    store = hps.SsdStore(path, 1024, file_records=256)
    small = np.arange(100, dtype=np.uint64)
    store.put(small, np.full((100, 256), 1, np.float32))
    store.commit()
    files = sorted(os.listdir(path))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    big = np.arange(1000, 3000, dtype=np.uint64)
    try:
        store.put(big, np.full((2000, 256), 2, np.float32))
        print("put succeeded past the limit")
        sys.exit(1)
    except hps.IoError as e:
        print("error:", e)
    assert sorted(os.listdir(path)) == files, "a failed put left files behind"
    rows, found = store.get(small, np.float32)
    assert found.all() and (rows == 1).all(), "committed rows unreadable after the failure"
    assert not store.get(big[:5], np.float32)[1].any()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
    store.put(big, np.full((2000, 256), 2, np.float32))
    store.commit()
    print("recovered")
""")


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs POSIX resource limits")
def test_full_disk_fails_the_put_and_keeps_the_store_working(tmp_path):
    path = str(tmp_path / "store")
    done = subprocess.run([sys.executable, "-c", FULL_DISK, path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "error:" in done.stdout and "File too large" in done.stdout, done.stdout
    assert re.search(r"\.hpf: (allocate|(io_uring )?write): File too large", done.stdout), done.stdout
    assert done.stdout.strip().endswith("recovered")
    store = hps.SsdStore(path, 1024)
    assert len(store) == 2100
    rows, found = store.get(np.array([5, 2500], np.uint64), np.float32)
    assert found.all() and rows[0, 0] == 1 and rows[1, 0] == 2
