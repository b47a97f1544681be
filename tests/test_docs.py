"""The examples in docstrings run as written, and what the user docs show (configs,
config keys, commands, hps names) is what hps takes."""
import argparse
import dataclasses
import doctest
import importlib
import re
import shlex
import tempfile
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import hps.admission
import hps.config
import hps.data
import hps.data.keys
import hps.data.synthetic
import hps.embedding
import hps.hash_table
import hps.herald
import hps.mem_cache
import hps.metrics
import hps.parameter_server
import hps.ssd_store

MODULES = [hps.config, hps.hash_table, hps.embedding, hps.ssd_store, hps.mem_cache, hps.parameter_server, hps.data,
           hps.data.keys, hps.data.synthetic, hps.metrics, hps.herald, hps.admission]  # hps.data's testmod skips the submodules' examples


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module, tmp_path, monkeypatch):
    # The examples make their stores with tempfile.mkdtemp, as a user would;
    # here those land under pytest's tmp_path, not left behind in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


# ---------------------------------------------------------------- the user docs

# What a user copies from the docs (README, the guides in docs/, examples/*.toml) is
# checked against the code here: the configs load, the config keys and commands exist,
# the hps names resolve. docs/benchmarks.md holds benchmark runs' figures, not guides.
ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
TOPOLOGY_EXAMPLES = sorted((ROOT / "examples" / "topologies").glob("*.toml"))
SUBCOMMANDS = ("train", "demo", "inspect", "export", "serve", "plan", "topology", "size")


def _train_config(raw: dict, source: str):
    """A TOML's tables as `hps train --config` reads them ([hierarchical] apart)."""
    pytest.importorskip("torch", reason="[hierarchical]'s checks import its planner, which needs torch")
    from hps.hierarchical.roles import HierarchicalConfig
    from hps.train import TrainConfig
    raw = dict(raw)
    if "hierarchical" in raw:
        HierarchicalConfig.from_dict(raw.pop("hierarchical"), f"{source}: [hierarchical]")
    return TrainConfig.from_dict(raw, source=source)


def _config_sections() -> dict:
    """Each TOML table a config takes -> the names it takes there ("" the top level)."""
    pytest.importorskip("torch", reason="hps.hierarchical.planner needs torch")
    from hps.data import Schema
    from hps.distributed.comm import DistributedConfig
    from hps.hierarchical.planner import PlannerConfig
    from hps.hierarchical.roles import HierarchicalConfig
    from hps.optim import SGD, AdaGrad, Adam, Normal, Uniform
    from hps.parameter_server import ParameterServerConfig, SsdOptions
    from hps.train import AdmissionConfig, DataConfig, TrainConfig

    def names(*classes):
        return {f.name for c in classes for f in dataclasses.fields(c)}
    return {"": names(TrainConfig), "ps": names(ParameterServerConfig), "ps.ssd": names(SsdOptions),
            "ps.optimizer": names(SGD, AdaGrad, Adam) | {"kind"}, "ps.initializer": names(Uniform, Normal) | {"kind"},
            "data": names(DataConfig), "data.schema": names(Schema), "distributed": names(DistributedConfig),
            "admission": names(AdmissionConfig), "hierarchical": names(HierarchicalConfig),
            "hierarchical.planner": names(PlannerConfig)}


def _guide_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_loads_as_hps_train_reads_it(path):
    # (warnings are errors in this suite: an example that warns fails too)
    from hps.config import load_toml
    cfg = _train_config(load_toml(path), str(path))
    assert cfg.ps.dim >= 1


@pytest.mark.parametrize("path", TOPOLOGY_EXAMPLES, ids=lambda p: p.name)
def test_every_example_topology_loads(path):
    import hps.topology
    assert hps.topology.load(path).endpoints


def _toml_blocks():
    """The TOML a guide shows: ```toml blocks, and indented blocks that open with a table."""
    for path in GUIDES:
        text = _guide_text(path)
        for m in re.finditer(r"```toml\n(.*?)```", text, re.S):
            yield path.name, m.group(1)
        for m in re.finditer(r"(?:^|\n\n)((?: {4}.*\n(?:\n(?= {4}))?)+)", text):  # (blank lines inside)
            block = textwrap.dedent(m.group(1))
            if re.match(r"\[[a-z_.]+\]\s*(#.*)?$", block.split("\n", 1)[0]):
                yield path.name, block


