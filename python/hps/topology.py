"""A node's topology: devices, links, NUMA placement; the routes transfers take; core binding.

Three ways to get a :class:`Topology`:

    topo = hps.topology.load("examples/topologies/figure1.toml")   # a machine we simulate
    topo = hps.topology.discover()                                  # this machine (sysfs, NVML)
    topo = hps.topology.host_partitions(8)                          # 8 host partitions, flat

and what to do with it:

    bytes = hps.topology.even_all_to_all(8, rows=1_000_000, row_bytes=256)   # (8, 8) uint64
    plan = topo.plan(bytes, "relay")      # {"routes": [...], "seconds": ..., ...}
    topo.plan(bytes, "host")["seconds"]   # every pair through the CPUs' memory
    topo.binding_plan()                   # which cores each stage thread should get

The router and the cost model are native (include/hps/topology.h says what the model
counts and what it leaves out); this module reads files and sysfs and hands plain lists
over.

Topology files (TOML; examples/topologies/ holds four):

    name = "figure1"                # shown by `hps topology`
    [[numa]]                        # one per NUMA node
    node = 0
    cpus = "0-23,48-71"             # the kernel's cpulist format
    [[device]]                      # one per device, in order; GPUs and host partitions
    name = "gpu0"                   #   are the endpoints a transfer matrix indexes
    kind = "gpu"                    # gpu | host | cpu (a socket and its memory) | switch (PCIe, NVSwitch)
    numa = 0                        # optional, default -1 (unknown)
    [[link]]                        # full duplex; one per device pair
    between = ["gpu0", "gpu1"]
    kind = "nvlink"                 # free text: nvlink, pcie, upi, memcpy ...
    gbps = 25.0                     # GB/s (1e9 B) per direction per bridge
    bridges = 2                     # optional, default 1: the link carries bridges * gbps
    latency_us = 1.5                # per hop
    [[nvme]]                        # optional: drives and NICs, for core binding
    name = "nvme0"
    numa = 0
    [[nic]]
    name = "eth0"
    numa = 1

Errors in a file raise :class:`TopologyError` (a ValueError) naming the file, the line
and the field.
"""
from __future__ import annotations

import glob
import math
import os
import re
import tomllib
from dataclasses import dataclass, field

import numpy as np

from hps import _core

KINDS = {"gpu": 0, "host": 1, "cpu": 2, "switch": 3}
# The router takes a device's NUMA node as an int32 (include/hps/topology.h).
_INT32_MAX = 2**31 - 1
SCHEDULES = ("host", "direct", "relay")

# Assumed when sysfs does not say (documented in `hps topology`'s output through the
# links' kind "assumed-..."): PCIe 3.0 x16 achievable, a host partition's memcpy, and a
# NUMA interconnect hop.
PCIE_GBPS = 12.0
MEMCPY_GBPS = 10.0
NUMA_GBPS = 20.0
# One NVLink's GB/s per direction: 25 for NVLink 2, 3 and 4 alike (V100 6 links, A100
# 12, H100 18; the datasheets' totals count both directions).
NVLINK_GBPS = 25.0
NVML_NVLINK_MAX_LINKS = 18                 # nvml.h; H100 has all 18
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2         # nvml.h's nvmlIntNvLinkDeviceType_t
NVML_P2P_CAPS_INDEX_NVLINK = 2             # nvml.h's nvmlGpuP2PCapsIndex_t
NVML_P2P_STATUS_OK = 0                     # nvml.h's nvmlGpuP2PStatus_t


class TopologyError(ValueError):
    """A topology file or sysfs tree cannot be read as one; the message names the file,
    the line and the field."""


@dataclass
class Device:
    name: str
    kind: str          # gpu | host | cpu | switch
    numa: int = -1


@dataclass
class Link:
    a: int             # device indices
    b: int
    gbps: float        # per direction, every bridge together
    latency_us: float
    kind: str
    bridges: int = 1


@dataclass
class StageBinding:
    stage: str         # "ssd_io", "reader", "load:gpu0" ...
    cores: list[int]
    numa: int
    reason: str


@dataclass
class BindingPlan:
    stages: list[StageBinding]
    noop: bool         # one NUMA node: binding changes nothing
    reason: str

    def cores_of(self, stage: str) -> list[int]:
        for s in self.stages:
            if s.stage == stage:
                return s.cores
        raise KeyError(f"no stage {stage!r} in the binding plan (stages: {', '.join(s.stage for s in self.stages)})")


