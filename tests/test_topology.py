"""Topology files, fake sysfs trees, the router on the shipped nodes, the host executor,
and the core binding plan (issue 17)."""
from __future__ import annotations

import os
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import hps
import hps.topology as T

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "examples" / "topologies"
SHIPPED = ("figure1", "dgx1", "nvswitch", "pcie_only")


def link_between(topo: T.Topology, a: str, b: str) -> T.Link | None:
    ia, ib = topo.index(a), topo.index(b)
    for link in topo.links:
        if {link.a, link.b} == {ia, ib}:
            return link
    return None


# ------------------------------------------------------------------ files
def test_figure1_parses_into_its_devices_and_links():
    t = T.load(TOPOLOGIES / "figure1.toml")
    assert [d.name for d in t.devices if d.kind == "gpu"] == [f"gpu{i}" for i in range(8)]
    assert [t.devices[i].numa for i in t.endpoints] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sorted(t.numa_cores) == [0, 1] and len(t.numa_cores[0]) == 48
    for d in (5, 6, 7):
        assert link_between(t, "gpu0", f"gpu{d}") is None
    two = link_between(t, "gpu0", "gpu3")
    assert (two.bridges, two.gbps, two.kind) == (2, 50.0, "nvlink")
    one = link_between(t, "gpu0", "gpu1")
    assert (one.bridges, one.gbps) == (1, 25.0)
    assert link_between(t, "cpu0", "cpu1").kind == "upi"
    assert t.nvme == [("nvme0", 0), ("nvme1", 1)] and t.nics == [("eth0", 1)]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_files_route_every_pair(name):
    t = T.load(TOPOLOGIES / f"{name}.toml")
    m = T.even_all_to_all(8, 1 << 16, 256)
    for schedule in T.SCHEDULES:
        plan = t.plan(m, schedule)
        assert len(plan["routes"]) == 56
        assert plan["seconds"] > 0
    host, relay = t.plan(m, "host"), t.plan(m, "relay")
    assert relay["seconds"] <= host["seconds"]
    if name in ("nvswitch", "pcie_only"):
        assert relay["route_count"]["relay"] == 0  # nothing to gain from a middleman
    else:
        # Relaying a pair alone costs more than its host path on the DGX-1 (two
        # 20 GB/s legs vs one 12 GB/s), but not in the all-to-all, where the
        # switches' uplinks are shared: the router must find that.
        assert relay["route_count"]["relay"] > 0
        assert relay["seconds"] < 0.5 * t.plan(m, "direct")["seconds"]


def test_figure1_relays_around_the_missing_links_with_the_reason():
    t = T.load(TOPOLOGIES / "figure1.toml")
    m = T.even_all_to_all(8, 1_000_000, 256)
    plan = t.plan(m, "relay")
    by = {(r["src"], r["dst"]): r for r in plan["routes"]}
    for d in (5, 6, 7):
        r = by[(0, d)]
        assert r["kind"] == "relay", r
        mid = f"gpu{r['via']}"
        # the middleman has NVLinks to both ends
        assert link_between(t, "gpu0", mid).kind == "nvlink"
        assert link_between(t, mid, f"gpu{d}").kind == "nvlink"
        assert r["path"] == [0, r["via"], d]
        assert "no direct link" in r["reason"] and "host path" in r["reason"]
    assert by[(0, 1)]["kind"] == "direct"
    host = t.plan(m, "host")
    assert host["route_count"]["host"] == 56
    # W8's target: relayed at least 75% below direct through host memory
    assert plan["seconds"] <= 0.25 * host["seconds"]


def test_fixed_rules_and_their_errors():
    t = T.load(TOPOLOGIES / "figure1.toml")
    m = T.even_all_to_all(8, 1_000_000, 256)
    via = np.full((8, 8), -1)
    via[0, 5], via[0, 6], via[0, 7] = 1, 2, 3  # the partner rule for GPU 0 only
    p = t.plan_fixed(m, via)
    by = {(r["src"], r["dst"]): r for r in p["routes"]}
    assert [by[(0, d)]["via"] for d in (5, 6, 7)] == [1, 2, 3]
    assert by[(1, 4)]["kind"] == "host"  # unlinked and no middleman given
    assert p["route_count"] == {"none": 8, "direct": 32, "host": 21, "relay": 3}
    via[0, 5] = 6
    with pytest.raises(ValueError, match="gpu0 -> gpu5 relays via gpu6, which has no direct path to gpu0"):
        t.plan_fixed(m, via)
    with pytest.raises(ValueError, match=r"via must be \(8, 8\)"):
        t.plan_fixed(m, via[:4])


def test_host_partitions_are_flat():
    t = T.host_partitions(4, numa_cores={0: [0, 1]})
    plan = t.plan(T.even_all_to_all(4, 1 << 12, 64), "relay")
    assert {r["kind"] for r in plan["routes"]} == {"host"}
    assert {tuple(r["path"][1:-1]) for r in plan["routes"]} == {(4,)}


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return p


GOOD = """name = "tiny"
[[device]]
name = "g0"
kind = "gpu"
[[device]]
name = "g1"
kind = "gpu"
[[link]]
between = ["g0", "g1"]
kind = "nvlink"
gbps = 25.0
latency_us = 1.0
"""


def test_good_tiny_file_loads(tmp_path):
    t = T.load(write(tmp_path, GOOD))
    assert t.name == "tiny" and len(t.links) == 1 and t.devices[0].numa == -1


@pytest.mark.parametrize("edit, line, where", [
    (('gbps = 25.0', 'gbps = 0'), 11, "link[0].gbps: must be > 0"),
    (('gbps = 25.0', 'gbps = "fast"'), 11, "link[0].gbps: expected a number"),
    (('gbps = 25.0\n', ''), 8, "link[0]: missing field 'gbps'"),
    (('kind = "gpu"\n[[link]]', 'kind = "tpu"\n[[link]]'), 7, "device[1].kind: 'tpu' is not one of"),
    (('["g0", "g1"]', '["g0", "g9"]'), 9, "link[0].between: no device named 'g9'"),
    (('["g0", "g1"]', '["g0", "g0"]'), 9, "link[0].between: joins g0 to itself"),
    (('latency_us = 1.0', 'latency_us = -1'), 12, "link[0].latency_us: must be >= 0"),
    (('latency_us = 1.0', 'latency_us = 1.0\nspeed = 3'), 13, "link[0].speed: unknown field"),
    (('name = "g1"', 'name = "g0"'), 6, "device[1].name: 'g0' is already device 0"),
    # numbers TOML reads that the router refuses, found here rather than at the first plan
    (('gbps = 25.0', 'gbps = inf'), 11, "link[0].gbps: must be > 0 and finite, got inf"),
    (('gbps = 25.0', 'gbps = 1' + '0' * 400), 11, "link[0].gbps: must be > 0 and finite"),
    (('latency_us = 1.0', 'latency_us = inf'), 12, "link[0].latency_us: must be >= 0 and finite, got inf"),
    (('gbps = 25.0', 'gbps = 1e308\nbridges = 10'), 12, "link[0].bridges: 10 bridges of 1e+308 GB/s overflow"),
    (('kind = "gpu"\n[[link]]', 'kind = "gpu"\nnuma = 3000000000\n[[link]]'), 8,
     "device[1].numa: must be -1 (unknown) or a node number in [0, 2147483647], got 3000000000"),
    (('kind = "gpu"\n[[link]]', 'kind = "gpu"\nnuma = -2\n[[link]]'), 8, "device[1].numa: must be -1 (unknown)"),
])
def test_bad_files_name_file_line_and_field(tmp_path, edit, line, where):
    p = write(tmp_path, GOOD.replace(*edit, 1))
    with pytest.raises(T.TopologyError) as e:
        T.load(p)
    assert str(e.value).startswith(f"{p}:{line}: "), str(e.value)
    assert where in str(e.value)


