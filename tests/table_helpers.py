"""Readers of a trained table that several test modules share: a job's rows by
rank, and the Lookup budget that leaves a given number of rows to its cache."""
import math

import hps


def rows_of(root) -> dict:
    """{key: (rank, whole row bytes, stamp)} of the job's checkpoint, every rank's
    shard (the stamp: the step of the row's last update, which ttl_steps and
    max_rows read); a key on two ranks fails."""
    from hps.jobdir import latest_records, open_store, pin
    out = {}
    with pin(str(root)) as view:
        for rv in view.ranks:
            keys, _ = latest_records(rv)
            store = open_store(rv, view.job.row_bytes)
            rows, found = store.get(keys)
            stamps, stamped = store.stamps(keys)
            assert found.all() and stamped.all()
            for k, row, stamp in zip(keys.tolist(), rows, stamps.tolist()):
                assert k not in out, f"key {k} on rank {out[k][0]} and rank {rv.rank}"
                out[k] = (rv.rank, row.tobytes(), stamp)
            del store
    return out


def budget_for(path, cache_rows, read_threads=4):
    """The memory_budget whose split (hps.lookup's docstring) leaves cache_rows rows to the
    cache of a Lookup of path: its index, files' metadata, read buffers and calls' working
    memory (at read_threads, the default 4), the reserve for
    the next checkpoint (REFRESH_HEADROOM x the index and metadata, and read buffers), and
    per cached row its bytes, its warm copy in the next cache (a quarter) and its key's."""
    from hps.lookup import REFRESH_HEADROOM, WARM_FRACTION
    with hps.Lookup(path, memory_budget="1GiB", read_threads=read_threads) as lk:
        m = lk.stats()["memory"]
    fixed = m["index_bytes"] + m["file_meta_bytes"]
    per_row = m["cache_row_bytes"] * (1 + 1 / WARM_FRACTION) + 8 / WARM_FRACTION
    return (fixed + math.ceil(REFRESH_HEADROOM * fixed) + 2 * m["read_buffer_bytes"] + m["call_bytes"]
            + math.ceil(cache_rows * per_row))