@dataclass
class Topology:
    name: str
    devices: list[Device]
    links: list[Link]
    numa_cores: dict[int, list[int]] = field(default_factory=dict)
    nvme: list[tuple[str, int]] = field(default_factory=list)   # (name, numa node)
    nics: list[tuple[str, int]] = field(default_factory=list)
    source: str = ""
    # what discovery could not tell and modelled one way anyway; `hps topology` prints them
    warnings: list[str] = field(default_factory=list)

    # ---- structure
    @property
    def endpoints(self) -> list[int]:
        """Device indices of the GPUs and host partitions, the rows of a transfer matrix."""
        return [i for i, d in enumerate(self.devices) if d.kind in ("gpu", "host")]

    def index(self, name: str) -> int:
        for i, d in enumerate(self.devices):
            if d.name == name:
                return i
        raise KeyError(f"no device {name!r} in topology {self.name!r}")

    def _native(self):
        devices = [(d.name, KINDS[d.kind], d.numa) for d in self.devices]
        links = [(l.a, l.b, float(l.gbps), float(l.latency_us), l.kind) for l in self.links]
        return devices, links

    # ---- routes and cost
    def plan(self, bytes_matrix, schedule: str = "relay") -> dict:
        """Routes of every endpoint pair with bytes and the modelled time of the schedule.

        bytes_matrix: (E, E) bytes from endpoint s (row) to d (column), E = len(endpoints).
        schedule: "host" (every pair through the CPUs' memory), "direct" (the pair's own
        link where there is one, else the host path) or "relay" (the router's choice,
        two-phase through a middleman where that is cheaper). Returns a dict: routes (src,
        dst, kind, via, path, reason; src/dst/via are endpoint numbers, path device
        indices), seconds, phase_seconds, link_bytes (per link, a->b then b->a),
        route_count, relayed_bytes, hops.
        """
        m = self._matrix(bytes_matrix)
        devices, links = self._native()
        return _core.plan_routes(devices, links, m, schedule)

    def plan_fixed(self, bytes_matrix, via) -> dict:
        """A fixed rule's routes and modelled time, in plan()'s form: pair (s, d) relays
        via endpoint via[s][d], or, where that is -1, goes direct if it can and through
        host memory otherwise. For comparing hard-coded rules with the router's."""
        m = self._matrix(bytes_matrix)
        v = np.asarray(via, dtype=np.int64)
        if v.shape != m.shape:
            raise ValueError(f"via must be {m.shape} like the transfer matrix, got {v.shape}")
        devices, links = self._native()
        return _core.fixed_routes(devices, links, m, [int(x) for x in v.ravel()])

    def execute_on_host(self, bytes_matrix, schedule: str, send: list, recv: list) -> dict:
        """Runs the schedule with memcpy: send[s] holds s's segments for every d in
        order, recv[d] gets every s's segment in order (uint8 arrays). Relays stage on
        the middleman's buffer between two phases. Returns seconds, phase_seconds,
        bytes_copied, staged_bytes."""
        m = self._matrix(bytes_matrix)
        devices, links = self._native()
        return _core.execute_routes(devices, links, m, schedule, list(send), list(recv))

    def execute_on_cuda(self, bytes_matrix, schedule: str, send: list, recv: list, gpus: list) -> dict:
        """The same schedule with the CUDA executor (cudaMemcpyPeerAsync, relays staged
        on the middleman's GPU): the host buffers are copied to endpoint e's GPU
        ``gpus[e]`` and back around it, and the stats are the exchange's. ``gpus``
        may repeat a GPU, so that one GPU stands for a node in tests."""
        if len(gpus) != len(self.endpoints):
            raise ValueError(f"gpus: one CUDA device a endpoint ({len(self.endpoints)}), got {len(gpus)}")
        m = self._matrix(bytes_matrix)
        devices, links = self._native()
        return _core.execute_routes(devices, links, m, schedule, list(send), list(recv), [int(g) for g in gpus])

    def _matrix(self, bytes_matrix) -> np.ndarray:
        m = np.ascontiguousarray(bytes_matrix, dtype=np.uint64)
        e = len(self.endpoints)
        if m.shape != (e, e):
            raise ValueError(f"topology {self.name!r} has {e} endpoints: the transfer matrix must be ({e}, {e}), "
                             f"got {m.shape}")
        return m

    # ---- core binding
    @property
    def cpu_nodes(self) -> dict[int, list[int]]:
        """The NUMA nodes with cores, and their cores: numa_cores without the
        memory-only nodes (a CXL memory expander, GH200's GPU memory), which no thread
        can run on."""
        return {n: cs for n, cs in self.numa_cores.items() if cs}

    def binding_plan(self, nvme: str | None = None, nic: str | None = None) -> BindingPlan:
        """Which cores each stage thread gets: the SSD I/O threads the NVMe drive's node,
        the reader the NIC's node, each endpoint's load thread its own node. nvme / nic
        pick a drive or NIC by name (default: the first listed). With one NUMA node with
        cores (or none known) every stage gets every core and the plan says it is a
        no-op. A device on a memory-only node gets every core."""
        cpu_nodes = self.cpu_nodes
        all_cores = sorted(c for cs in cpu_nodes.values() for c in cs)
        nodes = sorted(cpu_nodes)
        memory_only = sorted(set(self.numa_cores) - set(cpu_nodes))
        also = (f", and memory-only node{'s' if len(memory_only) > 1 else ''} {_cpulist(memory_only)}"
                if memory_only else "")
        if len(nodes) <= 1:
            why = (f"one NUMA node ({len(all_cores)} cores{also}): every core is as near to every device, "
                   "binding is a no-op" if nodes else f"no NUMA node with cores known{also}: binding is a no-op")
            stages = [StageBinding(s, all_cores, nodes[0] if nodes else -1, why)
                      for s in ["ssd_io", "reader"] + [f"load:{self.devices[i].name}" for i in self.endpoints]]
            return BindingPlan(stages, True, why)

        def near(node: int, what: str) -> tuple[list[int], int, str]:
            if node in cpu_nodes:
                return cpu_nodes[node], node, f"{what} is on NUMA node {node}"
            if node in self.numa_cores:
                return all_cores, -1, f"{what} is on NUMA node {node}, which has no cores (memory only): every core"
            return all_cores, -1, f"{what}'s NUMA node is unknown: every core"

        def pick(items: list[tuple[str, int]], name: str | None, kind: str) -> tuple[str, int] | None:
            if name is None:
                return items[0] if items else None
            for it in items:
                if it[0] == name:
                    return it
            raise KeyError(f"no {kind} {name!r} in topology {self.name!r} "
                           f"(known: {', '.join(i[0] for i in items) or 'none'})")

        stages = []
        for stage, items, name, kind in (("ssd_io", self.nvme, nvme, "NVMe drive"), ("reader", self.nics, nic, "NIC")):
            it = pick(items, name, kind)
            if it is None:
                stages.append(StageBinding(stage, all_cores, -1, f"no {kind} known: every core"))
            else:
                cores, node, why = near(it[1], it[0])
                stages.append(StageBinding(stage, cores, node, why))
        for i in self.endpoints:
            d = self.devices[i]
            cores, node, why = near(d.numa, d.name)
            stages.append(StageBinding(f"load:{d.name}", cores, node, why))
        return BindingPlan(stages, False, f"{len(nodes)} NUMA nodes{also}: each stage on the node of what it feeds from")


# ------------------------------------------------------------------ helpers
def parse_cpulist(text: str) -> list[int]:
    """The kernel's cpulist ("0-3,8,10-11") as a sorted list; ValueError on a bad one."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi) if hi else int(lo)
        if b < a:
            raise ValueError(f"bad cpu range {part!r}")
        out.extend(range(a, b + 1))
    return sorted(set(out))


def even_all_to_all(endpoints: int, rows: int, row_bytes: int) -> np.ndarray:
    """(E, E) bytes of an all-to-all that moves `rows` rows spread evenly over the E x E
    pairs, the diagonal included (a device's own rows stay put: its entry is zeroed)."""
    per_pair = rows // (endpoints * endpoints)
    m = np.full((endpoints, endpoints), per_pair * row_bytes, dtype=np.uint64)
    np.fill_diagonal(m, 0)
    return m


def host_partitions(n: int, gbps: float = MEMCPY_GBPS, latency_us: float = 0.5, numa_cores=None) -> Topology:
    """n host partitions over one memory: a flat topology (every pair the same route).
    Partition i is on the i-th NUMA node with cores of numa_cores (round the nodes again
    past the last; node 0 if none has cores): a memory-only node has no core to run its
    load thread. Default numa_cores: node 0 with the cores this process may use."""
    if n < 1:
        raise ValueError(f"host_partitions: n must be >= 1, got {n}")
    cores = numa_cores if numa_cores is not None else {0: sorted(os.sched_getaffinity(0))}
    sockets = sorted(node for node, cs in cores.items() if cs) or [0]
    devices = [Device(f"host{i}", "host", sockets[i % len(sockets)]) for i in range(n)] + \
        [Device("memory", "cpu", sockets[0])]
    links = [Link(i, n, gbps, latency_us, "memcpy") for i in range(n)]
    return Topology(f"{n} host partitions", devices, links, dict(cores), source="host partitions")


# ------------------------------------------------------------------ TOML
def _finite(*factors) -> bool:
    """Whether the product of a file's numbers is a finite float (TOML has inf, and
    integers past a float's range)."""
    try:
        return math.isfinite(math.prod(float(x) for x in factors))
    except OverflowError:
        return False


def _locate(text: str, table: str, index: int, key: str | None) -> int:
    """The 1-based line of `key` in the index-th [[table]] of a TOML text (its header's
    line if the key is absent, 1 if the table is)."""
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\[\s*" + re.escape(table) + r"\s*\]\]")
    any_header = re.compile(r"^\s*\[")
    seen = -1
    for no, line in enumerate(lines, 1):
        if header.match(line):
            seen += 1
            if seen == index:
                if key is None:
                    return no
                for no2 in range(no, len(lines)):
                    l2 = lines[no2]
                    if any_header.match(l2):
                        break
                    if re.match(r"^\s*" + re.escape(key) + r"\s*=", l2):
                        return no2 + 1
                return no
    if key is not None and table == "":
        for no, line in enumerate(lines, 1):
            if re.match(r"^\s*" + re.escape(key) + r"\s*=", line):
                return no
    return 1


