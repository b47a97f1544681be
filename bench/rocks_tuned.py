"""RocksDB as its experts run it for point reads of small rows on an SSD (W1, W5, W11),
and W1's reader process.

This module imports only the standard library and rocksdict, so that a reader process
started from it (`python3 bench/rocks_tuned.py FD`) is a bare interpreter plus the
RocksDB library, not a copy of the benchmark with numpy and hps loaded.
"""
from __future__ import annotations

import os
import sys

ROW_BYTES = 128           # W1's rows
ROCKS_GET_CHUNK = 8192    # keys per multi-get call in a reader


def rocks_tuned_options(block_cache_bytes: int, row_cache_bytes: int, write_buffer_size: int,
                        max_write_buffer_number: int, filters_for_hits: bool, bloom: bool = True):
    """rocksdict Options as a RocksDB expert sets them for point reads of small
    rows on an SSD, every option set explicitly (none left to the bundled
    version's defaults): returns (options, [caches to keep alive], {option: value}).
    bloom=False builds table files without filters (for a bulk load whose keys
    every get finds: optimize_filters_for_hits for files no compaction rewrites)."""
    import rocksdict as r
    cpus = os.cpu_count() or 2
    opt = r.Options(raw_mode=True)
    opt.create_if_missing(True)
    block_cache = r.Cache(block_cache_bytes)
    keep = [block_cache]
    bbo = r.BlockBasedOptions()
    bbo.set_block_cache(block_cache)
    if bloom:
        bbo.set_bloom_filter(10, False)      # full (not block-based) filters, 10 bits a key: ~1% false positives
    bbo.set_block_size(4096)                 # one device read per row, as hps's 4 KiB blocks
    bbo.set_cache_index_and_filter_blocks(False)  # index and filters held by the table readers, never evicted
    bbo.set_format_version(5)
    opt.set_block_based_table_factory(bbo)
    if row_cache_bytes:
        row_cache = r.Cache(row_cache_bytes)
        keep.append(row_cache)
        opt.set_row_cache(row_cache)
    opt.set_use_direct_reads(True)           # the page cache must not act as a hidden cache
    opt.set_use_direct_io_for_flush_and_compaction(True)
    opt.set_compression_type(r.DBCompressionType.none())  # random rows do not compress
    opt.set_bottommost_compression_type(r.DBCompressionType.none())
    opt.set_max_open_files(-1)               # every table reader open: no table-cache misses on a get
    opt.set_optimize_filters_for_hits(filters_for_hits)  # no filters on the last level when gets hit
    opt.set_level_compaction_dynamic_level_bytes(True)
    opt.set_target_file_size_base(64 << 20)
    opt.increase_parallelism(cpus)
    opt.set_max_background_jobs(max(2, cpus))
    opt.set_write_buffer_size(write_buffer_size)
    opt.set_max_write_buffer_number(max_write_buffer_number)
    opt.set_min_write_buffer_number_to_merge(1)
    opt.set_advise_random_on_open(True)
    return opt, keep, {
        "raw_mode": True, "block_cache_bytes": block_cache_bytes, "row_cache_bytes": row_cache_bytes,
        "write_buffer_size": write_buffer_size, "max_write_buffer_number": max_write_buffer_number,
        "min_write_buffer_number_to_merge": 1, "bloom_filter_bits_per_key": 10 if bloom else 0, "bloom_block_based": False,
        "optimize_filters_for_hits": filters_for_hits, "block_size": 4096,
        "cache_index_and_filter_blocks": False, "format_version": 5, "use_direct_reads": True,
        "use_direct_io_for_flush_and_compaction": True, "compression": "none",
        "bottommost_compression": "none", "max_open_files": -1, "level_compaction_dynamic_level_bytes": True,
        "target_file_size_base": 64 << 20, "increase_parallelism": cpus, "max_background_jobs": max(2, cpus),
        "advise_random_on_open": True}