def test_bad_files_other_errors(tmp_path):
    with pytest.raises(T.TopologyError, match="not TOML"):
        T.load(write(tmp_path, "[[device]\n"))
    with pytest.raises(T.TopologyError, match="cannot read"):
        T.load(tmp_path / "missing.toml")
    dup = GOOD + '[[link]]\nbetween = ["g1", "g0"]\nkind = "pcie"\ngbps = 12\nlatency_us = 1\n'
    with pytest.raises(T.TopologyError, match=r":14: link\[1\].between: g1-g0 is already link 0"):
        T.load(write(tmp_path, dup))
    with pytest.raises(T.TopologyError, match=r":2: numa\[0\].node: must be a node number in \[0, 2147483647\], got -1"):
        T.load(write(tmp_path, '[[numa]]\nnode = -1\ncpus = "0"\n' + GOOD.replace('name = "tiny"\n', "")))
    cpus = '[[numa]]\nnode = 0\ncpus = "3-1"\n' + GOOD.replace('name = "tiny"\n', "")
    with pytest.raises(T.TopologyError, match=r":3: numa\[0\].cpus: not a cpulist"):
        T.load(write(tmp_path, cpus))
    with pytest.raises(T.TopologyError, match=r"bad.toml:2: unknown field 'speed'"):
        T.load(write(tmp_path, 'name = "x"\nspeed = 3\n' + GOOD.replace('name = "tiny"\n', "")))
    with pytest.raises(T.TopologyError, match=r"bad.toml:1: name: expected a string, got 3"):
        T.load(write(tmp_path, GOOD.replace('name = "tiny"', "name = 3")))
    with pytest.raises(T.TopologyError, match="no device of kind gpu or host"):
        T.load(write(tmp_path, 'name = "x"\n[[device]]\nname = "c"\nkind = "cpu"\n'))


def test_matrix_and_schedule_errors():
    t = T.load(TOPOLOGIES / "figure1.toml")
    with pytest.raises(ValueError, match=r"must be \(8, 8\), got \(7, 7\)"):
        t.plan(np.zeros((7, 7)), "relay")
    with pytest.raises(ValueError, match="schedule must be 'host', 'direct' or 'relay', got 'fast'"):
        t.plan(np.zeros((8, 8)), "fast")


# ------------------------------------------------------------------ executor
@pytest.mark.parametrize("schedule", T.SCHEDULES)
def test_host_executor_delivers_what_a_direct_copy_does(schedule):
    t = T.load(TOPOLOGIES / "figure1.toml")
    rng = np.random.default_rng(3)
    m = rng.integers(0, 3000, size=(8, 8)).astype(np.uint64)
    m[0, 5] = 0
    send = [rng.integers(0, 256, size=int(m[s].sum()), dtype=np.uint8) for s in range(8)]
    recv = [np.full(int(m[:, d].sum()), 0xAB, dtype=np.uint8) for d in range(8)]
    want = []
    for d in range(8):
        parts = []
        for s in range(8):
            off = int(m[s, :d].sum())
            parts.append(send[s][off:off + int(m[s, d])])
        want.append(np.concatenate(parts))
    stats = t.execute_on_host(m, schedule, send, recv)
    for d in range(8):
        np.testing.assert_array_equal(recv[d], want[d])
    plan = t.plan(m, schedule)
    if schedule == "relay":
        assert plan["relayed_bytes"] > 0 and stats["staged_bytes"] >= plan["relayed_bytes"]
    if schedule == "host":
        assert stats["staged_bytes"] == int(m.sum() - np.trace(m))


def zeroed_exchange():
    """figure1, an even all-to-all of 640 bytes a pair, and zeroed buffers for it."""
    t = T.load(TOPOLOGIES / "figure1.toml")
    m = T.even_all_to_all(8, 640, 1)
    send = [np.zeros(int(m[s].sum()), np.uint8) for s in range(8)]
    recv = [np.zeros(int(m[:, d].sum()), np.uint8) for d in range(8)]
    return t, m, send, recv


def test_host_executor_refuses_wrong_buffers():
    t, m, send, recv = zeroed_exchange()
    with pytest.raises(ValueError, match=r"recv\[3\] must be a contiguous uint8 array of 70 bytes"):
        t.execute_on_host(m, "relay", send, recv[:3] + [np.zeros(69, np.uint8)] + recv[4:])
    with pytest.raises(ValueError, match="need 8 buffers each"):
        t.execute_on_host(m, "relay", send[:7], recv)


# ------------------------------------------------------------------ sysfs
def fake_sysfs(root: Path, nodes: int, cores_per_node: int, gpus_per_node: int, nvme_node: int, nic_node: int):
    T.write_fake_sysfs(str(root), nodes, cores_per_node, gpus_per_node, nvme_node, nic_node)


@pytest.mark.parametrize("nodes", [2, 4])
def test_fake_sysfs_trees_discover_devices_and_bind(tmp_path, nodes):
    fake_sysfs(tmp_path, nodes, cores_per_node=4, gpus_per_node=2, nvme_node=nodes - 1, nic_node=1)
    t = T.discover(str(tmp_path), gpus=False)
    assert t.numa_cores == {n: list(range(4 * n, 4 * n + 4)) for n in range(nodes)}
    gpus = [t.devices[i] for i in t.endpoints]
    assert [g.name for g in gpus] == [f"gpu{i}" for i in range(2 * nodes)]
    assert [g.numa for g in gpus] == [n for n in range(nodes) for _ in range(2)]
    pcie = [l for l in t.links if l.kind == "pcie"]
    assert len(pcie) == 2 * nodes and all(l.gbps == pytest.approx(31.51, abs=0.01) for l in pcie)
    assert len([l for l in t.links if l.kind == "numa-assumed"]) == nodes * (nodes - 1) // 2
    assert t.nvme == [("nvme0", nodes - 1)] and t.nics == [("eth0", 1)]
    b = t.binding_plan()
    assert not b.noop
    assert b.cores_of("ssd_io") == list(range(4 * (nodes - 1), 4 * nodes))
    assert b.cores_of("reader") == [4, 5, 6, 7]
    for i, g in enumerate(gpus):
        assert b.cores_of(f"load:{g.name}") == t.numa_cores[g.numa]
    assert "NUMA node" in b.stages[0].reason
    # GPUs on different nodes route through both CPUs
    plan = t.plan(T.even_all_to_all(2 * nodes, 1 << 12, 64), "relay")
    far = next(r for r in plan["routes"] if r["src"] == 0 and r["dst"] == 2 * nodes - 1)
    assert far["kind"] == "host" and len(far["path"]) == 4