def test_the_toml_the_guides_show_is_a_config_hps_train_takes(tmp_path):
    blocks = list(_toml_blocks())
    assert len(blocks) >= 3  # [data] with [data.schema], [admission], the bounded tables' [ps]
    for name, block in blocks:
        raw = tomllib.loads(block)
        raw.setdefault("ps", {}).setdefault("dim", 8)
        raw["ps"].setdefault("path", str(tmp_path / "ps"))
        try:
            _train_config(raw, name)
        except ValueError as e:
            pytest.fail(f"{name}: this block is refused: {e}\n{block}")


def test_every_config_key_the_guides_name_exists():
    # `[ps] schedule = ...`, [ps] `ttl_steps`, `[data]` `online_idle`, `ps.optimizer.eps = 0`
    sections = _config_sections()
    patterns = [r"`\[([a-z_.]+)\] ([a-z_]+)", r"\[([a-z_.]+)\]`? `([a-z_]+)`",
                r"`((?:ps|data|distributed|admission|hierarchical)(?:\.[a-z_]+)*)\.([a-z_]+) ="]
    named, unknown = 0, []
    for path in GUIDES + EXAMPLES:
        text = _guide_text(path)
        for pattern in patterns:
            for m in re.finditer(pattern, text):
                section, key = m.groups()
                if section not in sections:
                    continue  # (a table of another file: a topology's, the store's MANIFEST)
                named += 1
                if key not in sections[section]:
                    unknown.append(f"{path.name}: {m.group(0)!r}: [{section}] has no field {key!r}")
    assert named >= 20
    assert not unknown, "\n".join(unknown)


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(name)


def test_every_hps_name_the_guides_give_exists():
    names = {(path.name, m.group(1)) for path in GUIDES
             for m in re.finditer(r"`(hps(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", _guide_text(path))}
    assert len(names) >= 30
    missing = []
    for where, name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{where}: {name}: {e}")
    assert not missing, "\n".join(missing)


def test_every_file_and_test_the_guides_point_to_exists():
    # src/cache/mem_cache.cc, tests/test_lookahead.py, docs/results/w11.jsonl, tests/x.py::test_y
    named, missing = 0, []
    for path in GUIDES + EXAMPLES:
        text = _guide_text(path)
        for m in re.finditer(r"(?<![\w/.-])(?:tests|src|include|bench|python|examples|docs)/[\w./-]*\w", text):
            if m.group(0) == "examples/s":
                continue  # (a rate: examples/s)
            named += 1
            if not (ROOT / m.group(0)).exists():
                missing.append(f"{path.name}: {m.group(0)}")
        for m in re.finditer(r"(tests/\w+\.py)::(\w+)", text):
            if (ROOT / m.group(1)).exists() and f"def {m.group(2)}(" not in (ROOT / m.group(1)).read_text():
                missing.append(f"{path.name}: {m.group(0)}")
    assert named >= 50
    assert not missing, "\n".join(missing)


def _documented_calls():
    """`Name(a, b=1, ...)` as the guides write a call of an hps class or function: where hps,
    hps.data or hps.torch has that name, (where, text, the object, positional names, keywords)."""
    modules = [hps, hps.data]
    try:
        modules.append(importlib.import_module("hps.torch"))
    except ImportError:  # (no torch: its classes' calls go unchecked)
        pass
    for path in GUIDES:
        for m in re.finditer(r"`([A-Z]\w*)\(([^`()]*)\)`", _guide_text(path)):
            obj = next((getattr(mod, m.group(1)) for mod in modules if hasattr(mod, m.group(1))), None)
            if obj is None:
                continue  # a C++ name (`Accumulate(positions, grads)`)
            args = [a.strip() for a in m.group(2).split(",") if a.strip() and a.strip() != "..."]
            positional = [a for a in args if "=" not in a]
            keywords = [a.split("=")[0].strip() for a in args if "=" in a]
            yield path.name, m.group(0), obj, positional, keywords


