"""Which directory entries a power loss may take back: a new entry (a directory
made, a file created, the target of a rename or a link) is durable only once the
directory holding it has been fsync'ed after it was made (fsync(2): "Calling
fsync() does not necessarily ensure that the entry in the directory containing
the file has also reached disk"). No test that reopens a job in the same (or a
killed) process sees the difference: the page cache keeps every entry. So this
log records the Python layer's calls that make entries and sync directories, in
order, and says which entries were not synced by a given point. (The native
store logs its own: tests/native/ssd_durability_test.cc.)

    log = NameLog(monkeypatch)
    ...                                  # the calls under test
    assert log.unsynced(root) == []      # every entry made under root is durable

Entries made by native code (SSD-PS's, pyarrow's) are not seen, nor are the
files that they sync; Python's own syncs of their directories are."""
from __future__ import annotations

import os
from typing import Optional


class NameLog:
    """os.mkdir (os.makedirs too), os.open with O_CREAT of a new path, os.rename,
    os.replace and os.link, and os.fsync of a directory, logged in order while the
    monkeypatch lasts."""

    def __init__(self, monkeypatch):
        self.events: list = []  # ("entry", path) or ("sync", directory), absolute paths
        real = {name: getattr(os, name) for name in ("mkdir", "open", "rename", "replace", "link", "fsync")}

        def mkdir(path, *a, **kw):
            real["mkdir"](path, *a, **kw)
            self._entry(path)

        def open_(path, flags, *a, **kw):
            new = bool(flags & os.O_CREAT) and not os.path.lexists(path)
            fd = real["open"](path, flags, *a, **kw)
            if new:
                self._entry(path)
            return fd

        def rename(src, dst, *a, **kw):
            real["rename"](src, dst, *a, **kw)
            self._entry(dst)

        def replace(src, dst, *a, **kw):
            real["replace"](src, dst, *a, **kw)
            self._entry(dst)

        def link(src, dst, *a, **kw):
            real["link"](src, dst, *a, **kw)
            self._entry(dst)

        def fsync(fd):
            real["fsync"](fd)
            path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            if os.path.isdir(path):
                self.events.append(("sync", path))

        for name, fn in (("mkdir", mkdir), ("open", open_), ("rename", rename), ("replace", replace),
                         ("link", link), ("fsync", fsync)):
            monkeypatch.setattr(os, name, fn)

    def _entry(self, path) -> None:
        self.events.append(("entry", os.path.realpath(os.fsdecode(path))))

    def index_of_entry(self, path) -> int:
        """The index in events of the last entry made at path."""
        path = os.path.realpath(os.fsdecode(path))
        return max(i for i, e in enumerate(self.events) if e == ("entry", path))

    def unsynced(self, root, before: Optional[int] = None, ignore: tuple = (".hps-writer.lock",)) -> list:
        """The entries made at or under root (root's own too) whose directory was
        not fsync'ed after them, within events[:before] (default: all), that still
        exist, but those named as in `ignore` (a writer's lock file: what it holds
        is never read after a crash); sorted. An entry made again (a rename over
        it) needs a sync after its last making."""
        root = os.path.realpath(os.fsdecode(root))
        pending: dict = {}  # entry -> its directory
        for kind, path in self.events[:before]:
            if kind == "entry":
                pending[path] = os.path.dirname(path)
            else:
                for entry in [e for e, d in pending.items() if d == path]:
                    del pending[entry]
        return sorted(e for e in pending
                      if (e == root or e.startswith(root + os.sep)) and os.path.lexists(e)
                      and os.path.basename(e) not in ignore)
