"""SSD-PS when things it relies on fail or are refused: a compaction that
fails in the background, a kernel that refuses io_uring, a filesystem that
refuses O_DIRECT.

Each runs the store in a child process: RLIMIT_FSIZE and a seccomp filter
cannot be taken back, and a ramfs mount lives in the child's own mount
namespace, so none of them reaches the test runner.
"""
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hps


def run(script, *args, prefix=()):
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------- compaction failures

COMPACTION_FAILS = """
    import resource, signal, sys
    import numpy as np
    import hps
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead
    path, background = sys.argv[1], sys.argv[2] == "1"
    store = hps.SsdStore(path, 1024, file_records=64, background_compaction=background)
    keys = np.arange(1000, dtype=np.uint64)
    store.put(keys, np.full((1000, 256), 1, np.float32))
    store.commit()
    # 70% of the keys again, all over the files: every file is more than half
    # stale, and 1700 records on disk for 1000 live pass the trigger of 1.5.
    newer = np.random.default_rng(0).permutation(1000)[:700]
    store.put(keys[newer], np.full((700, 256), 2, np.float32))
    expected = np.ones(1000, np.float32)
    expected[newer] = 2
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # no parameter file fits; MANIFEST does

    def check_rows():
        rows, found = store.get(keys, np.float32)
        assert found.all() and (rows[:, 0] == expected).all() and (rows[:, -1] == expected).all()

    try:
        store.commit()  # durable; the compaction it starts cannot write its files
        print("commit returned")
        store.wait_for_compaction()
    except hps.IoError as e:
        print("commit raised:", e)
    s = store.stats()
    print("failures:", s["compaction_failures"], "compactions:", s["compactions"])
    check_rows()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
    if background:
        try:
            store.commit()
            print("next commit returned")
        except hps.IoError as e:
            print("next commit raised:", e)
        store.wait_for_compaction()
    store.commit()  # told once: this one is quiet, and compacts again
    store.wait_for_compaction()
    s = store.stats()
    print("failures:", s["compaction_failures"], "compactions:", s["compactions"])
    check_rows()
    store.put(keys[:10], np.full((10, 256), 3, np.float32))
    store.commit()
    print("recovered")
"""


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_a_failed_compaction_is_raised_by_a_commit_once(tmp_path, background):
    path = tmp_path / "s"
    done = run(COMPACTION_FAILS, path, int(background))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    if background:
        # The commit that started it returned; the next one raises, once, and
        # the failure was logged when it happened.
        assert "commit returned" in out
        assert f"next commit raised: ssd store {path}: a background compaction failed: " in out, out
        assert f"hps: ssd store {path}: a background compaction failed: " in done.stderr, done.stderr
    else:
        assert f"commit raised: ssd store {path}: the compaction this commit ran failed: " in out, out
    assert "File too large" in out and "this commit is durable" in out, out
    counts = [line for line in out.splitlines() if line.startswith("failures:")]
    assert counts[0] == "failures: 1 compactions: 0", out
    # Space back, a later commit compacts again, and no failure is told twice.
    assert counts[1].startswith("failures: 1 compactions: ") and counts[1] != counts[0], out
    assert out.count("raised:") == 1 and out.strip().endswith("recovered"), out
    # Everything committed is there after a reopen.
    store = hps.SsdStore(path, 1024)
    keys = np.arange(1000, dtype=np.uint64)
    rows, found = store.get(keys, np.float32)
    expected = np.ones(1000, np.float32)
    expected[np.random.default_rng(0).permutation(1000)[:700]] = 2
    expected[:10] = 3
    assert found.all()
    np.testing.assert_array_equal(rows[:, 0], expected)


# ------------------------------------------------------------- io path fallbacks