def load(path: str) -> Topology:
    """Reads a topology file (the format is in this module's docstring)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TopologyError(f"{path}: cannot read the topology file: {e.strerror}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{path}: not TOML: {e}") from None

    def fail(table: str, i: int, key: str | None, msg: str):
        line = _locate(text, table, i, key)
        where = f"{table}[{i}]" + (f".{key}" if key else "")
        raise TopologyError(f"{path}:{line}: {where}: {msg}")

    known_top = {"name", "description", "numa", "device", "link", "nvme", "nic"}
    for k in doc:
        if k not in known_top:
            raise TopologyError(f"{path}:{_locate(text, k, 0, None) if isinstance(doc[k], list) else _locate(text, '', 0, k)}: "
                                f"unknown field {k!r} (known: {', '.join(sorted(known_top))})")

    def table_list(name: str) -> list[dict]:
        v = doc.get(name, [])
        if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
            raise TopologyError(f"{path}:{_locate(text, '', 0, name)}: {name}: write it as [[{name}]] tables")
        return v

    def get(table: str, i: int, t: dict, key: str, types, required=True, default=None):
        if key not in t:
            if required:
                fail(table, i, None, f"missing field {key!r}")
            return default
        v = t[key]
        if isinstance(v, bool) or not isinstance(v, types):
            fail(table, i, key, f"expected {'a number' if types == (int, float) else types.__name__}, got {v!r}")
        return v

    def check_keys(table: str, i: int, t: dict, allowed: set[str]):
        for k in t:
            if k not in allowed:
                fail(table, i, k, f"unknown field (known: {', '.join(sorted(allowed))})")

    numa_cores: dict[int, list[int]] = {}
    for i, t in enumerate(table_list("numa")):
        check_keys("numa", i, t, {"node", "cpus"})
        node = get("numa", i, t, "node", int)
        cpus = get("numa", i, t, "cpus", str)
        if not 0 <= node <= _INT32_MAX:
            fail("numa", i, "node", f"must be a node number in [0, {_INT32_MAX}], got {node}")
        if node in numa_cores:
            fail("numa", i, "node", f"node {node} is listed twice")
        try:
            numa_cores[node] = parse_cpulist(cpus)
        except ValueError as e:
            fail("numa", i, "cpus", f"not a cpulist like \"0-3,8\": {e}")

    devices: list[Device] = []
    names: dict[str, int] = {}
    for i, t in enumerate(table_list("device")):
        check_keys("device", i, t, {"name", "kind", "numa"})
        name = get("device", i, t, "name", str)
        kind = get("device", i, t, "kind", str)
        numa = get("device", i, t, "numa", int, required=False, default=-1)
        if not name:
            fail("device", i, "name", "empty name")
        if name in names:
            fail("device", i, "name", f"{name!r} is already device {names[name]}")
        if kind not in KINDS:
            fail("device", i, "kind", f"{kind!r} is not one of {', '.join(KINDS)}")
        if not -1 <= numa <= _INT32_MAX:
            fail("device", i, "numa", f"must be -1 (unknown) or a node number in [0, {_INT32_MAX}], got {numa}")
        if numa_cores and numa != -1 and numa not in numa_cores:
            fail("device", i, "numa", f"node {numa} has no [[numa]] table")
        names[name] = i
        devices.append(Device(name, kind, numa))
    if not any(d.kind in ("gpu", "host") for d in devices):
        raise TopologyError(f"{path}:1: no device of kind gpu or host: nothing to route between")

    links: list[Link] = []
    pairs: dict[tuple[int, int], int] = {}
    for i, t in enumerate(table_list("link")):
        check_keys("link", i, t, {"between", "kind", "gbps", "bridges", "latency_us"})
        between = get("link", i, t, "between", list)
        if len(between) != 2 or not all(isinstance(x, str) for x in between):
            fail("link", i, "between", f"expected two device names, got {between!r}")
        for x in between:
            if x not in names:
                fail("link", i, "between", f"no device named {x!r}")
        a, b = names[between[0]], names[between[1]]
        if a == b:
            fail("link", i, "between", f"joins {between[0]} to itself")
        key = (min(a, b), max(a, b))
        if key in pairs:
            fail("link", i, "between", f"{between[0]}-{between[1]} is already link {pairs[key]} "
                                       "(one link per pair; give its bridges)")
        pairs[key] = i
        kind = get("link", i, t, "kind", str)
        gbps = get("link", i, t, "gbps", (int, float))
        if not (gbps > 0 and _finite(gbps)):
            fail("link", i, "gbps", f"must be > 0 and finite, got {gbps}")
        bridges = get("link", i, t, "bridges", int, required=False, default=1)
        if bridges < 1:
            fail("link", i, "bridges", f"must be >= 1, got {bridges}")
        if not _finite(gbps, bridges):
            fail("link", i, "bridges", f"{bridges} bridges of {gbps} GB/s overflow a float")
        lat = get("link", i, t, "latency_us", (int, float))
        if not (lat >= 0 and _finite(lat)):
            fail("link", i, "latency_us", f"must be >= 0 and finite, got {lat}")
        links.append(Link(a, b, float(gbps) * bridges, float(lat), kind, bridges))

    placed: dict[str, list[tuple[str, int]]] = {}
    for table in ("nvme", "nic"):
        placed[table] = []
        for i, t in enumerate(table_list(table)):
            check_keys(table, i, t, {"name", "numa"})
            placed[table].append((get(table, i, t, "name", str), get(table, i, t, "numa", int)))
    name = doc.get("name", os.path.splitext(os.path.basename(path))[0])
    if not isinstance(name, str):
        raise TopologyError(f"{path}:{_locate(text, '', 0, 'name')}: name: expected a string, got {name!r}")
    return Topology(name, devices, links, numa_cores, placed["nvme"], placed["nic"], source=path)


# ------------------------------------------------------------------ sysfs
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _numa_of(dev_dir: str) -> int:
    v = _read(os.path.join(dev_dir, "numa_node"))
    try:
        return int(v) if v is not None else -1
    except ValueError:
        return -1


def _pcie_gbps(dev_dir: str) -> float | None:
    """A PCIe device's link bandwidth per direction from current_link_speed/width."""
    speed, width = _read(os.path.join(dev_dir, "current_link_speed")), _read(os.path.join(dev_dir, "current_link_width"))
    if not speed or not width:
        return None
    m = re.match(r"([\d.]+)\s*GT/s", speed)
    try:
        gt, lanes = float(m.group(1)), int(width)
    except (AttributeError, ValueError):
        return None
    enc = 8 / 10 if gt < 8 else 128 / 130  # PCIe 1-2: 8b/10b, 3+: 128b/130b
    return round(gt * enc * lanes / 8, 2)


