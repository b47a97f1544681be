"""The dense model on the workers' devices (issue 15): a replica a worker, the
replicas' gradients summed before the one dense step, the step copied back.
On a GPU node worker g trains on GPU g; here the same code runs with the
replicas on the CPU (dense_replica_per_worker) and must train what the
in-place path trains."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
import hps  # noqa: E402
from hps.torch import DeviceReplicas, mlp  # noqa: E402
from hps.train import DataConfig, TrainConfig, load_trainer_state, train  # noqa: E402

VOCAB = [50, 200, 1000, 5000] + [800] * 22
BATCHES = 6


def config(path, devices=1, **kw):
    data = DataConfig(batch_size=512, train_examples=512 * BATCHES, eval_examples=1024, vocab_sizes=VOCAB)
    ps = hps.ParameterServerConfig(dim=4, path=str(path), optimizer=hps.AdaGrad(lr=0.05), mem_budget="64MB",
                                   devices=devices, write_buffer_rows=256)
    return TrainConfig(ps=ps, data=data, hidden=(16, 8), dense_lr=0.01, torch_threads=1,
                       **{"pipelined": False, **kw})


def final_state(path):
    ps = hps.ParameterServer.open(path)
    keys = np.unique(np.concatenate([b.keys.ravel() for b in hps.data.SyntheticCriteo(
        seed=0, batch_size=512, examples=512 * BATCHES, vocab_sizes=VOCAB)]))
    rows = ps.pull(keys)
    ps.close()
    return rows, load_trainer_state(path)["mlp"]


@pytest.fixture(scope="module")
def in_place(tmp_path_factory):
    path = tmp_path_factory.mktemp("in_place")
    summary = train(config(path), progress=False)
    return summary, final_state(path)


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_a_replica_a_worker_trains_what_the_in_place_path_trains(tmp_path, in_place, devices):
    summary, (rows, mlp_state) = in_place
    rep = train(config(tmp_path / "rep", devices=devices, dense_replica_per_worker=True), progress=False)
    got_rows, got_mlp = final_state(tmp_path / "rep")
    # Sums in another order (the mini-batches' gradients meet on the owners and in the reduce).
    np.testing.assert_allclose(got_rows, rows, rtol=1e-3, atol=3e-4)
    for name, value in mlp_state.items():
        torch.testing.assert_close(got_mlp[name], value, rtol=1e-3, atol=3e-4, msg=name)
    assert rep["final"]["auc"] == pytest.approx(summary["final"]["auc"], abs=1e-4)
    assert rep["dense_model"] == {"devices": ["cpu"] * devices, "replicas": devices}
    if devices > 1:
        assert rep["ps"]["device"]["kind"] == "cpu" and rep["ps"]["device"]["devices"] == devices
        from hps.cli import _summary_table
        table = _summary_table(rep)
        assert f"{devices} replica(s) on " + ", ".join(["cpu"] * devices) in table
        moved = np.asarray(rep["ps"]["device"]["transfer_rows"])
        between = int(moved.sum() - np.trace(moved))
        assert between > 0 and f"cpu, {devices} devices, {between:,} rows between them" in table
        assert "routes" in table and "(counted)" in table  # the flat default: counted, not executed


@pytest.mark.parametrize("devices", [2, 4])
def test_workers_on_one_replica_train_what_the_in_place_path_trains_bit_for_bit(tmp_path, in_place, devices):
    # Workers sharing the one replica on the CPU run as one model call
    # (Trainer._calls), their examples in order: the MLP's sums are the in-place
    # path's, and each worker's rows, gathered and accumulated by its own calls
    # into the tier, sum on the owners in example order too.
    summary, (rows, mlp_state) = in_place
    shared = train(config(tmp_path / "shared", devices=devices), progress=False)
    got_rows, got_mlp = final_state(tmp_path / "shared")
    np.testing.assert_array_equal(got_rows, rows)
    for name, value in mlp_state.items():
        assert torch.equal(got_mlp[name], value), name
    assert shared["dense_model"] == {"devices": ["cpu"] * devices, "replicas": 1}
    # The tier still served each worker its own rows: the transfer matrix a
    # replica a worker makes (the same partition, one call a worker).
    rep = train(config(tmp_path / "rep", devices=devices, dense_replica_per_worker=True), progress=False)
    assert shared["ps"]["device"]["transfer_rows"] == rep["ps"]["device"]["transfer_rows"]
    moved = np.asarray(shared["ps"]["device"]["transfer_rows"])
    assert moved.shape == (devices, devices) and (moved.sum(axis=0) > 0).all()


def test_device_replicas_reduce_then_broadcast():
    net = mlp(6, (5,), seed=3)
    shared = torch.nn.Linear(2, 2)
    holder = torch.nn.ModuleDict({"mlp": net, "emb": shared})
    reps = DeviceReplicas(holder, ["cpu", "cpu", "cpu"], shared=[shared], per_worker=True)
    assert len(reps) == 3 and reps.replica(0) is holder
    assert reps.replica(1)["emb"] is shared and reps.replica(1)["mlp"] is not net  # shared, not copied
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(0))
    # One model over the three slices, one after another: what the replicas must sum to.
    want = mlp(6, (5,), seed=3)
    for part in x.split(3):
        want(part).sum().backward()
    for w, part in enumerate(x.split(3)):
        reps.replica(w)["mlp"](part).sum().backward()
    reps.reduce_gradients()
    for p, q in zip(net.parameters(), want.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert all(p.grad is None for r in (1, 2) for p in reps.replica(r)["mlp"].parameters())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    reps.broadcast()
    for r in (1, 2):
        for p, q in zip(net.parameters(), reps.replica(r)["mlp"].parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()


def test_workers_on_one_device_share_a_replica_unless_asked():
    net = mlp(4, (3,))
    reps = DeviceReplicas(net, ["cpu", "cpu"])
    assert len(reps) == 1 and reps.replica(1) is net
    with pytest.raises(ValueError, match="at least one device"):
        DeviceReplicas(net, [])


def test_model_devices_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"cfg: model_devices must be \"auto\", \"cpu\" or \"cuda\", got 'gpu'"):
        TrainConfig.from_dict({"ps": {"dim": 4, "path": str(tmp_path / "x")}, "model_devices": "gpu"},
                              source="cfg")
    # One device more than torch sees: refused on any machine, GPUs or none.
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = seen + 1
    with pytest.raises(ValueError, match=rf"model_devices = \"cuda\" .*\[ps\] devices = {want} needs {want} "
                                         rf"GPU\(s\), and torch sees {seen}"):
        train(config(tmp_path / "c", devices=want, model_devices="cuda"), progress=False)
    # (refused before the server made the job's directory, which the next run would
    # have found as a run "that ended before its first checkpoint")
    assert not (tmp_path / "c").exists()


def test_auto_takes_the_gpus_only_when_the_tier_is_on_them(tmp_path):
    from hps.train import worker_devices
    gpus = min(hps.cuda_device_count(), torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for devices in (1, 4):
        want = [f"cuda:{g}" for g in range(devices)] if gpus >= devices else ["cpu"] * devices
        assert worker_devices(config(tmp_path / "a", devices=devices), torch) == want
    assert worker_devices(config(tmp_path / "a", devices=4, model_devices="cpu"), torch) == ["cpu"] * 4


def test_hierarchical_refuses_replicas(tmp_path):
    with pytest.raises(ValueError, match=r"\[hierarchical\] splits one dense model on the CPU"):
        train(config(tmp_path / "h", devices=2, dense_replica_per_worker=True), progress=False,
              dense_hook=lambda trainer: None)


@pytest.mark.skipif(not (torch.cuda.is_available() and hps.cuda_device_count() >= 1),
                    reason="needs a CUDA GPU that torch and hps both see")
def test_the_model_trains_on_the_gpu_as_on_the_cpu(tmp_path, in_place):
    summary, (rows, mlp_state) = in_place
    gpu = train(config(tmp_path / "gpu", model_devices="cuda"), progress=False)
    got_rows, got_mlp = final_state(tmp_path / "gpu")
    np.testing.assert_allclose(got_rows, rows, rtol=1e-3, atol=1e-4)
    for name, value in mlp_state.items():
        torch.testing.assert_close(got_mlp[name], value, rtol=1e-3, atol=1e-4, msg=name)
    assert gpu["final"]["auc"] == pytest.approx(summary["final"]["auc"], abs=1e-3)


def test_bind_cores_pins_the_helper_threads_as_the_topology_plans(tmp_path):
    # A fake machine of 2 NUMA nodes of one core each (cores 0 and 1): the NVMe
    # drive on node 1, the NIC on node 0. A core this machine lacks is reported
    # as not applied, and the run goes on unbound.
    from hps import topology as T
    from hps.cli import _summary_table
    sysfs = T.write_fake_sysfs(str(tmp_path / "sys"), nodes=2, cores_per_node=1, gpus_per_node=0, nvme_node=1,
                               nic_node=0)
    summary = train(config(tmp_path / "b", pipelined=True, bind_cores=True, sysfs=sysfs), progress=False)
    bound = summary["core_binding"]
    assert bound["noop"] is False and "2 NUMA nodes" in bound["reason"]
    threads = bound["threads"]
    have = os.sched_getaffinity(0)
    for thread, core in (("prefetcher", 1), ("writer", 1), ("reader", 0)):  # the drive's node, the NIC's
        if core in have:
            assert threads[thread]["cores"] == [core], thread
        else:
            assert threads[thread]["cores"] is None and "not applied" in threads[thread]["reason"], thread
    assert "NUMA node 1" in threads["prefetcher"]["reason"] or "not applied" in threads["prefetcher"]["reason"]
    if 1 in have:
        assert "prefetcher on 1" in _summary_table(summary)
    # One node: nothing is bound, and the summary says why.
    one = T.write_fake_sysfs(str(tmp_path / "one"), nodes=1, cores_per_node=2, gpus_per_node=0, nvme_node=0,
                             nic_node=0)
    summary = train(config(tmp_path / "c", pipelined=True, bind_cores=True, sysfs=one), progress=False)
    assert summary["core_binding"]["noop"] and "no-op" in summary["core_binding"]["reason"]
    assert all(t["cores"] is None for t in summary["core_binding"]["threads"].values())
    assert "binding is a no-op" in _summary_table(summary)