# A seccomp filter that fails io_uring_setup (425 on every architecture) with
# EPERM, as container runtimes' default profiles do; threads started later
# (the store's compactor) inherit it.
NO_IO_URING = """
    import ctypes, sys, warnings

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    program = (SockFilter * 4)(
        SockFilter(0x20, 0, 0, 0),            # load seccomp_data.nr
        SockFilter(0x15, 0, 1, 425),          # == io_uring_setup ?
        SockFilter(0x06, 0, 0, 0x00050000 | 1),  # return ERRNO(EPERM)
        SockFilter(0x06, 0, 0, 0x7FFF0000),   # return ALLOW
    )
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    fprog = SockFprog(len(program), program)
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER

    import numpy as np
    import hps
    path = sys.argv[1]
    keys = np.arange(500, dtype=np.uint64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = hps.SsdStore(path + "/a", 16, file_records=100)
        store.put(keys, np.repeat(keys.astype(np.float32)[:, None], 4, 1))
        store.commit()
        rows, found = store.get(keys, np.float32)
        assert found.all() and (rows[:, 3] == keys).all()
        chosen = hps.SsdStore(path + "/b", 16, use_io_uring=False)
        chosen.put(keys, np.zeros((500, 4), np.float32))
    for w in caught:
        print("warning:", w.category.__name__, w.message)
    print("io_path:", store.stats()["io_path"])
    print("chosen io_path:", chosen.stats()["io_path"], repr(chosen.io_fallback))
"""


@pytest.mark.skipif(not hps.liburing_compiled(), reason="this build has no liburing: no io_uring to refuse")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux's")
def test_a_refused_io_uring_falls_back_to_pread_with_one_warning(tmp_path):
    done = run(NO_IO_URING, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    warned = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: IoPathWarning hps.SsdStore at {tmp_path}/a moves rows by pread+O_DIRECT, "
                      "not as asked: io_uring_queue_init: Operation not permitted"], done.stdout
    assert "\nio_path: pread+O_DIRECT\n" in done.stdout
    # pread chosen by the caller: no warning (above), nothing to report.
    assert "chosen io_path: pread+O_DIRECT ''" in done.stdout


# ramfs has no O_DIRECT on any kernel (tmpfs has it from Linux 6.6 on).
NO_O_DIRECT = """
    import sys, warnings
    import numpy as np
    import hps
    path = sys.argv[1]
    keys = np.arange(500, dtype=np.uint64)
    reader = "io_uring" if hps.liburing_compiled() else "pread"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = hps.SsdStore(path + "/a", 16, file_records=100)
        store.put(keys, np.repeat(keys.astype(np.float32)[:, None], 4, 1))
        store.commit()
        store.compact()
        rows, found = store.get(keys, np.float32)
        assert found.all() and (rows[:, 3] == keys).all()
        assert store.stats()["io_path"] == reader, store.stats()["io_path"]
        chosen = hps.SsdStore(path + "/b", 16, direct_io=False)
        chosen.put(keys, np.zeros((500, 4), np.float32))
        assert chosen.stats()["io_path"] == reader and chosen.io_fallback == ""
    for w in caught:
        print("warning:", w.category.__name__, w.message)
    del store
    try:
        hps.SsdStore(path + "/a", 16, require_direct_io=True)
        print("required O_DIRECT, opened without")
    except hps.IoError as e:
        print("required:", e)
    try:
        hps.SsdStore(path + "/c", 16, direct_io=False, require_direct_io=True)
    except ValueError as e:
        print("contradiction:", e)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to mount a ramfs of its own")
def test_a_filesystem_without_o_direct_warns_once_or_raises_when_required(tmp_path):
    mount = tmp_path / "ramfs"
    mount.mkdir()
    # A mount namespace of the child's own (as root, or user-mapped): the ramfs
    # goes away with it.
    prefix = ["unshare", "--map-root-user", "--mount", "sh", "-c",
              'mount -t ramfs ramfs "$0" || exit 77; exec "$@"', str(mount)]
    done = run(NO_O_DIRECT, mount, prefix=prefix)
    if done.returncode == 77 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    reader = "io_uring" if hps.liburing_compiled() else "pread"
    warned = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: IoPathWarning hps.SsdStore at {mount}/a moves rows by {reader}, not as asked: "
                      f"O_DIRECT refused by the filesystem at {mount}/a: Invalid argument"], done.stdout
    assert (f"required: O_DIRECT refused by the filesystem at {mount}/a: Invalid argument "
            "(require_direct_io is set)") in done.stdout, done.stdout
    assert "contradiction: ssd store: require_direct_io needs direct_io" in done.stdout, done.stdout
