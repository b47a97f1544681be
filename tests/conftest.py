"""Settings of the whole test session."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def no_hydra_topology_files_in_tmp(tmp_path_factory):
    """MPICH's mpiexec (hydra) writes the machine's topology for its proxies to
    /tmp/hydra_hwloc_xmlfile_* (a mkstemp name, always in /tmp: TMPDIR does not move it), and
    removes it only when the job exits cleanly: each test whose job is aborted
    (MPI_Abort, a rank killed, a timeout) left one in /tmp for good. Given
    HWLOC_XMLFILE in its environment, hydra writes none. The one set here names no
    file (in pytest's own temporary directory), so that hwloc, in the proxies and
    the ranks, finds it unreadable and discovers the machine itself, as without it
    (process binding included). Every mpiexec of the suite, and of the benchmarks
    it runs, gets os.environ."""
    before = os.environ.get("HWLOC_XMLFILE")
    if before is None:
        os.environ["HWLOC_XMLFILE"] = str(tmp_path_factory.mktemp("hwloc") / "no-topology.xml")
    yield
    if before is None:
        os.environ.pop("HWLOC_XMLFILE", None)