def test_one_node_binding_is_a_noop(tmp_path):
    fake_sysfs(tmp_path, 1, cores_per_node=8, gpus_per_node=0, nvme_node=0, nic_node=0)
    t = T.discover(str(tmp_path), gpus=False, host_partitions_if_no_gpu=4)
    assert [t.devices[i].kind for i in t.endpoints] == ["host"] * 4
    b = t.binding_plan()
    assert b.noop and "no-op" in b.reason
    assert b.cores_of("ssd_io") == list(range(8))
    with pytest.raises(KeyError, match="no stage 'load:gpu0'"):
        b.cores_of("load:gpu0")


def test_binding_names_unknown_drive(tmp_path):
    fake_sysfs(tmp_path, 2, cores_per_node=2, gpus_per_node=1, nvme_node=1, nic_node=0)
    t = T.discover(str(tmp_path), gpus=False)
    with pytest.raises(KeyError, match="no NVMe drive 'nvme7'.*known: nvme0"):
        t.binding_plan(nvme="nvme7")


def add_memory_only_node(root: Path, node: int):
    """A NUMA node with memory and no cores (a CXL expander, GH200's GPU memory): the
    kernel lists it with an empty cpulist."""
    d = root / "devices" / "system" / "node" / f"node{node}"
    d.mkdir(parents=True)
    (d / "cpulist").write_text("\n")


def test_memory_only_nodes_are_no_place_to_bind(tmp_path):
    # One socket and a CXL memory node counted as two NUMA nodes: binding was planned
    # for real, and a device the kernel put on the memory node got an empty core list.
    fake_sysfs(tmp_path, 1, cores_per_node=4, gpus_per_node=2, nvme_node=0, nic_node=0)
    add_memory_only_node(tmp_path, 1)
    (tmp_path / "bus" / "pci" / "devices" / "0000:11:00.0" / "numa_node").write_text("-1\n")
    t = T.discover(str(tmp_path), gpus=False)
    assert t.numa_cores == {0: [0, 1, 2, 3], 1: []}
    assert [t.devices[i].numa for i in t.endpoints] == [0, 0]  # the unknown node is the one socket's
    b = t.binding_plan()
    assert b.noop and b.reason.startswith("one NUMA node (4 cores, and memory-only node 1)"), b.reason
    assert all(s.cores == [0, 1, 2, 3] for s in b.stages)
    assert T.apply_binding(b, "loader")["cores"] is None
    assert t.cpu_nodes == {0: [0, 1, 2, 3]}
    # Two sockets and a memory node with the drive on it: the drive's stage gets every
    # core, not none.
    fake_sysfs(tmp_path / "two", 2, cores_per_node=2, gpus_per_node=1, nvme_node=2, nic_node=1)
    add_memory_only_node(tmp_path / "two", 2)
    t = T.discover(str(tmp_path / "two"), gpus=False)
    b = t.binding_plan()
    assert not b.noop and b.reason.startswith("2 NUMA nodes, and memory-only node 2:"), b.reason
    assert b.cores_of("ssd_io") == [0, 1, 2, 3]
    assert "nvme0 is on NUMA node 2, which has no cores (memory only)" in b.stages[0].reason
    assert b.cores_of("reader") == [2, 3] and b.cores_of("load:gpu0") == [0, 1]
    assert all(s.cores for s in b.stages)