def test_every_call_the_guides_show_takes_its_arguments_as_shown():
    # `SyntheticCriteo(seed, vocab_sizes, zipf_a, ...)` was shown, whose vocab_sizes and
    # zipf_a are keyword-only: the call as written is refused.
    import inspect
    calls = list(_documented_calls())
    assert len(calls) >= 3
    refused = []
    for where, text, obj, positional, keywords in calls:
        try:
            inspect.signature(obj).bind_partial(*positional, **dict.fromkeys(keywords))  # (a call may show some)
        except TypeError as e:
            refused.append(f"{where}: {text}: {e}")
    assert not refused, "\n".join(refused)


def _documented_commands():
    """`hps <command> ...` as the guides and the examples' comments write them, with the
    optional parts ([...]) given and placeholders (N, DIR, PATH ...) filled in."""
    # (a command's optional parts may go on over the next lines: "\n    [--report DIR]")
    pattern = re.compile(rf"(?<![\w.-])hps ({'|'.join(SUBCOMMANDS)})((?: [^`\n]*)?(?:\n *\[[^`\n]*)*)")
    for path in GUIDES + EXAMPLES:
        for m in pattern.finditer(_guide_text(path)):
            rest = re.split(r" {2}|\(|`", re.sub(r"\n +", " ", m.group(2)))[0].rstrip()
            if not rest or not re.match(r" (-|\[|PATH\b)", rest):
                continue  # the command named in prose ("`hps plan` prints"), or a message ("hps train: ...")
            args = rest.replace("[", " ").replace("]", " ").replace("...", " ")
            args = re.sub(r"\b(N|S)\b", "1000", args)
            args = re.sub(r"\b[A-Z][A-Z0-9_]*\b", "x", args)
            yield path.name, m.group(0), [m.group(1)] + shlex.split(args)


def test_every_hps_command_the_guides_show_parses():
    from hps.cli import parser
    commands = list(_documented_commands())
    assert {c[2][0] for c in commands} >= {"train", "demo", "inspect", "export", "serve", "plan", "size"}
    refused = []
    for where, text, argv in commands:
        try:
            parser().parse_args(argv)
        except SystemExit:
            refused.append(f"{where}: {text!r} (as {argv})")
    assert not refused, "the command line refuses:\n" + "\n".join(refused)


@pytest.mark.parametrize("argv", [["train", "--config", "x.toml", "--check", "10"],
                                  ["serve", "x", "--refresh", "1"], ["inspect", "x", "--ver"]])
def test_a_prefix_of_a_flag_is_refused(argv, capsys):
    # Taken as the flag it began, a prefix in a script or a guide (--check for
    # --checkpoint-every) worked until a new flag made it ambiguous.
    from hps.cli import parser
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2 and "unrecognized arguments: " in capsys.readouterr().err


def test_a_renamed_flag_or_key_would_be_caught(capsys):
    # The checks above find what they look for: a flag, a key and a name that do not exist.
    from hps.cli import parser
    with pytest.raises(SystemExit):
        parser().parse_args(["train", "--config", "x.toml", "--no-such-flag"])
    capsys.readouterr()
    assert "no_such_key" not in _config_sections()["ps"]
    with pytest.raises(AttributeError):
        _resolve("hps.train.NoSuchName")
    assert isinstance(parser(), argparse.ArgumentParser)


# ---------------------------------------------------------------- the guides' Python

# The guides whose ```python blocks run as written, one after another in one namespace
# (the other guides' blocks are sketches, with names the text defines: keys, grads).
RUNNABLE = ["README.md", "docs/training.md"]


@pytest.mark.parametrize("guide", RUNNABLE)
def test_the_python_a_guide_shows_runs_as_written(guide, tmp_path, capsys):
    """Each block of the guide run as a user pastes it, its /tmp paths moved under
    tmp_path; a print's output is what its comment says."""
    text = (ROOT / guide).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, f"{guide} shows no Python"
    if "import torch" in "".join(blocks) or "hps.torch" in "".join(blocks):
        pytest.importorskip("torch", reason=f"{guide}'s Python needs torch")
    source = "\n".join(blocks)
    source = re.sub(r'"/tmp/([\w.-]+)"', lambda m: repr(str(tmp_path / m.group(1))), source)
    exec(compile(source, guide, "exec"), {"__name__": "__guide__"})
    printed = capsys.readouterr().out.splitlines()
    said = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.*)$", source, re.M)]
    assert printed == said