class SortedIngest:
    """The expert's bulk load: rows in key order through SstFileWriter, a table file
    per chunk, then one ingest_external_file(move_files) into the database at
    PATH/db. The files do not overlap, so they go straight to the last level and
    nothing is left to compact. bloom=False leaves the filters out, for a store
    whose every get finds its key (W1): 20M keys' filters (25 MB) would sit in
    every reader process outside its caches. `seconds` counts the store's calls only."""

    def __init__(self, path: str, bloom: bool = True):
        import rocksdict as r
        self.r, self.path = r, path
        self.opt, self._keep, _ = rocks_tuned_options(1 << 20, 0, 64 << 20, 2, filters_for_hits=True, bloom=bloom)
        self.load_dir = os.path.join(path, "load")
        os.makedirs(self.load_dir, exist_ok=True)
        self.files: list[str] = []
        self.seconds = 0.0

    def add(self, keys_be: bytes, rows: bytes, width: int) -> None:
        """One table file: keys as 8-byte big-endian, ascending; rows of `width` bytes."""
        import time
        t0 = time.perf_counter()
        w = self.r.SstFileWriter(options=self.opt)
        fn = os.path.join(self.load_dir, f"{len(self.files):06d}.sst")
        w.open(fn)
        for i in range(len(keys_be) // 8):
            w[keys_be[8 * i:8 * i + 8]] = rows[width * i:width * (i + 1)]
        w.finish()
        self.seconds += time.perf_counter() - t0
        self.files.append(fn)

    def finish(self) -> float:
        import shutil
        import time
        t0 = time.perf_counter()
        db = self.r.Rdict(os.path.join(self.path, "db"), options=self.opt)
        ing = self.r.IngestExternalFileOptions()
        ing.set_move_files(True)
        db.ingest_external_file(self.files, ing)
        db.flush(True)
        db.close()
        self.seconds += time.perf_counter() - t0
        shutil.rmtree(self.load_dir, ignore_errors=True)
        return self.seconds


def serve_reader(conn, path: str, secondary: str, opts: dict, mmap_path: str, mmap_bytes: int) -> None:
    """A reader: a secondary instance of the database (its own block and row caches)
    that serves the get of one key range of each batch with multi-gets, writing the
    rows into the shared result file. rocksdict holds the GIL through a multi-get,
    so concurrent gets need processes. Messages: ("catch_up",), ("get", start row,
    keys as 8-byte big-endian bytes), ("stop",)."""
    import mmap
    import rocksdict as r
    opt, _keep, _ = rocks_tuned_options(**opts)
    db = r.Rdict(path, options=opt, access_type=r.AccessType.secondary(secondary))
    with open(mmap_path, "r+b") as f:
        out = mmap.mmap(f.fileno(), mmap_bytes)
    zero = bytes(ROW_BYTES)
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the worker is gone (the OOM killer, or an error): nothing left to serve
            return
        if msg[0] == "catch_up":
            db.try_catch_up_with_primary()
            conn.send(True)
        elif msg[0] == "get":
            start, kb = msg[1], msg[2]
            keys = [kb[i:i + 8] for i in range(0, len(kb), 8)]
            found = bytearray(len(keys))
            pos = start * ROW_BYTES
            for c in range(0, len(keys), ROCKS_GET_CHUNK):
                vals = db.get(keys[c:c + ROCKS_GET_CHUNK])
                buf = b"".join(v if v is not None else zero for v in vals)
                out[pos:pos + len(buf)] = buf
                pos += len(buf)
                for i, v in enumerate(vals):
                    found[c + i] = v is not None
            conn.send_bytes(found)
        else:
            db.close()
            out.close()
            conn.send(True)
            return


def _reader_main(argv: list[str]) -> None:
    """python3 rocks_tuned.py FD: a reader on the socket FD; its arguments come as the
    first message."""
    import socket
    from multiprocessing.connection import Connection
    sock = socket.socket(fileno=int(argv[1]))
    conn = Connection(sock.detach())
    args = conn.recv()
    serve_reader(conn, **args)


if __name__ == "__main__":
    _reader_main(sys.argv)