def test_host_partitions_go_to_nodes_with_cores(tmp_path, capsys):
    # A memory-only node 0 (the cores on nodes 1 and 2) got the host partitions: their
    # load threads were bound to every core, as if their node were unknown, and `hps
    # topology`'s "one host partition a NUMA node" put them all on node 0.
    fake_sysfs(tmp_path, 3, cores_per_node=4, gpus_per_node=0, nvme_node=1, nic_node=2)
    (tmp_path / "devices" / "system" / "node" / "node0" / "cpulist").write_text("\n")
    t = T.discover(str(tmp_path), host_partitions_if_no_gpu=2)
    assert [(t.devices[i].name, t.devices[i].numa) for i in t.endpoints] == [("host0", 1), ("host1", 1)]
    assert all(link_between(t, f"host{k}", "cpu1") for k in range(2))
    b = t.binding_plan()
    assert b.cores_of("load:host0") == b.cores_of("load:host1") == [4, 5, 6, 7]
    assert b.stages[2].reason == "host0 is on NUMA node 1"
    hosts = T.host_partitions(2, numa_cores=t.numa_cores)
    assert [hosts.devices[i].numa for i in hosts.endpoints] == [1, 2]
    assert hosts.binding_plan().cores_of("load:host1") == [8, 9, 10, 11]
    assert [d.numa for d in T.host_partitions(3, numa_cores={0: [0, 1]}).devices] == [0, 0, 0, 0]
    from hps.cli import main
    assert main(["topology", "--sysfs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    binding = out[out.index("core binding:"):]
    assert "load:host0  1     4-7" in binding and "load:host1  2     8-11" in binding, binding


def test_cli_gives_memory_only_nodes_no_host_partition(tmp_path, capsys):
    from hps.cli import main
    fake_sysfs(tmp_path, 1, cores_per_node=4, gpus_per_node=0, nvme_node=0, nic_node=0)
    add_memory_only_node(tmp_path, 1)
    assert main(["topology", "--sysfs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "one endpoint: nothing to route" in out and "binding is a no-op" in out


# ------------------------------------------------------------------ `hps topology`
def test_cli_prints_a_file_and_plots(tmp_path, capsys):
    from hps.cli import main
    pytest.importorskip("matplotlib")
    png = tmp_path / "figure1.png"
    assert main(["topology", "--file", str(TOPOLOGIES / "figure1.toml"), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "topology: figure1" in out and f"plot: {png}" in out
    grid = out[out.index("routes of an even all-to-all"):].splitlines()
    row0 = next(line for line in grid if line.startswith("gpu0 "))
    cells = row0.split()[1:]
    assert cells[:5] == [".", "D", "D", "D", "D"] and all(c.startswith("R") for c in cells[5:]), row0
    assert "gpu0 -> gpu5: relay via" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def endpoint_grid(out: str) -> dict[tuple[str, str], str]:
    """`hps topology`'s grid of how each endpoint pair is joined, as {(row, column): mark}."""
    lines = out[out.index("how each endpoint pair is joined"):].splitlines()[1:]
    names = lines[0].split()
    grid = {}
    for line in lines[2:]:
        if not line.strip() or line.startswith(" "):  # the legend below it
            break
        row, *cells = line.split()
        grid.update({(row, col): c for col, c in zip(names, cells)})
    return grid


def test_cli_grid_names_what_joins_each_pair(tmp_path, capsys):
    # Pairs without a link of their own printed "-" (joined by nothing) although an
    # NVSwitch fabric, a PCIe switch or the CPUs join them, and the SW / SYS marks the
    # comment promised were never printed.
    from hps.cli import main
    marks = {}
    for name in ("nvswitch", "pcie_only", "figure1"):
        assert main(["topology", "--file", str(TOPOLOGIES / f"{name}.toml")]) == 0
        marks[name] = endpoint_grid(capsys.readouterr().out)
    gpus = [f"gpu{k}" for k in range(8)]
    assert all(marks["nvswitch"][(a, b)] == ("X" if a == b else "SW12") for a in gpus for b in gpus)
    pcie = marks["pcie_only"]
    assert (pcie[("gpu0", "gpu1")], pcie[("gpu0", "gpu2")], pcie[("gpu0", "gpu4")]) == ("PIX", "PHB", "SYS")
    fig1 = marks["figure1"]
    assert (fig1[("gpu0", "gpu3")], fig1[("gpu0", "gpu1")], fig1[("gpu0", "gpu5")], fig1[("gpu1", "gpu3")]) == \
        ("NV2", "NV1", "SYS", "NV1")
    # a discovered NVSwitch machine: the fabric, not the PCIe path through the CPUs
    gpus_bus, nvml = dgx_a100_nvml(tmp_path)
    mp = pytest.MonkeyPatch()
    try:
        mp.setitem(sys.modules, "pynvml", nvml)
        assert main(["topology", "--sysfs", str(tmp_path)]) == 0
    finally:
        mp.undo()
    found = endpoint_grid(capsys.readouterr().out)
    assert all(found[(a, b)] == ("X" if a == b else "SW12") for a in gpus for b in gpus)
    # without NVML the same GPUs are joined through their sockets
    assert main(["topology", "--sysfs", str(tmp_path)]) == 0
    found = endpoint_grid(capsys.readouterr().out)
    assert (found[("gpu0", "gpu1")], found[("gpu0", "gpu4")]) == ("PHB", "SYS")
    # host partitions: through the one memory
    hosts = T.host_partitions(2)
    assert endpoint_grid(T.format_text(hosts, rows=64))[("host0", "host1")] == "PHB"


def test_cli_discovers_a_fake_one_node_machine(tmp_path, capsys):
    from hps.cli import main
    fake_sysfs(tmp_path, 1, cores_per_node=4, gpus_per_node=0, nvme_node=0, nic_node=0)
    assert main(["topology", "--sysfs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no GPU: one host partition a NUMA node" in out
    assert "binding is a no-op" in out
    assert main(["topology", "--file", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read the topology file" in capsys.readouterr().err


def test_cli_refuses_a_missing_sysfs_root(tmp_path, capsys):
    """A mistyped --sysfs printed an empty machine (no NUMA node, no core) with exit 0."""
    from hps.cli import main
    assert main(["topology", "--sysfs", str(tmp_path / "sys")]) == 2
    assert capsys.readouterr().err.strip() == f"hps topology: --sysfs: {tmp_path / 'sys'}: no such directory"


@pytest.mark.parametrize("rows", ["0", "10", "-5"])
def test_cli_refuses_too_few_rows_to_route(capsys, rows):
    """--rows below one row a pair (figure1: 8 x 8) ended in ZeroDivisionError (no bytes
    through host memory), a negative one in OverflowError, both as tracebacks."""
    from hps.cli import main
    assert main(["topology", "--file", str(TOPOLOGIES / "figure1.toml"), "--rows", rows]) == 2
    assert capsys.readouterr().err.strip() == f"hps topology: --rows: must be at least 64 (one row a pair of 8 " \
                                               f"endpoints), got {int(rows):,}"
    assert main(["topology", "--file", str(TOPOLOGIES / "figure1.toml"), "--rows", "64"]) == 0
    assert "gpu0 -> gpu5: relay via" in capsys.readouterr().out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to two nodes needs two cores")
def test_pipeline_threads_run_on_their_stages_cores(tmp_path):
    import hps
    from hps.data import SyntheticCriteo
    from hps.pipeline import Pipeline
    a, b = sorted(os.sched_getaffinity(0))[:2]
    root = tmp_path / "sys"
    fake_sysfs(root, 2, cores_per_node=1, gpus_per_node=1, nvme_node=1, nic_node=0)
    for n, core in ((0, a), (1, b)):  # this machine's cores, one a node
        (root / "devices" / "system" / "node" / f"node{n}" / "cpulist").write_text(f"{core}\n")
    plan = T.discover(str(root), gpus=False).binding_plan()
    seen = {"reader": set(), "prefetcher": set()}

    def source():
        for batch in SyntheticCriteo(seed=0, batch_size=64, examples=64 * 3, vocab_sizes=[100] * 26):
            seen["reader"].add(tuple(sorted(os.sched_getaffinity(0))))
            yield batch

    def keys_of(data):
        seen["prefetcher"].add(tuple(sorted(os.sched_getaffinity(0))))
        return data.keys

    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), mem_budget="16MiB"))
    before = sorted(os.sched_getaffinity(0))
    stats = Pipeline(ps, lambda loaded: None, keys_of=keys_of, binding=plan).run(source())
    assert stats.batches == 3
    assert seen == {"reader": {(a,)}, "prefetcher": {(b,)}}  # the NIC's node, the drive's node
    got = stats.as_dict()["binding"]
    assert got["reader"] == {"cores": [a], "reason": "reader: eth0 is on NUMA node 0"}
    assert got["prefetcher"]["cores"] == [b] and got["writer"]["cores"] == [b]
    assert got["loader"]["cores"] == [a, b]
    assert sorted(os.sched_getaffinity(0)) == before  # the caller's thread, which trains, is left alone
    # without a plan nothing is bound or reported
    assert Pipeline(ps, lambda loaded: None, keys_of=keys_of).run(source()).binding == {}


def test_apply_binding_reports_noop_and_missing_cores(tmp_path):
    fake_sysfs(tmp_path, 1, cores_per_node=2, gpus_per_node=0, nvme_node=0, nic_node=0)
    noop = T.discover(str(tmp_path), gpus=False).binding_plan()
    assert T.apply_binding(noop, "reader") == {"cores": None, "reason": noop.reason}
    far = T.BindingPlan([T.StageBinding("reader", [4096], 1, "eth0 is on NUMA node 1")], False, "2 nodes")
    before = os.sched_getaffinity(0)
    got = T.apply_binding(far, "reader")
    assert got["cores"] is None and got["reason"].startswith("not applied: cores 4096:")
    assert os.sched_getaffinity(0) == before
    with pytest.raises(KeyError, match="no pipeline thread 'trainer'"):
        T.apply_binding(far, "trainer")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a narrower allowed set needs two cores")
def test_apply_binding_stays_within_the_cores_the_process_may_use():
    # sysfs lists a node's cores whatever taskset or a cpuset allows: a thread
    # confined to core a, planned onto a and b, must not be widened to b.
    a, b = sorted(os.sched_getaffinity(0))[:2]
    plan = T.BindingPlan([T.StageBinding("reader", [a, b], 0, "eth0 is on NUMA node 0")], False, "2 nodes")
    elsewhere = T.BindingPlan([T.StageBinding("reader", [b], 1, "eth0 is on NUMA node 1")], False, "2 nodes")
    got = {}

    def confined():  # a thread of its own: the test's thread keeps its cores
        os.sched_setaffinity(0, {a})
        got["narrowed"] = T.apply_binding(plan, "reader")
        got["after"] = sorted(os.sched_getaffinity(0))
        got["outside"] = T.apply_binding(elsewhere, "reader")
        got["still"] = sorted(os.sched_getaffinity(0))

    t = threading.Thread(target=confined)
    t.start()
    t.join()
    assert got["narrowed"]["cores"] == [a] and got["after"] == [a], got
    assert f"only {a} are among those this process may run on" in got["narrowed"]["reason"]
    assert got["outside"]["cores"] is None and got["still"] == [a], got
    assert got["outside"]["reason"].startswith(f"not applied: cores {b}: none is among the cores"), got


def test_cuda_executor_needs_a_gpu_a_endpoint():
    t, m, send, recv = zeroed_exchange()
    with pytest.raises(ValueError, match=r"gpus: one CUDA device a endpoint \(8\), got 2"):
        t.execute_on_cuda(m, "relay", send, recv, gpus=[0, 0])
    if hps.cuda_device_count() == 0:  # no GPU: the executor says why instead of copying
        with pytest.raises(RuntimeError, match="CUDA"):
            t.execute_on_cuda(m, "relay", send, recv, gpus=[0] * 8)


class _FakeNvml(types.ModuleType):
    """pynvml as a driver would answer it: `bridges` maps two GPUs' PCI bus ids to the
    NVLink bridges between them, `switch_links` a GPU's bus id to the NVSwitches' bus ids
    its NVLinks end at (one entry a link; None: NVML cannot name it); NVML names remote
    devices with an 8-digit domain. remote_type=False is a pynvml older than nvmlDeviceGetNvLinkRemoteDeviceType,
    "raises" a driver older than it; `unknown` the bus ids NVML has no GPU at (a GPU
    bound to another driver, or none at all). NVLink P2P status (nvmlDeviceGetP2PStatus)
    is OK between GPUs bridged to each other, on a common switch, or on switches joined
    by one of `trunks` (switch bus-id pairs, which no GPU's NVLinks show); p2p_status=False
    is a pynvml without the function, "raises" a driver without it."""

    class NVMLError(Exception):
        pass

    GPU, SWITCH = 0, 2  # nvml.h's NVML_NVLINK_DEVICE_TYPE_GPU, _SWITCH
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK, NVML_P2P_STATUS_NOT_SUPPORTED = 0, 5

    def __init__(self, bridges: dict, init_fails: bool = False, switch_links: dict | None = None,
                 remote_type: bool = True, unknown: set = frozenset(), trunks: set = frozenset(),
                 p2p_status: bool | str = True):
        super().__init__("pynvml")
        self.ends: dict[str, list[tuple[str, int]]] = {}
        for (a, b), n in bridges.items():
            self.ends.setdefault(a, []).extend([(b, self.GPU)] * n)
            self.ends.setdefault(b, []).extend([(a, self.GPU)] * n)
        for gpu, switches in (switch_links or {}).items():
            self.ends.setdefault(gpu, []).extend((s, self.SWITCH) for s in switches)
        self.init_fails, self.shut, self.unknown = init_fails, False, set(unknown)
        if remote_type == "raises":  # a driver older than the pynvml
            self.nvmlDeviceGetNvLinkRemoteDeviceType = self._no_function
        elif remote_type:
            self.nvmlDeviceGetNvLinkRemoteDeviceType = self._remote_type
        self.trunks = {frozenset(t) for t in trunks}
        if p2p_status == "raises":
            self.nvmlDeviceGetP2PStatus = self._no_function
        elif p2p_status:
            self.nvmlDeviceGetP2PStatus = self._p2p_status
        self.p2p_asked: set = set()

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        if bus_id in self.unknown:
            raise self.NVMLError("Not Found")
        return bus_id

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= max(12, len(self.ends.get(handle, []))):  # links past the GPU's: NVML raises
            raise self.NVMLError("Not Supported")
        return int(link < len(self.ends.get(handle, [])))

    def _remote_type(self, handle, link):
        return self.ends[handle][link][1]

    def _no_function(self, *args):
        raise self.NVMLError("Function Not Found")

    def _p2p_status(self, a, b, index):
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        self.p2p_asked.add(frozenset((a, b)))
        ends_a = {e for e, _ in self.ends.get(a, [])}
        switches_b = {e for e, kind in self.ends.get(b, []) if kind == self.SWITCH}
        switches_a = {e for e, kind in self.ends.get(a, []) if kind == self.SWITCH}
        joined = b in ends_a or switches_a & switches_b or any(
            frozenset((x, y)) in self.trunks for x in switches_a for y in switches_b)
        return self.NVML_P2P_STATUS_OK if joined else self.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        if self.ends[handle][link][0] is None:  # a far end NVML does not name
            raise self.NVMLError("Unknown Error")
        return types.SimpleNamespace(busId=("0000" + self.ends[handle][link][0]).upper().encode())


def test_nvlinks_come_from_nvml_counted_once_a_bridge(tmp_path, monkeypatch):
    fake_sysfs(tmp_path, 2, cores_per_node=2, gpus_per_node=2, nvme_node=0, nic_node=0)
    bus = [f"0000:{0x10 + k:02x}:00.0" for k in range(4)]  # gpu0..gpu3, as write_fake_sysfs names them
    nvml = _FakeNvml({(bus[0], bus[1]): 2, (bus[0], bus[2]): 1})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    names = {i: d.name for i, d in enumerate(t.devices)}
    nvlinks = sorted((names[l.a], names[l.b], l.gbps) for l in t.links if l.kind == "nvlink")
    assert nvlinks == [("gpu0", "gpu1", 50.0), ("gpu0", "gpu2", 25.0)]  # two bridges, one; gpu3 none
    assert nvml.shut
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml({(bus[0], bus[1]): 2}, init_fails=True))
    assert not [l for l in T.discover(str(tmp_path)).links if l.kind == "nvlink"]  # no driver: none
    assert not [l for l in T.discover(str(tmp_path), gpus=False).links if l.kind == "nvlink"]


def test_gpus_nvml_does_not_know_get_no_nvlinks(tmp_path, monkeypatch):
    # A GPU in sysfs that NVML has no handle for (bound to vfio-pci for a VM, or a
    # driver that sees no GPU at all) made NVML's NotFound escape discover(), and
    # `hps topology` with it.
    fake_sysfs(tmp_path, 2, cores_per_node=2, gpus_per_node=2, nvme_node=0, nic_node=0)
    bus = [f"0000:{0x10 + k:02x}:00.0" for k in range(4)]
    nvml = _FakeNvml({(bus[0], bus[1]): 2, (bus[2], bus[3]): 2}, unknown={bus[3]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    names = {i: d.name for i, d in enumerate(t.devices)}
    # gpu2's bridges to gpu3 are seen from gpu2's end only, and still count whole
    assert sorted((names[l.a], names[l.b], l.bridges) for l in t.links if l.kind == "nvlink") == \
        [("gpu0", "gpu1", 2), ("gpu2", "gpu3", 2)]
    assert [t.devices[i].name for i in t.endpoints] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert nvml.shut
    nvml = _FakeNvml({(bus[0], bus[1]): 2}, unknown=set(bus))  # NVML answers, with no GPU
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert not [l for l in t.links if l.kind == "nvlink"] and len(t.endpoints) == 4 and nvml.shut


NVSWITCHES = [f"0000:{0xc0 + s:02x}:00.0" for s in range(6)]


def dgx_a100_nvml(tmp_path, **fake):
    """A DGX A100-like node: 8 GPUs on 2 NUMA nodes, each with 12 NVLinks, two to each
    of 6 NVSwitches, no NVLink between GPUs (examples/topologies/nvswitch.toml by hand).
    The switches are PCI bridges in sysfs (vendor 0x10de, class 0x068000)."""
    fake_sysfs(tmp_path, 2, cores_per_node=4, gpus_per_node=4, nvme_node=0, nic_node=1)
    for bus in NVSWITCHES:
        for name, value in (("vendor", "0x10de"), ("class", "0x068000"), ("numa_node", "-1")):
            (tmp_path / "bus" / "pci" / "devices" / bus).mkdir(parents=True, exist_ok=True)
            (tmp_path / "bus" / "pci" / "devices" / bus / name).write_text(value + "\n")
    gpus = [f"0000:{0x10 + k:02x}:00.0" for k in range(8)]
    return gpus, _FakeNvml({}, switch_links={g: [s for s in NVSWITCHES for _ in range(2)] for g in gpus}, **fake)


@pytest.mark.parametrize("remote_type", [True, False, "raises"], ids=["remote-type", "sysfs-class", "old-driver"])
def test_nvlinks_to_nvswitches_make_the_switch_fabric(tmp_path, monkeypatch, remote_type):
    # Before, only NVLinks ending at a GPU counted: on an NVSwitch node none did, so the
    # 8 GPUs had no NVLink at all and every pair went through host memory (or a
    # 12 GB/s PCIe peer link) instead of the 300 GB/s fabric.
    gpus, nvml = dgx_a100_nvml(tmp_path, remote_type=remote_type)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    runtime = _FakeCudart(gpus, {(a, b) for a in gpus for b in gpus if a < b})  # peer access everywhere
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    for name, module in (("cuda", types.ModuleType("cuda")), ("cuda.bindings", bindings),
                         ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    t = T.discover(str(tmp_path))
    switches = [d for d in t.devices if d.kind == "switch"]
    assert [(d.name, d.numa) for d in switches] == [("nvswitch", -1)]  # one fabric, as nvswitch.toml has it
    for k in range(8):
        link = link_between(t, f"gpu{k}", "nvswitch")
        assert (link.kind, link.bridges, link.gbps) == ("nvlink", 12, 300.0), link
    # the fabric carries the peer traffic: no GPU pair gets a PCIe peer link besides
    assert not [l for l in t.links if l.kind == "pcie-p2p" or (l.kind == "nvlink" and "nvswitch" not in
                                                                  (t.devices[l.a].name, t.devices[l.b].name))]
    m = T.even_all_to_all(8, 1_000_000, 256)
    plan = t.plan(m, "relay")
    assert plan["route_count"]["direct"] == 56 and plan["route_count"]["relay"] == 0
    assert all(r["path"][1] == t.index("nvswitch") for r in plan["routes"] if r["kind"] == "direct")
    by_hand = T.load(TOPOLOGIES / "nvswitch.toml")
    assert plan["seconds"] == pytest.approx(by_hand.plan(m, "relay")["seconds"])
    assert nvml.shut


def test_nvlinks_to_other_bridges_are_not_a_switch(tmp_path, monkeypatch):
    # Without NVML's remote device type, only NVIDIA's NVSwitch class (0x068000) is a
    # switch: a POWER9 NPU bridge (0x068001) or a bus id sysfs lacks is not.
    gpus, nvml = dgx_a100_nvml(tmp_path, remote_type=False)
    (tmp_path / "bus" / "pci" / "devices" / NVSWITCHES[0] / "class").write_text("0x068001\n")
    os.remove(tmp_path / "bus" / "pci" / "devices" / NVSWITCHES[1] / "class")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    for k in range(8):
        assert link_between(t, f"gpu{k}", "nvswitch").bridges == 8  # 12 less the 2 + 2 to those


def use_fake_cudart(monkeypatch, runtime):
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    for name, module in (("cuda", types.ModuleType("cuda")), ("cuda.bindings", bindings),
                         ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)


def test_separate_nvswitch_fabrics_stay_apart(tmp_path, monkeypatch):
    # Every GPU with an NVLink to any NVSwitch went onto one "nvswitch" device, so two
    # NVLink domains in one node were modelled as one: GPUs of different domains, which
    # no NVLink joins, got direct 300 GB/s routes (and no PCIe peer link).
    gpus, _ = dgx_a100_nvml(tmp_path)
    domain = {g: (0 if k in (0, 1, 4, 5) else 1) for k, g in enumerate(gpus)}  # each domain on both sockets
    switches = [NVSWITCHES[:3], NVSWITCHES[3:]]
    nvml = _FakeNvml({}, switch_links={g: [s for s in switches[domain[g]] for _ in range(4)] for g in gpus})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    use_fake_cudart(monkeypatch, _FakeCudart(gpus, {(a, b) for a in gpus for b in gpus if a < b}))
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch0", "nvswitch1"]
    for k, g in enumerate(gpus):
        assert link_between(t, f"gpu{k}", f"nvswitch{domain[g]}").bridges == 12
        assert link_between(t, f"gpu{k}", f"nvswitch{1 - domain[g]}") is None
    kinds = {(a, b): link_between(t, a, b) and link_between(t, a, b).kind for a in ("gpu0", "gpu1") for b in
             ("gpu1", "gpu2", "gpu4", "gpu6")}
    # the fabric carries its own domain's peer traffic; the other domain's is PCIe
    assert (kinds[("gpu0", "gpu1")], kinds[("gpu0", "gpu4")]) == (None, None)
    assert (kinds[("gpu0", "gpu2")], kinds[("gpu1", "gpu6")]) == ("pcie-p2p", "pcie-p2p")
    plan = t.plan(T.even_all_to_all(8, 1_000_000, 256), "direct")
    by = {(r["src"], r["dst"]): r for r in plan["routes"]}
    assert by[(0, 4)]["path"] == [t.index("gpu0"), t.index("nvswitch0"), t.index("gpu4")]
    assert t.index("nvswitch0") not in by[(0, 2)]["path"] and t.index("nvswitch1") not in by[(0, 2)]["path"]
    grid = endpoint_grid(T.format_text(t))
    assert (grid[("gpu0", "gpu4")], grid[("gpu2", "gpu7")], grid[("gpu0", "gpu2")]) == ("SW12", "SW12", "PC1")
    # NVML was asked whether the domains are joined, said no, and nothing is left unsaid
    assert nvml.p2p_asked and t.warnings == [] and not [l for l in t.links if l.kind == "nvlink-assumed"]
    assert nvml.shut


def test_gpus_off_the_switches_are_off_the_fabric(tmp_path, monkeypatch):
    # Half the GPUs on NVSwitches, half on none; then switch links whose far end NVML
    # cannot name, which count as ending at one switch (the fabric's members cannot be
    # told apart otherwise).
    gpus, _ = dgx_a100_nvml(tmp_path)
    nvml = _FakeNvml({}, switch_links={g: [s for s in NVSWITCHES for _ in range(2)] for g in gpus[:4]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch"]
    assert [k for k in range(8) if link_between(t, f"gpu{k}", "nvswitch")] == [0, 1, 2, 3]
    nvml = _FakeNvml({}, switch_links={g: [None] * 12 for g in gpus[:2]} | {g: [None] * 6 for g in gpus[4:6]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch"]
    assert [link_between(t, f"gpu{k}", "nvswitch") and link_between(t, f"gpu{k}", "nvswitch").bridges
            for k in range(8)] == [12, 12, None, None, 6, 6, None, None]


def test_hgx_h100_is_one_fabric(tmp_path, monkeypatch):
    # HGX H100: 8 GPUs, each with 18 NVLinks spread over the board's 4 NVSwitches
    # (every GPU on every switch): one fabric of 450 GB/s a GPU each way.
    fake_sysfs(tmp_path, 2, cores_per_node=4, gpus_per_node=4, nvme_node=0, nic_node=1)
    gpus = [f"0000:{0x10 + k:02x}:00.0" for k in range(8)]
    spread = [NVSWITCHES[0]] * 5 + [NVSWITCHES[1]] * 4 + [NVSWITCHES[2]] * 4 + [NVSWITCHES[3]] * 5
    nvml = _FakeNvml({}, switch_links={g: spread for g in gpus})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch"]
    for k in range(8):
        link = link_between(t, f"gpu{k}", "nvswitch")
        assert (link.kind, link.bridges, link.gbps) == ("nvlink", 18, 450.0), link
    plan = t.plan(T.even_all_to_all(8, 1_000_000, 256), "relay")
    assert plan["route_count"]["direct"] == 56 and t.warnings == [] and not nvml.p2p_asked  # one fabric: nothing to ask
    assert nvml.shut


DGX2_SWITCHES = [f"0000:{0xc0 + s:02x}:00.0" for s in range(12)]


def dgx2_nvml(tmp_path, **fake):
    """A DGX-2-like node: 16 V100s, 8 on each of 2 NUMA nodes and 2 baseboards; each GPU
    has 6 NVLinks, one to each of its board's 6 NVSwitches, and switch s of board 0 is
    trunked to switch s of board 1 (which no GPU's NVLinks show)."""
    fake_sysfs(tmp_path, 2, cores_per_node=4, gpus_per_node=8, nvme_node=0, nic_node=1)
    gpus = [f"0000:{0x10 + k:02x}:00.0" for k in range(16)]
    boards = [DGX2_SWITCHES[:6], DGX2_SWITCHES[6:]]
    return gpus, _FakeNvml({}, switch_links={g: boards[k // 8] for k, g in enumerate(gpus)},
                           trunks={(boards[0][s], boards[1][s]) for s in range(6)}, **fake)


def one_fabric_by_hand(gpus: int, bridges: int) -> T.Topology:
    devices = [T.Device(f"gpu{k}", "gpu") for k in range(gpus)] + [T.Device("nvswitch", "switch")]
    links = [T.Link(k, gpus, T.NVLINK_GBPS * bridges, 1.0, "nvlink", bridges) for k in range(gpus)]
    return T.Topology("by hand", devices, links)


def test_dgx2_baseboards_joined_through_their_trunk(tmp_path, monkeypatch):
    # The two baseboards' switches share no GPU, so they were two fabrics and the 64
    # pairs across the boards had no NVLink route: PCIe peer links or host memory
    # instead of the trunk. NVML's NVLink P2P status says they are joined.
    gpus, nvml = dgx2_nvml(tmp_path)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    use_fake_cudart(monkeypatch, _FakeCudart(gpus, {(a, b) for a in gpus for b in gpus if a < b}))
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch0", "nvswitch1"]
    for k in range(16):
        link = link_between(t, f"gpu{k}", f"nvswitch{k // 8}")
        assert (link.kind, link.bridges, link.gbps) == ("nvlink", 6, 150.0), link
    trunk = link_between(t, "nvswitch0", "nvswitch1")
    assert trunk is not None, "the baseboards are not joined"
    assert (trunk.kind, trunk.bridges, trunk.gbps) == ("nvlink-assumed", 48, 1200.0)  # as wide as a board's GPUs
    assert not [l for l in t.links if l.kind == "pcie-p2p"] and t.warnings == []
    m = T.even_all_to_all(16, 1_000_000, 256)
    plan = t.plan(m, "direct")
    assert plan["route_count"]["direct"] == 240
    by = {(r["src"], r["dst"]): r for r in plan["routes"]}
    assert by[(0, 8)]["path"] == [t.index(n) for n in ("gpu0", "nvswitch0", "nvswitch1", "gpu8")]
    assert by[(0, 7)]["path"] == [t.index(n) for n in ("gpu0", "nvswitch0", "gpu7")]
    # a trunk that does not block: every pair over NVLink takes what it would on one
    # 16-GPU fabric, plus the trunk's hop latency
    alone = one_fabric_by_hand(16, 6).plan(m, "direct")["seconds"]
    assert alone < plan["seconds"] <= alone + 2e-6
    relay = t.plan(m, "relay")
    assert relay["seconds"] <= plan["seconds"]
    grid = endpoint_grid(T.format_text(t))
    assert (grid[("gpu0", "gpu8")], grid[("gpu15", "gpu3")], grid[("gpu0", "gpu7")]) == ("SW6", "SW6", "SW6")
    assert nvml.shut


@pytest.mark.parametrize("joined", ["all pairs", "chain"])
def test_a_fabric_shares_its_switch_ports_among_its_trunks(tmp_path, monkeypatch, joined):
    # Three boards of 4 GPUs, each GPU with 6 NVLinks, one to each of its board's 6
    # switches. Each trunk was assumed as wide as a board's 24 GPU links, so a board
    # joined to two others had 48 NVLinks of trunk from switches whose ports are 24
    # (a DGX-2 switch: 8 to GPUs, 8 to the other board). Each fabric's share is its
    # links over the trunks it has.
    fake_sysfs(tmp_path, 2, cores_per_node=4, gpus_per_node=6, nvme_node=0, nic_node=1)
    gpus = [f"0000:{0x10 + k:02x}:00.0" for k in range(12)]
    boards = [[f"0000:{0xc0 + 6 * b + s:02x}:00.0" for s in range(6)] for b in range(3)]
    pairs = [(0, 1), (0, 2), (1, 2)] if joined == "all pairs" else [(0, 1), (1, 2)]
    nvml = _FakeNvml({}, switch_links={g: boards[k // 4] for k, g in enumerate(gpus)},
                     trunks={(boards[a][s], boards[b][s]) for a, b in pairs for s in range(6)})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch0", "nvswitch1", "nvswitch2"]
    widths = {(a, b): getattr(link_between(t, f"nvswitch{a}", f"nvswitch{b}"), "bridges", None)
              for a, b in [(0, 1), (0, 2), (1, 2)]}
    if joined == "all pairs":  # every board joined to two: 24 / 2 a trunk
        assert widths == {(0, 1): 12, (0, 2): 12, (1, 2): 12}
    else:  # the middle board's 24 shared by its two trunks; nothing joins the ends directly
        assert widths == {(0, 1): 12, (0, 2): None, (1, 2): 12}
    for a, b in pairs:
        assert link_between(t, f"nvswitch{a}", f"nvswitch{b}").gbps == 12 * T.NVLINK_GBPS
    assert nvml.shut


@pytest.mark.parametrize("p2p_status", [False, "raises"], ids=["old-pynvml", "old-driver"])
def test_fabrics_stay_apart_with_a_warning_where_nvml_cannot_say(tmp_path, monkeypatch, p2p_status):
    gpus, nvml = dgx2_nvml(tmp_path, p2p_status=p2p_status)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert [d.name for d in t.devices if d.kind == "switch"] == ["nvswitch0", "nvswitch1"]
    assert link_between(t, "nvswitch0", "nvswitch1") is None
    why = "no nvmlDeviceGetP2PStatus" if p2p_status is False else "nvmlDeviceGetP2PStatus: Function Not Found"
    assert len(t.warnings) == 1 and "2 NVSwitch fabrics" in t.warnings[0] and why in t.warnings[0], t.warnings
    text = T.format_text(t)
    assert f"warning: {t.warnings[0]}" in text
    grid = endpoint_grid(text)
    assert (grid[("gpu0", "gpu8")], grid[("gpu0", "gpu7")]) == ("SYS", "SW6")  # across the sockets' PCIe
    assert nvml.shut


def test_fabrics_bridged_by_one_pair_stay_apart(tmp_path, monkeypatch):
    # Two switch domains whose only NVLink across is a bridge between gpu0 and gpu2:
    # that pair's NVLink path is the bridge, not a trunk, and no other pair has one, so
    # the domains stay apart (an all-pairs path across would have joined them).
    gpus, _ = dgx_a100_nvml(tmp_path)
    domain = {g: (0 if k in (0, 1, 4, 5) else 1) for k, g in enumerate(gpus)}
    switches = [NVSWITCHES[:3], NVSWITCHES[3:]]
    nvml = _FakeNvml({(gpus[0], gpus[2]): 2},
                     switch_links={g: [s for s in switches[domain[g]] for _ in range(4)] for g in gpus})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert link_between(t, "nvswitch0", "nvswitch1") is None and t.warnings == []
    assert (link_between(t, "gpu0", "gpu2").kind, link_between(t, "gpu0", "gpu2").bridges) == ("nvlink", 2)
    assert frozenset((gpus[0], gpus[2])) not in nvml.p2p_asked  # the bridge's own pair says nothing of switches
    # the same with every pair across also trunked: joined
    nvml = _FakeNvml({(gpus[0], gpus[2]): 2},
                     switch_links={g: [s for s in switches[domain[g]] for _ in range(4)] for g in gpus},
                     trunks={(switches[0][0], switches[1][0])})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = T.discover(str(tmp_path))
    assert link_between(t, "nvswitch0", "nvswitch1").bridges == 48  # 4 GPUs of 12 NVLinks a side


class _FakeCudart(types.ModuleType):
    """cuda-python's runtime as a driver would answer it: CUDA device d is the GPU on
    bus `order[d]` (CUDA's order need not be the bus order), and `peers` the bus-id pairs
    with peer access."""

    class cudaError_t:  # noqa: N801 - cuda-python's names
        cudaSuccess = 0
        cudaErrorNoDevice = 100

    class cudaDeviceP2PAttr:  # noqa: N801
        cudaDevP2PAttrAccessSupported = 2

    def __init__(self, order: list, peers: set):
        super().__init__("cuda.bindings.runtime")
        self.order, self.peers = order, {frozenset(p) for p in peers}

    def cudaGetDeviceCount(self):
        return 0, len(self.order)

    def cudaDeviceGetPCIBusId(self, length, device):
        return 0, ("0000" + self.order[device]).upper().encode() + b"\x00"

    def cudaDeviceGetP2PAttribute(self, attr, a, b):
        assert attr == self.cudaDeviceP2PAttr.cudaDevP2PAttrAccessSupported
        return 0, int(frozenset((self.order[a], self.order[b])) in self.peers)


def test_pcie_peer_links_come_from_the_cuda_runtime(tmp_path, monkeypatch):
    fake_sysfs(tmp_path, 2, cores_per_node=2, gpus_per_node=2, nvme_node=0, nic_node=0)
    bus = [f"0000:{0x10 + k:02x}:00.0" for k in range(4)]
    runtime = _FakeCudart([bus[2], bus[0], bus[3], bus[1]], {(bus[0], bus[1]), (bus[2], bus[3]), (bus[0], bus[3])})
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml({(bus[0], bus[1]): 1}))  # gpu0-gpu1 by NVLink
    t = T.discover(str(tmp_path))
    names = {i: d.name for i, d in enumerate(t.devices)}
    gpu_links = sorted((names[l.a], names[l.b], l.kind) for l in t.links if l.kind in ("nvlink", "pcie-p2p"))
    # by bus id, not CUDA's order; the NVLinked pair is not linked twice
    assert gpu_links == [("gpu0", "gpu1", "nvlink"), ("gpu0", "gpu3", "pcie-p2p"), ("gpu2", "gpu3", "pcie-p2p")]
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)  # no cuda-python: no peer links
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    assert not [l for l in T.discover(str(tmp_path)).links if l.kind == "pcie-p2p"]
