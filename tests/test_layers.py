"""The native core's layers: no file in src/ or include/hps/ includes a header of a higher layer.

The order (docs/architecture.md): util < format < table < store < cache < ps < bindings.
A file in src/<layer>/ belongs to that layer; include/hps/X.h to the layer of its component
(PUBLIC_LAYER). An include names a private header from src/ ("format/key_index.h") or a
public one ("hps/ssd_store.h"); system headers (<...>) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ("util", "format", "table", "store", "cache", "ps", "bindings")

# include/hps/X.h -> the layer of its component. A new public header must be added here.
PUBLIC_LAYER = {
    "config.h": "util",  # generated from config.h.in
    "errors.h": "util",
    "keys.h": "util",
    "optimizer.h": "table",
    "narrow_linear.h": "table",
    "hash_table.h": "table",
    "ssd_store.h": "store",
    "mem_cache.h": "cache",
    "device_tier.h": "ps",
    "backing_store.h": "ps",
    "working_set.h": "ps",
    "herald.h": "ps",
    "topology.h": "ps",
    "admission.h": "ps",
}

SOURCE_SUFFIXES = {".h", ".cc", ".cu", ".cuh", ".in"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of_header(name: str) -> str | None:
    """The layer of an included name ("hps/keys.h", "util/mix64.h"), or None if unknown."""
    parts = name.split("/")
    if len(parts) == 2 and parts[0] == "hps":
        return PUBLIC_LAYER.get(parts[1])
    if len(parts) == 2 and parts[0] in LAYERS:
        return parts[0]
    return None


def layer_of_file(path: Path, root: Path) -> str | None:
    rel = path.relative_to(root).parts
    if rel[:2] == ("include", "hps"):
        return PUBLIC_LAYER.get(Path(rel[2]).name.removesuffix(".in"))
    if rel[0] == "src" and len(rel) == 3 and rel[1] in LAYERS:
        return rel[1]
    return None


def violations(root: Path) -> list[str]:
    """One message per file outside the layers, unknown include, or include of a higher layer."""
    problems = []
    files = [p for d in ("src", "include/hps") for p in sorted((root / d).rglob("*"))
             if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    for path in files:
        rel = path.relative_to(root)
        own = layer_of_file(path, root)
        if own is None:
            problems.append(f"{rel}: in no layer (put it in src/<layer>/ or add it to PUBLIC_LAYER)")
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            m = INCLUDE.match(line)
            if not m:
                continue
            name = m.group(1)
            theirs = layer_of_header(name)
            if theirs is None:
                problems.append(f'{rel}:{lineno}: includes "{name}", which is in no layer '
                                f"(name private headers as <layer>/x.h, public ones as hps/x.h)")
            elif LAYERS.index(theirs) > LAYERS.index(own):
                problems.append(f'{rel}:{lineno}: layer {own} includes "{name}" of the higher '
                                f"layer {theirs}")
    return problems


def test_no_include_points_up_a_layer():
    problems = violations(ROOT)
    assert not problems, "upward or unplaced includes:\n" + "\n".join(problems)


def test_every_public_header_has_a_layer():
    headers = {p.name.removesuffix(".in") for p in (ROOT / "include/hps").iterdir()}
    assert headers == set(PUBLIC_LAYER), f"add to or remove from PUBLIC_LAYER: {headers ^ set(PUBLIC_LAYER)}"


@pytest.mark.parametrize("layer,included,bad", [
    ("format", "hps/hash_table.h", True),   # key_index.h once took kEmptyKey from here
    ("format", "hps/ssd_store.h", True),    # param_file.h once took IoError from here
    ("util", "format/param_file.h", True),  # block_io.cc once took ReadFully from here
    ("format", "hps/keys.h", False),
    ("ps", "table/table_kernels.h", False),
    ("cache", "cache/cache_policy.h", False),
])
def test_the_check_finds_an_upward_include(tmp_path, layer, included, bad):
    (tmp_path / "include/hps").mkdir(parents=True)
    (tmp_path / "src" / layer).mkdir(parents=True)
    (tmp_path / "src" / layer / "x.cc").write_text(f'// a file\n#include <vector>\n#include "{included}"\n')
    problems = violations(tmp_path)
    if bad:
        assert len(problems) == 1 and problems[0].startswith(f"src/{layer}/x.cc:3: layer {layer} "), problems
    else:
        assert problems == []