def discover(sysfs: str = "/sys", gpus: bool = True, host_partitions_if_no_gpu: int = 0) -> Topology:
    """This machine's topology from sysfs (root configurable, so tests use fake trees):
    NUMA nodes and their cores (devices/system/node/node*/cpulist), NVIDIA GPUs and their
    nodes (bus/pci/devices/*: vendor 0x10de, class 0x03xxxx, numa_node; in PCI bus order,
    CUDA's order with CUDA_DEVICE_ORDER=PCI_BUS_ID), NVMe drives (class/nvme/*/device)
    and NICs (class/net/*/device). One "cpu" device per node; each GPU links to its
    node's cpu over PCIe (its link speed if sysfs gives it, else PCIE_GBPS); nodes link
    pairwise with NUMA_GBPS (sysfs does not say). NVLinks come from NVML when pynvml is
    importable and a driver answers (gpus=True); otherwise none: NVLinks between two GPUs
    link them, NVLinks to NVSwitches link the GPU to its fabric's switch device
    ("nvswitch", or "nvswitch0", "nvswitch1" ... with several: GPUs whose NVLinks end at
    a common switch are one fabric), NVLINK_GBPS a link. Fabrics whose GPUs NVML says
    reach each other over NVLink (switches trunked to each other, as DGX-2's two
    baseboards are) get an assumed trunk between their switch devices
    (_joined_fabrics); where NVML cannot say, they stay apart and the topology's
    warnings say so. Pairs the CUDA runtime reports peer access between (cuda-python's
    P2P attributes) and NVLink does not join get a PCIe peer link. With no GPU and
    host_partitions_if_no_gpu > 0, host partitions over the memory of the first node
    with cores.
    """
    node_root = os.path.join(sysfs, "devices", "system", "node")
    numa_cores: dict[int, list[int]] = {}
    for d in sorted(glob.glob(os.path.join(node_root, "node[0-9]*"))):
        n = int(os.path.basename(d)[4:])
        text = _read(os.path.join(d, "cpulist"))
        if text is None:
            continue
        try:
            numa_cores[n] = parse_cpulist(text)
        except ValueError as e:
            raise TopologyError(f"{os.path.join(d, 'cpulist')}:1: cpulist: {e}") from None
    if not numa_cores:
        numa_cores = {0: sorted(os.sched_getaffinity(0))} if sysfs == "/sys" else {}
    nodes = sorted(numa_cores) or [0]
    # a device whose node sysfs does not say is on the one socket, if there is one; a
    # memory-only node (CXL, GH200's GPU memory) is no socket
    sockets = [n for n in nodes if numa_cores.get(n)] or nodes

    def node_of(n: int) -> int:
        return sockets[0] if (n < 0 and len(sockets) == 1) else n

    devices = [Device(f"cpu{n}", "cpu", n) for n in nodes]
    cpu_index = {n: i for i, n in enumerate(nodes)}
    links = [Link(cpu_index[a], cpu_index[b], NUMA_GBPS, 1.0, "numa-assumed")
             for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    gpu_dirs = []
    for d in sorted(glob.glob(os.path.join(sysfs, "bus", "pci", "devices", "*"))):
        if _read(os.path.join(d, "vendor")) == "0x10de" and (_read(os.path.join(d, "class")) or "").startswith("0x03"):
            gpu_dirs.append(d)
    for k, d in enumerate(gpu_dirs):
        n = node_of(_numa_of(d))
        devices.append(Device(f"gpu{k}", "gpu", n))
        gbps = _pcie_gbps(d)
        host = cpu_index.get(n, 0)
        links.append(Link(len(devices) - 1, host, gbps or PCIE_GBPS, 1.0, "pcie" if gbps else "pcie-assumed"))
    warnings: list[str] = []
    if gpus and gpu_dirs:
        bus_ids = [os.path.basename(d) for d in gpu_dirs]
        first_gpu = len(nodes)
        nv = _nvml_links(bus_ids, sysfs)
        warnings += nv.warnings
        links += [Link(first_gpu + a, first_gpu + b, NVLINK_GBPS * n, 1.5, "nvlink", n)
                  for (a, b), n in sorted(nv.between.items())]
        nvlinked = {(first_gpu + a, first_gpu + b) for a, b in nv.between}
        fabrics = sorted({f for f in nv.fabric.values()})
        switch_of: dict[int, int] = {}   # fabric -> its switch device
        on_switch: dict[int, list[int]] = {}
        for f in fabrics:
            # Each fabric's NVSwitches as one device, as examples/topologies/nvswitch.toml
            # has them: every GPU pair on it is two hops apart at the slower GPU's NVLink
            # rate (the switches do not block). GPUs of different fabrics share no switch
            # and get no NVLink route unless NVML says the fabrics are joined (below;
            # _nvml_links says how fabrics are told apart).
            devices.append(Device("nvswitch" if len(fabrics) == 1 else f"nvswitch{f}", "switch", -1))
            switch_of[f] = len(devices) - 1
            on_switch[f] = sorted(k for k, g in nv.fabric.items() if g == f)
            links += [Link(first_gpu + k, switch_of[f], NVLINK_GBPS * nv.to_switch[k], 1.0, "nvlink",
                           nv.to_switch[k]) for k in on_switch[f]]
            nvlinked |= {(first_gpu + a, first_gpu + b)
                         for i, a in enumerate(on_switch[f]) for b in on_switch[f][i + 1:]}
        joined_to = {f: sum(f in t for t in nv.trunks) for f in fabrics}
        for f, g in nv.trunks:
            # NVML shows no NVLink between two switches, so the trunk's width is
            # assumed: as many NVLinks as the narrower fabric's GPUs have to their
            # switches, a trunk that does not block. That is DGX-2's (Ishii and Foley,
            # "NVSwitch and DGX-2", Hot Chips 2018, retold in NVIDIA's blog "NVSwitch
            # Accelerates NVIDIA DGX-2"): each of a baseboard's 6 NVSwitches has 18
            # ports, 8 to the board's 8 V100s (each V100's 6 NVLinks go one to each
            # switch), 8 to its peer on the other board, 2 unused; so 48 NVLinks join the
            # boards, as many as one board's GPUs have, and the quoted 2.4 TB/s bisection
            # is those 48 at 25 GB/s each way. The link's kind says its figure is
            # assumed: a thinner trunk would be slower than modelled. A fabric joined
            # to several others shares its switches' ports among their trunks, so
            # each trunk gets its share of those NVLinks (each full width, three
            # joined fabrics had twice the ports a switch has to give).
            # (at least one link, however many share it)
            width = max(1, min(sum(nv.to_switch[k] for k in on_switch[f]) // joined_to[f],
                               sum(nv.to_switch[k] for k in on_switch[g]) // joined_to[g]))
            links.append(Link(switch_of[f], switch_of[g], NVLINK_GBPS * width, 1.0, "nvlink-assumed", width))
            nvlinked |= {(first_gpu + min(a, b), first_gpu + max(a, b)) for a in on_switch[f] for b in on_switch[g]}
        links += _cuda_peer_links(bus_ids, first_gpu, nvlinked)
    if not gpu_dirs and host_partitions_if_no_gpu > 0:
        # on the first socket: a memory-only node has no core for their load thread
        for i in range(host_partitions_if_no_gpu):
            devices.append(Device(f"host{i}", "host", sockets[0]))
            links.append(Link(len(devices) - 1, cpu_index[sockets[0]], MEMCPY_GBPS, 0.5, "memcpy-assumed"))
    nvme = [(os.path.basename(c), node_of(_numa_of(os.path.join(c, "device"))))
            for c in sorted(glob.glob(os.path.join(sysfs, "class", "nvme", "nvme*")))]
    nics = [(os.path.basename(c), node_of(_numa_of(os.path.join(c, "device"))))
            for c in sorted(glob.glob(os.path.join(sysfs, "class", "net", "*")))
            if os.path.isdir(os.path.join(c, "device"))]
    return Topology("discovered" if sysfs == "/sys" else f"discovered from {sysfs}", devices, links, numa_cores, nvme,
                    nics, source=sysfs, warnings=warnings)


def _cuda_runtime():
    """cuda-python's runtime module (cuda.bindings.runtime, or cuda.cudart before 12.6); None without it."""
    try:
        from cuda.bindings import runtime  # noqa: PLC0415 - optional
        return runtime
    except ImportError:
        try:
            from cuda import cudart  # noqa: PLC0415
            return cudart
        except ImportError:
            return None


def _cuda_peer_links(bus_ids: list[str], first_gpu: int, nvlinked: set) -> list[Link]:
    """GPU pairs whose memory is reachable from each other (peer access) as the CUDA
    runtime reports it through cuda-python: cudaDevP2PAttrAccessSupported between the
    CUDA devices, matched to the sysfs GPUs (device indices first_gpu + k) by PCI bus id.
    A pair NVML already linked by NVLink (nvlinked) is left out; the rest are PCIe peer
    links (PCIE_GBPS). [] without cuda-python or a driver."""
    rt = _cuda_runtime()
    if rt is None:
        return []
    ok = rt.cudaError_t.cudaSuccess
    err, count = rt.cudaGetDeviceCount()
    if err != ok:
        return []
    index = {_bus_id(b): k for k, b in enumerate(bus_ids)}
    of_ordinal = {}
    for d in range(count):
        err, bus = rt.cudaDeviceGetPCIBusId(32, d)
        if err != ok:
            continue
        if _bus_id(bus) in index:
            of_ordinal[d] = index[_bus_id(bus)]
    links = []
    attr = rt.cudaDeviceP2PAttr.cudaDevP2PAttrAccessSupported
    ordinals = sorted(of_ordinal)
    for i, d1 in enumerate(ordinals):
        for d2 in ordinals[i + 1:]:
            a, b = sorted((first_gpu + of_ordinal[d1], first_gpu + of_ordinal[d2]))
            if (a, b) in nvlinked:
                continue
            err, access = rt.cudaDeviceGetP2PAttribute(attr, d1, d2)
            if err == ok and access:
                links.append(Link(a, b, PCIE_GBPS, 1.5, "pcie-p2p"))
    return links


@dataclass
class _NvLinks:
    between: dict[tuple[int, int], int]   # (GPU k, GPU r), k < r -> NVLink bridges between them
    to_switch: dict[int, int]              # GPU k -> its NVLinks that end at an NVSwitch
    fabric: dict[int, int] = field(default_factory=dict)  # GPU k on switches -> its fabric, 0, 1 ... by lowest GPU
    trunks: list[tuple[int, int]] = field(default_factory=list)  # (fabric f, fabric g), f < g: NVML says joined
    warnings: list[str] = field(default_factory=list)


def _bus_id(bus) -> str:
    """A PCI bus id as sysfs names its directory: NVML and CUDA write an 8-digit domain
    ("00000000:1A:00.0"), sysfs a 4-digit one in lower case ("0000:1a:00.0")."""
    return (bus.decode() if isinstance(bus, bytes) else bus).rstrip("\x00").lower()[-12:]


def _nvlink_ends_at_switch(pynvml, remote_type, handle, link: int, sysfs: str) -> bool | None:
    """Whether an NVLink's far end is an NVSwitch: NVML's remote device type where the
    driver and pynvml have it, else the far end's PCI class in sysfs (NVSwitches are
    NVIDIA bridges of class 0x068000; 0x068001 is POWER9's NPU, no switch). None when
    neither says (the far end is then looked for among the GPUs)."""
    if remote_type is not None:
        try:
            return remote_type(handle, link) == NVML_NVLINK_DEVICE_TYPE_SWITCH
        except pynvml.NVMLError:
            pass
    try:
        remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
    except pynvml.NVMLError:
        return None
    dev = os.path.join(sysfs, "bus", "pci", "devices", remote)
    if _read(os.path.join(dev, "vendor")) == "0x10de" and _read(os.path.join(dev, "class")) == "0x068000":
        return True
    return None


def _fabrics(switches_of: dict[int, set]) -> dict[int, int]:
    """GPUs grouped into NVSwitch fabrics: two GPUs whose NVLinks end at a common switch
    (by its PCI bus id) are on one fabric, and so are GPUs joined through a chain of
    such. Returns GPU -> fabric, numbered 0, 1 ... in order of each fabric's lowest GPU.
    What a GPU's NVLinks do not show is not seen: switches joined only to each other
    (DGX-2's two baseboards, whose switches are trunked) make two fabrics here;
    _joined_fabrics asks NVML whether such fabrics are joined."""
    fabric: dict[int, int] = {}
    on_switch: dict = {}   # switch bus id -> a GPU on it
    parent = {k: k for k in switches_of}

    def root(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k
    for k in sorted(switches_of):
        for switch in switches_of[k]:
            if switch in on_switch:
                parent[root(k)] = root(on_switch[switch])
            else:
                on_switch[switch] = k
    roots: dict[int, int] = {}
    for k in sorted(switches_of):
        fabric[k] = roots.setdefault(root(k), len(roots))
    return fabric


def _joined_fabrics(pynvml, handles: dict, fabric: dict[int, int],
                    between: dict[tuple[int, int], int]) -> tuple[list[tuple[int, int]], list[str]]:
    """Which NVSwitch fabrics (_fabrics' GPU -> fabric) are joined by switches trunked to
    each other, which no GPU's NVLinks show (DGX-2's two baseboards): fabrics f < g are
    when NVML reports an NVLink P2P path (nvmlDeviceGetP2PStatus, NVLINK index) for every
    GPU pair across them, leaving out pairs an NVLink bridge joins directly, whose path
    says nothing of the switches (and if no pair is left, they are not). Returns the
    joined pairs and warnings: where pynvml or the driver lacks the query, no fabric is
    joined and a warning says that the fabrics may be joined unseen."""
    members: dict[int, list[int]] = {}
    for k, f in sorted(fabric.items()):
        members.setdefault(f, []).append(k)
    if len(members) < 2:
        return [], []
    status = getattr(pynvml, "nvmlDeviceGetP2PStatus", None)

    def apart(why: str) -> tuple[list, list[str]]:
        return [], [f"{len(members)} NVSwitch fabrics, and NVML cannot say whether their switches are joined "
                    f"({why}): modelled apart, the GPUs of different fabrics without an NVLink route (they are "
                    "joined on a DGX-2, whose two baseboards' switches are trunked)"]
    if status is None:
        return apart("this pynvml has no nvmlDeviceGetP2PStatus")
    joined = []
    for f in sorted(members):
        for g in sorted(members):
            if g <= f:
                continue
            pairs = [(a, b) for a in members[f] for b in members[g] if (min(a, b), max(a, b)) not in between]
            try:
                if pairs and all(status(handles[a], handles[b], NVML_P2P_CAPS_INDEX_NVLINK) == NVML_P2P_STATUS_OK
                                 for a, b in pairs):
                    joined.append((f, g))
            except pynvml.NVMLError as e:  # a driver older than the pynvml
                return apart(f"nvmlDeviceGetP2PStatus: {e}")
    return joined, []


def _nvml_links(bus_ids: list[str], sysfs: str) -> _NvLinks:
    """The NVLinks of the GPUs (sysfs bus ids; GPU k is bus_ids[k]) as NVML reports them:
    bridges between two GPUs, each GPU's NVLinks to NVSwitches (DGX/HGX A100 and
    H100, where no NVLink ends at a GPU) and the fabric those make it part of (_fabrics;
    switches told apart by the PCI bus id NVML gives as each NVLink's far end, those it
    does not name taken as one switch), and which fabrics NVML says are joined
    (_joined_fabrics). Nothing without pynvml or a driver; a GPU NVML
    does not know (bound to another driver such as vfio-pci, or NVML sees no GPU at all)
    has only the NVLinks other GPUs report to it."""
    none = _NvLinks({}, {})
    try:
        import pynvml  # noqa: PLC0415 - optional
    except ImportError:
        return none
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no links to report
        return none
    # older pynvml lacks it; older drivers raise NVMLError when it is called
    remote_type = getattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    try:
        index = {_bus_id(b): k for k, b in enumerate(bus_ids)}
        seen_from: dict[tuple[int, int], int] = {}   # (GPU k, GPU r) -> k's NVLinks ending at r
        to_switch: dict[int, int] = {}
        switches_of: dict[int, set] = {}   # GPU k -> the bus ids of the NVSwitches its NVLinks end at
        handles: dict[int, object] = {}
        for k, b in enumerate(bus_ids):
            try:
                h = pynvml.nvmlDeviceGetHandleByPciBusId(b)
            except pynvml.NVMLError:
                continue  # its NVLinks to other GPUs are still seen from their ends
            handles[k] = h
            for link in range(NVML_NVLINK_MAX_LINKS):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(h, link):
                        continue
                except pynvml.NVMLError:
                    continue
                if _nvlink_ends_at_switch(pynvml, remote_type, h, link, sysfs):
                    to_switch[k] = to_switch.get(k, 0) + 1
                    try:
                        switch = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                    except pynvml.NVMLError:
                        switch = None  # a switch NVML does not name: taken as one, shared
                    switches_of.setdefault(k, set()).add(switch)
                    continue
                try:
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                except pynvml.NVMLError:
                    continue
                r = index.get(_bus_id(remote))
                if r is not None and r != k:
                    seen_from[(k, r)] = seen_from.get((k, r), 0) + 1
        # A bridge between two GPUs is seen from both ends, or from one where NVML does
        # not know the other; one to a switch from the GPU's end only.
        between: dict[tuple[int, int], int] = {}
        for (k, r), n in seen_from.items():
            pair = (min(k, r), max(k, r))
            between[pair] = max(between.get(pair, 0), n)
        fabric = _fabrics(switches_of)
        trunks, warnings = _joined_fabrics(pynvml, handles, fabric, between)
        return _NvLinks(between, to_switch, fabric, trunks, warnings)
    finally:
        pynvml.nvmlShutdown()


def write_fake_sysfs(root: str, nodes: int, cores_per_node: int, gpus_per_node: int, nvme_node: int,
                     nic_node: int) -> str:
    """Writes a sysfs tree of a machine we do not have under root (for tests and W8):
    `nodes` NUMA nodes of `cores_per_node` cores each, `gpus_per_node` NVIDIA GPUs on
    each (PCIe 4.0 x16), one NVMe drive on nvme_node, one NIC (eth0) on nic_node and a
    loopback without a device. Returns root."""
    def put(path: str, text: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    for n in range(nodes):
        lo = n * cores_per_node
        put(os.path.join(root, "devices", "system", "node", f"node{n}", "cpulist"), f"{lo}-{lo + cores_per_node - 1}")
    pci = os.path.join(root, "bus", "pci", "devices")
    k = 0
    for n in range(nodes):
        for _ in range(gpus_per_node):
            dev = os.path.join(pci, f"0000:{0x10 + k:02x}:00.0")
            for name, value in (("vendor", "0x10de"), ("class", "0x030200"), ("numa_node", str(n)),
                                ("current_link_speed", "16.0 GT/s PCIe"), ("current_link_width", "16")):
                put(os.path.join(dev, name), value)
            k += 1
    nic = os.path.join(pci, "0000:99:00.0")  # not a GPU: another vendor and class
    for name, value in (("vendor", "0x8086"), ("class", "0x020000"), ("numa_node", str(nic_node))):
        put(os.path.join(nic, name), value)
    put(os.path.join(root, "class", "nvme", "nvme0", "device", "numa_node"), str(nvme_node))
    os.makedirs(os.path.join(root, "class", "net", "lo"), exist_ok=True)  # virtual: no device
    os.makedirs(os.path.join(root, "class", "net", "eth0"), exist_ok=True)
    os.symlink(nic, os.path.join(root, "class", "net", "eth0", "device"))
    return root

# ------------------------------------------------------------------ `hps topology`
def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [line.rstrip() for line in [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
            + [fmt.format(*map(str, r)) for r in rows]]


def _joined_by(topo: Topology, a: int, b: int) -> str:
    """How endpoints a and b are joined, nvidia-smi topo -m style, judged on the model's
    devices and links without passing another endpoint: a link of their own (its kind's
    first two letters and bridges: NV2); else the nearest of an NVSwitch fabric (switches
    joined by NVLinks only: SWn, n the fewest bridges on the way), PCIe switches (PIX one,
    PXB several), one CPU (PHB: its host bridge or memory) and CPUs of several NUMA nodes
    (SYS); "-" if the model joins them through nothing but other endpoints."""
    between = [l for l in topo.links if {l.a, l.b} == {a, b}]
    if between:
        return f"{between[0].kind[:2].upper()}{between[0].bridges}"

    def fewest(kinds: set[str], nvlink_only: bool) -> tuple[int, int, int] | None:
        """(CPUs, switches, fewest bridges) of the way from a to b through devices of
        `kinds` with the fewest CPUs, then switches; None if there is none."""
        best: dict[int, tuple[int, int, int]] = {a: (0, 0, 1 << 30)}
        todo = [a]
        while todo:  # few devices: relax until nothing improves
            here = todo.pop()
            cpus, switches, narrowest = best[here]
            for l in topo.links:
                if here not in (l.a, l.b) or (nvlink_only and not l.kind.startswith("nvlink")):
                    continue
                there = l.b if l.a == here else l.a
                kind = topo.devices[there].kind
                if there != b and kind not in kinds:
                    continue
                cost = (cpus + (kind == "cpu"), switches + (kind == "switch"), min(narrowest, l.bridges))
                if there not in best or (cost[0], cost[1], -cost[2]) < (best[there][0], best[there][1], -best[there][2]):
                    best[there] = cost
                    if there != b:
                        todo.append(there)
        return best.get(b)

    fabric = fewest({"switch"}, nvlink_only=True)
    if fabric:
        return f"SW{fabric[2]}"
    pcie = fewest({"switch"}, nvlink_only=False)
    if pcie:
        return "PIX" if pcie[1] == 1 else "PXB"
    host = fewest({"switch", "cpu"}, nvlink_only=False)
    if host:
        return "PHB" if host[0] == 1 else "SYS"
    return "-"


def format_text(topo: Topology, rows: int = 1_000_000, row_bytes: int = 256) -> str:
    """What `hps topology` prints: what discovery warns of, devices, links, the
    endpoints' link matrix, the routes of an even all-to-all of `rows` rows and the
    modelled time of each schedule, and the core binding plan."""
    ep = topo.endpoints
    out = [f"topology: {topo.name} (from {topo.source or 'memory'})"]
    out += [f"warning: {w}" for w in topo.warnings] + [""]
    rows_d = [[i, d.name, d.kind, d.numa, len(topo.numa_cores.get(d.numa, []))] for i, d in enumerate(topo.devices)]
    out += _table(["#", "device", "kind", "numa", "cores on its node"], rows_d) + [""]
    rows_l = [[f"{topo.devices[l.a].name}-{topo.devices[l.b].name}", l.kind, l.bridges, f"{l.gbps:g}",
               f"{l.latency_us:g}"] for l in topo.links]
    out += _table(["link", "kind", "bridges", "GB/s each way", "latency us"], rows_l) + [""]
    for name, nodes in (("NVMe", topo.nvme), ("NIC", topo.nics)):
        if nodes:
            out.append(f"{name}: " + ", ".join(f"{n} (node {k})" for n, k in nodes))
    names = [topo.devices[i].name for i in ep]
    grid = [[topo.devices[i].name, *("X" if i == j else _joined_by(topo, i, j) for j in ep)] for i in ep]
    out += ["", "how each endpoint pair is joined (nvidia-smi topo -m style):"] + _table(["", *names], grid)
    out += ["  NVn, PCn ...: a link of their own (its kind's first two letters, n bridges)",
            "  SWn: an NVSwitch fabric (n NVLinks at the narrower end); PIX / PXB: one / several PCIe switches",
            "  PHB: one CPU (its PCIe host bridge or memory); SYS: the CPUs of several NUMA nodes; -: nothing"]
    if len(ep) < 2:
        out += ["", "one endpoint: nothing to route"]
    else:
        m = even_all_to_all(len(ep), rows, row_bytes)
        plans = {s: topo.plan(m, s) for s in SCHEDULES}
        relay = plans["relay"]
        by = {(r["src"], r["dst"]): r for r in relay["routes"]}
        grid = []
        for s in range(len(ep)):
            cells = []
            for d in range(len(ep)):
                r = by.get((s, d))
                cells.append("." if r is None else {"direct": "D", "host": "H"}.get(r["kind"], f"R{r['via']}"))
            grid.append([names[s], *cells])
        out += ["", f"routes of an even all-to-all of {rows:,} rows of {row_bytes} B "
                    "(D direct, H through host memory, Rk relayed via endpoint k):"] + _table(["", *names], grid)
        out += ["", "relayed and host routes, and why:"]
        out += [f"  {names[r['src']]} -> {names[r['dst']]}: {r['reason']}" for r in relay["routes"]
                if r["kind"] != "direct"] or ["  (none: every pair direct)"]
        host = plans["host"]["seconds"]
        out += ["", "modelled time of the all-to-all (include/hps/topology.h's cost model):"]
        out += _table(["schedule", "ms", "/ host", "routes"],
                      [[s, f"{p['seconds'] * 1e3:.3f}", f"{p['seconds'] / host:.3f}",
                        ", ".join(f"{k} {v}" for k, v in p["route_count"].items() if v and k != "none")]
                       for s, p in plans.items()])
    b = topo.binding_plan()
    out += ["", f"core binding: {b.reason}"]
    out += _table(["stage", "node", "cores", "why"], [[s.stage, s.numa, _cpulist(s.cores), s.reason] for s in b.stages])
    return "\n".join(out)


def _cpulist(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def plot(topo: Topology, path: str, rows: int = 1_000_000, row_bytes: int = 256) -> str:
    """A PNG of the devices and links (width by bandwidth, colour by kind), titled with
    the modelled time of an even all-to-all relayed and through host memory. Needs
    matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import math
    ep = topo.endpoints
    # endpoints on an ellipse (no three on a line, so every link is seen as itself),
    # switches below the endpoints they join, CPUs below the devices they join
    # (the first NUMA node's on the left arc, the rest on the right, mirrored)
    pos: dict[int, tuple[float, float]] = {}
    order = sorted(ep, key=lambda i: (topo.devices[i].numa, i))
    half = (len(order) + 1) // 2
    for k, i in enumerate(order):
        if k < half:
            angle = math.pi / 2 + math.pi * (k + 0.5) / half
        else:
            angle = math.pi / 2 - math.pi * (k - half + 0.5) / max(1, len(order) - half)
        pos[i] = (4.0 * math.cos(angle), 3.0 + 1.6 * math.sin(angle))
    neighbours: dict[int, list[int]] = {i: [] for i in range(len(topo.devices))}
    for l in topo.links:
        neighbours[l.a].append(l.b)
        neighbours[l.b].append(l.a)
    for row, kind in ((1.0, "switch"), (-0.3, "cpu")):
        items = [i for i, d in enumerate(topo.devices) if d.kind == kind and i not in pos]
        for k, i in enumerate(items):
            xs = [pos[j][0] for j in neighbours[i] if j in pos]
            x = sum(xs) / len(xs) if xs else -4.0 + 8.0 * (k + 0.5) / len(items)
            while any(abs(x - pos[j][0]) < 0.7 for j in items[:k]):  # keep a row's devices apart
                x += 0.7
            pos[i] = (x, row)
    for i in range(len(topo.devices)):  # anything else
        pos.setdefault(i, (-4.0 + 0.5 * i, -1.0))
    colours = {"nvlink": "tab:green", "pcie": "tab:blue", "upi": "tab:red", "memcpy": "tab:gray"}
    fig, ax = plt.subplots(figsize=(10, 6))
    top = max(l.gbps for l in topo.links) if topo.links else 1
    for l in topo.links:
        (x1, y1), (x2, y2) = pos[l.a], pos[l.b]
        c = colours.get(l.kind.split("-")[0], "tab:purple")
        ax.plot([x1, x2], [y1, y2], color=c, lw=1 + 5 * l.gbps / top, alpha=0.7, zorder=1)
        ax.text((x1 + x2) / 2, (y1 + y2) / 2, f"{l.gbps:g}", fontsize=7, color=c, ha="center")
    if len(ep) >= 2:
        plan = topo.plan(even_all_to_all(len(ep), rows, row_bytes), "relay")
        host = topo.plan(even_all_to_all(len(ep), rows, row_bytes), "host")
        ax.set_title(f"{topo.name}: all-to-all of {rows:,} rows of {row_bytes} B, modelled "
                     f"{plan['seconds'] * 1e3:.2f} ms with {plan['route_count']['relay']} pairs relayed vs "
                     f"{host['seconds'] * 1e3:.2f} ms through host memory", fontsize=9)
    for i, (x, y) in pos.items():
        d = topo.devices[i]
        ax.scatter([x], [y], s=600 if d.kind in ("gpu", "host") else 400, zorder=3,
                   color={"gpu": "white", "host": "white", "cpu": "lightyellow"}.get(d.kind, "lightgray"),
                   edgecolors="black")
        ax.text(x, y, f"{d.name}\nn{d.numa}" if d.numa >= 0 else d.name, ha="center", va="center", fontsize=7,
                zorder=4)
    for kind, c in colours.items():
        ax.plot([], [], color=c, label=kind)
    ax.legend(loc="lower right", fontsize=7, title="link (GB/s each way)", title_fontsize=7)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cli(file: str | None, sysfs: str, png: str | None, rows: int) -> str:
    """`hps topology`: the text report of a file's topology or this machine's; writes
    the PNG too with png. Returns the text."""
    if not file and not os.path.isdir(sysfs):
        # discover() reads what it finds: a mistyped root would print an empty machine as this one
        raise TopologyError(f"--sysfs: {sysfs}: no such directory")
    topo = load(file) if file else discover(sysfs, host_partitions_if_no_gpu=0)
    if not topo.endpoints and not file:
        hosts = host_partitions(len(topo.cpu_nodes) or 1, numa_cores=topo.numa_cores)
        topo = Topology(topo.name + " (no GPU: one host partition a NUMA node)", hosts.devices, hosts.links,
                        topo.numa_cores, topo.nvme, topo.nics, topo.source, topo.warnings)
    pairs = len(topo.endpoints) ** 2
    if len(topo.endpoints) > 1 and rows < pairs:
        # even_all_to_all gives each pair rows // pairs: fewer would route nothing (and
        # divide by a zero host time)
        raise ValueError(f"--rows: must be at least {pairs:,} (one row a pair of {len(topo.endpoints)} endpoints), "
                         f"got {rows:,}")
    text = format_text(topo, rows=rows)
    if png:
        text += f"\n\nplot: {plot(topo, png, rows=rows)}"
    return text


# ------------------------------------------------------------------ applying a binding
# The pipeline's helper threads and the plan's stages they serve: the reader reads
# from the network or files (the NIC's node); prefetch and write-back move rows to
# and from SSD-PS (the drive's node); the one load thread feeds every device (the
# union of their nodes).
THREAD_STAGES = {"reader": ("reader",), "prefetcher": ("ssd_io",), "writer": ("ssd_io",), "loader": ("load:",)}


def apply_binding(plan: BindingPlan, thread: str) -> dict:
    """Pins the calling thread to the cores of its stages (THREAD_STAGES) and says what
    it got: {"cores": the thread's affinity afterwards, "reason": ...}; a no-op plan
    leaves the thread alone ("cores": None). The plan's cores come from sysfs, which
    lists a node's cores whatever this process may use: the thread gets only those
    among the cores it may run on now (taskset, a cgroup's cpuset, offline cores), so
    that binding never widens what the process was given. A planned core set with none
    of those is reported, not raised: the run goes on unbound."""
    if thread not in THREAD_STAGES:
        raise KeyError(f"no pipeline thread {thread!r} (known: {', '.join(THREAD_STAGES)})")
    if plan.noop:
        return {"cores": None, "reason": plan.reason}
    chosen = [s for s in plan.stages if any(s.stage == p or (p.endswith(":") and s.stage.startswith(p))
                                            for p in THREAD_STAGES[thread])]
    cores = sorted({c for s in chosen for c in s.cores})
    reason = "; ".join(f"{s.stage}: {s.reason}" for s in chosen)
    if not cores:
        return {"cores": None, "reason": f"no cores planned ({reason or 'no stage'})"}
    allowed = os.sched_getaffinity(0)
    usable = [c for c in cores if c in allowed]
    if not usable:
        return {"cores": None, "reason": f"not applied: cores {_cpulist(cores)}: none is among the cores this "
                                         f"process may run on ({_cpulist(sorted(allowed))})"}
    if len(usable) < len(cores):
        reason += f"; of cores {_cpulist(cores)} only {_cpulist(usable)} are among those this process may run on"
    try:
        os.sched_setaffinity(0, usable)
    except OSError as e:
        return {"cores": None, "reason": f"not applied: cores {_cpulist(usable)}: {e.strerror}"}
    return {"cores": sorted(os.sched_getaffinity(0)), "reason": reason}
