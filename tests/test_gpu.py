"""The CUDA launcher against the CPU launcher. Skipped without a GPU."""
import numpy as np
import pytest

import hps

GPUS = hps.cuda_device_count()
needs_gpu = pytest.mark.skipif(
    GPUS == 0, reason="no usable CUDA device (no GPU, or the driver is missing or too old)")


@pytest.fixture
def cuda_torch():
    """torch, where it sees a CUDA GPU (else the test skips)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


def one_device_server(path, optimizer):
    """A parameter server of dim 4 whose one device tier is the GPU's (not the in-place host batch)."""
    cfg = dict(dim=4, mem_budget="1MiB", optimizer=optimizer, devices=1, host_in_place=False)
    return hps.ParameterServer(hps.ParameterServerConfig(path=str(path), **cfg))


@pytest.mark.skipif(GPUS > 0, reason="a GPU is present; this checks the message given without one")
def test_cuda_request_without_a_gpu_says_why():
    with pytest.raises(RuntimeError, match="CUDA device 0 requested, but"):
        hps.HashTable(16, 4, device="cuda:0")


@pytest.mark.gpu
@needs_gpu
def test_table_ops_match_the_cpu():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 50_000, 100_000).astype(np.uint64)
    rows = rng.integers(-3, 4, (keys.size, 8)).astype(np.float32)
    gpu, cpu = hps.HashTable(80_000, 8, device="cuda:0"), hps.HashTable(80_000, 8)
    for table in (gpu, cpu):
        table.accumulate(keys, rows)
    assert len(gpu) == len(cpu)
    probe = rng.integers(0, 60_000, 20_000).astype(np.uint64)
    g_rows, g_found = gpu.find(probe)
    c_rows, c_found = cpu.find(probe)
    np.testing.assert_array_equal(g_found, c_found)
    np.testing.assert_array_equal(g_rows, c_rows)
    g_keys, _ = gpu.export()
    assert sorted(g_keys.tolist()) == sorted(cpu.export()[0].tolist())


@pytest.mark.gpu
@needs_gpu
def test_assign_of_a_repeated_key_stores_its_last_row_as_the_cpu_does():
    # Thousands of threads copying into one row at once left a mix of their rows.
    keys = np.array([7] * 5_000 + [8, 9, 8], np.uint64)
    rows = np.arange(keys.size * 8, dtype=np.float32).reshape(keys.size, 8)
    gpu, cpu = hps.HashTable(64, 8, device="cuda:0"), hps.HashTable(64, 8)
    for table in (gpu, cpu):
        table.insert(np.array([7, 8], np.uint64), np.zeros((2, 8), np.float32))
        found = table.assign(keys, rows)
        assert found.tolist() == [True] * 5_001 + [False, True]
    g_rows, _ = gpu.find(np.array([7, 8], np.uint64))
    np.testing.assert_array_equal(g_rows, rows[[4_999, 5_002]])
    np.testing.assert_array_equal(g_rows, cpu.find(np.array([7, 8], np.uint64))[0])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("optimizer", [hps.SGD(0.1), hps.AdaGrad(0.1), hps.Adam(0.01)])
def test_optimizers_match_the_cpu(optimizer):
    rng = np.random.default_rng(1)
    gpu = hps.EmbeddingTable(50_000, 8, optimizer=optimizer, seed=3, device="cuda:0")
    cpu = hps.EmbeddingTable(50_000, 8, optimizer=optimizer, seed=3)
    for _ in range(5):
        keys = (rng.zipf(1.3, 10_000) % 20_000).astype(np.uint64)
        grads = rng.normal(0, 1, (keys.size, 8)).astype(np.float32)
        np.testing.assert_allclose(gpu.pull(keys), cpu.pull(keys), rtol=1e-5, atol=2e-5)
        gpu.push(keys, grads)
        cpu.push(keys, grads)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_gradient_sum_that_overflows_is_refused_on_the_gpu_as_on_the_cpu(tmp_path, device):
    """Key 5's two gradients, 2e38 each, sum to an infinity: the CUDA tables' step
    refuses it, naming the key, before any row changes, as the CPU's does; then a
    GPU tier's batch (the same check on its gradient table)."""
    table = hps.EmbeddingTable(1_000, 4, optimizer=hps.AdaGrad(0.1), seed=3, device=device)
    keys = np.array([6, 5, 5], np.uint64)
    before = table.pull(np.array([5, 6], np.uint64))
    grads = np.ones((3, 4), np.float32)
    grads[1:, 2] = 2e38
    with pytest.raises(hps.DivergedError, match=r"^apply_gradients: 1 non-finite value in the summed gradients of 1 "
                                                r"key \(key 5 first: inf\)"):
        table.push(keys, grads)
    np.testing.assert_array_equal(table.pull(np.array([5, 6], np.uint64)), before)
    if device == "cpu":
        return
    ps = one_device_server(tmp_path / "ps", hps.AdaGrad(0.1))
    before = ps.pull(np.array([5, 6], np.uint64))
    with pytest.raises(hps.DivergedError, match=r"apply_summed_gradients: 1 non-finite value in the summed "
                                                r"gradients of 1 key \(key 5 first: inf\)"):
        ps.push(keys, grads)
    np.testing.assert_array_equal(ps.pull(np.array([5, 6], np.uint64)), before)
    assert ps.stats()["mem"]["pinned"] == 0
    ps.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("optimizer, grad, said", [
    (hps.SGD(lr=10.0), 1e38, "its embedding, column 2, would be -inf"),
    (hps.AdaGrad(lr=0.1), 1e20, "its AdaGrad sum of squared gradients, column 2, would be inf"),
    (hps.Adam(lr=0.1), 1e30, "its Adam second moment, column 2, would be inf"),
], ids=["sgd", "adagrad", "adam"])
def test_a_step_that_would_leave_a_row_not_finite_is_refused_on_the_gpu_as_on_the_cpu(tmp_path, device, optimizer,
                                                                                     grad, said):
    """Key 5's gradient sum is finite, its step is not (SGD's lr * g, the squares of
    AdaGrad and Adam): the CUDA tables' step runs every step dry first and refuses it,
    naming the key and the value, before any row changes, as the CPU's does; key 7,
    which the table lacks, is not claimed. Then a GPU tier's batch."""
    table = hps.EmbeddingTable(1_000, 4, optimizer=optimizer, seed=3, device=device)
    keys = np.array([6, 5], np.uint64)
    before = table.pull(keys)
    grads = np.ones((2, 4), np.float32)
    grads[1, 2] = grad
    with pytest.raises(hps.DivergedError, match=rf"^apply_gradients: the step of 1 key would leave a value that is "
                                                rf"not finite in its row \(key 5 first: {said}\)"):
        table.push(keys, grads)
    np.testing.assert_array_equal(table.pull(keys), before)
    with pytest.raises(hps.DivergedError, match=r"\(key 7 first: "):
        table.push(np.array([7], np.uint64), grads[1:])
    assert len(table) == 2
    if device == "cpu":
        return
    ps = one_device_server(tmp_path / "ps", optimizer)
    before = ps.pull(keys)
    with pytest.raises(hps.DivergedError, match=rf"apply_summed_gradients: the step of 1 key would leave a value "
                                                rf"that is not finite in its row \(key 5 first: {said}\)"):
        ps.push(keys, grads)
    np.testing.assert_array_equal(ps.pull(keys), before)
    assert ps.stats()["mem"]["pinned"] == 0
    ps.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_push_that_fills_the_table_midway_steps_no_row_on_the_gpu_as_on_the_cpu(device):
    """The CUDA table's step claimed the slots of the keys it lacked in the kernel
    that stepped every key: where the table filled, some keys kept their step and
    the rest had none. Its check before the step (every key looked up, and every
    step run dry) counts the keys it lacks now and refuses the push before any row
    changes, as the CPU table's step does."""
    from test_optimizers import push_that_fills_the_table_midway
    push_that_fills_the_table_midway(device, 0, 5_997)


# ---- the GPUs' row mover and the CUDA executor (issues 15 and 17). A one-GPU
# machine stands for a node: several endpoints share GPU 0 (cuda_devices).

def _tier_run(tier, opt, steps):
    """Loads the keys, then per step: each worker gets its share, sends gradients that
    depend on the rows, and the tier applies them. Returns every row at the end, and
    the transfer matrix."""
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(1, 5_000, 3_000)).astype(np.uint64)
    tier.insert(keys, opt.initial_rows(keys), None, opt.row_floats)
    for _ in range(steps):
        for worker in range(tier.devices):
            mine = rng.choice(keys, 1_000)
            rows = tier.get(worker, mine, None, opt.dim)
            tier.accumulate(worker, mine, np.ascontiguousarray(np.sin(rows) + 0.1, np.float32), None, opt.dim)
        tier.apply()
    return tier.rows(keys, None, opt.row_floats), tier.transfers()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("topology", [None, "figure1.toml"])
def test_a_cuda_tier_of_several_devices_trains_as_host_partitions_do(topology):
    from pathlib import Path

    from hps import _core
    from hps import topology as T
    from hps.optim import native_optimizer
    opt = native_optimizer(8, hps.AdaGrad(lr=0.1), hps.Uniform(0.5), seed=3)
    devices = 4
    routes, gpus = None, [i % GPUS for i in range(devices)]
    if topology is not None:
        topo = T.load(Path(__file__).resolve().parent.parent / "examples" / "topologies" / topology)
        native_devices, links = topo._native()
        routes = _core.TierRoutes(native_devices, links, devices, 1 << 20, False)
        gpus = [i % GPUS for i in range(len(topo.endpoints))]  # middlemen too
    gpu = _core.DeviceTier(devices, 8192, opt, use_cuda=True, routes=routes, cuda_devices=gpus)
    assert gpu.kind == "cuda" and gpu.accepts_gpu_memory
    host = _core.DeviceTier(devices, 8192, opt, use_cuda=False)
    got, moved = _tier_run(gpu, opt, 3)
    want, host_moved = _tier_run(host, opt, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # atomics sum in another order
    np.testing.assert_array_equal(moved[0], host_moved[0])  # the same rows crossed between the same devices


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("schedule", ["host", "direct", "relay"])
def test_the_cuda_executor_delivers_what_the_host_executor_does(schedule):
    from pathlib import Path

    from hps import topology as T
    t = T.load(Path(__file__).resolve().parent.parent / "examples" / "topologies" / "figure1.toml")
    rng = np.random.default_rng(3)
    m = rng.integers(0, 3000, size=(8, 8)).astype(np.uint64)
    send = [rng.integers(0, 256, size=int(m[s].sum()), dtype=np.uint8) for s in range(8)]
    on_host = [np.zeros(int(m[:, d].sum()), np.uint8) for d in range(8)]
    on_gpu = [np.full(int(m[:, d].sum()), 0xAB, np.uint8) for d in range(8)]
    t.execute_on_host(m, schedule, send, on_host)
    stats = t.execute_on_cuda(m, schedule, send, on_gpu, gpus=[e % GPUS for e in range(8)])
    for d in range(8):
        np.testing.assert_array_equal(on_gpu[d], on_host[d])
    if schedule == "relay":
        assert stats["staged_bytes"] > 0


@pytest.mark.gpu
@needs_gpu
def test_a_batch_gathers_into_and_accumulates_from_a_cuda_tensor(tmp_path, cuda_torch):
    torch = cuda_torch
    by_gpu = one_device_server(tmp_path / "gpu", hps.AdaGrad(lr=0.1))
    by_host = one_device_server(tmp_path / "host", hps.AdaGrad(lr=0.1))
    keys = np.random.default_rng(0).integers(1, 300, (64, 3)).astype(np.uint64)
    for _ in range(2):
        g, h = by_gpu.batch(keys), by_host.batch(keys)
        assert by_gpu.stats()["device"]["kind"] == "cuda"
        pg, ph = g.positions(keys), h.positions(keys)
        rows = h.gather(ph)
        out = torch.empty(len(pg), 4, device="cuda:0")
        g.gather_tensor(pg, out)
        np.testing.assert_array_equal(out.cpu().numpy(), rows)
        grads = np.ascontiguousarray(np.cos(rows), np.float32)
        h.accumulate(ph, grads)
        g.accumulate_tensor(pg, torch.from_numpy(grads).to("cuda:0"))
        g.finish()
        h.finish()
    flat = np.unique(keys)
    np.testing.assert_allclose(by_gpu.pull(flat), by_host.pull(flat), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@needs_gpu
def test_a_batch_reads_gradients_a_side_stream_is_still_writing(tmp_path, cuda_torch):
    # The tier reads on the legacy default stream, which does not wait for a
    # torch.cuda.Stream: gradients queued behind a long kernel there were read
    # before they were written.
    torch = cuda_torch
    ps = one_device_server(tmp_path / "gpu", hps.SGD(lr=1.0))
    keys = np.arange(1, 257, dtype=np.uint64).reshape(-1, 1)
    before = ps.pull(keys.reshape(-1))
    side = torch.cuda.Stream(device="cuda:0")
    with ps.batch(keys) as batch, torch.cuda.stream(side):
        positions = batch.positions(keys)
        big = torch.randn(4096, 4096, device="cuda:0")
        grads = torch.zeros(len(positions), 4, device="cuda:0")
        for _ in range(20):  # keeps the side stream busy well past the read
            big = big @ big / 64
        grads += 1 + 0 * big[: len(positions), :4]
        batch.accumulate_tensor(positions, grads)
        del grads  # its memory goes back to the side stream's pool
        torch.zeros(len(positions), 4, device="cuda:0").fill_(7)  # and may be written again
    np.testing.assert_allclose(ps.pull(keys.reshape(-1)), before - 1.0, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices: a table on the second must leave the first current")
def test_a_table_on_another_gpu_leaves_the_callers_current_device(cuda_torch):
    torch = cuda_torch
    torch.cuda.set_device(0)
    table = hps.HashTable(1024, 4, device="cuda:1")  # the constructor allocates on GPU 1
    assert torch.cuda.current_device() == 0
    keys = np.arange(1, 65, dtype=np.uint64)
    table.insert(keys, np.ones((64, 4), np.float32))
    table.find(keys)
    assert torch.cuda.current_device() == 0
    assert torch.empty(1, device="cuda").device.index == 0


def _trained_run(tier, opt):
    """Herald's caches' calls on the trained bits: a load, steps and replica copies of
    bound positions, a load over trained rows, fetched bits, takes, a Clear. Returns
    what each read of the bits said."""
    rng = np.random.default_rng(11)
    keys = np.unique(rng.integers(1, 1 << 40, 3_000)).astype(np.uint64)
    keys = np.concatenate([keys, keys[:500]])  # 500 keys on a second device too (replicas)
    owners = rng.integers(0, tier.devices, len(keys)).astype(np.int32)
    owners[-500:] = (owners[:500] + 1) % tier.devices
    rows = opt.initial_rows(keys)
    said = []

    def read():
        said.append(tier.trained(keys, owners).tolist())

    def take():
        k, on = tier.take_trained()
        said.append(sorted(zip(k.tolist(), on.tolist())))

    tier.insert(keys, rows, owners, opt.row_floats)
    tier.bind(keys, owners)
    stepped = rng.choice(len(keys) - 500, 1_000, replace=False).astype(np.int64)
    tier.accumulate_at(0, stepped, np.ones((len(stepped), opt.dim), np.float32))
    tier.apply()
    read()
    tier.copy_rows_at(np.arange(500, dtype=np.int64), np.arange(len(keys) - 500, len(keys), dtype=np.int64))
    read()
    some = rng.choice(len(keys), 700, replace=False)
    tier.assign(keys[some], rows[some], owners[some], opt.row_floats)  # from MEM-PS: clean
    read()
    some = rng.choice(len(keys), 700, replace=False)
    tier.set_trained(keys[some], owners[some], True)
    tier.set_trained(np.array([1 << 50], np.uint64), np.zeros(1, np.int32), True)  # not held: no bit
    read()
    take()
    read()
    tier.set_trained(keys, owners, True)
    tier.set_trained(keys[some], owners[some], False)
    take()
    tier.set_trained(keys, owners, True)
    tier.clear()
    tier.insert(keys, rows, owners, opt.row_floats)
    take()
    return said


@pytest.mark.gpu
@needs_gpu
def test_a_cuda_tier_keeps_the_trained_bits_as_host_partitions_do():
    from hps import _core
    from hps.optim import native_optimizer
    opt = native_optimizer(4, hps.AdaGrad(lr=0.1), hps.Uniform(0.5), seed=5)
    devices = 3
    gpu = _core.DeviceTier(devices, 8192, opt, use_cuda=True, cuda_devices=[i % GPUS for i in range(devices)],
                           track_trained=True)
    assert gpu.kind == "cuda"
    host = _core.DeviceTier(devices, 8192, opt, use_cuda=False, track_trained=True)
    assert host.reads_in_place  # the bits of bound positions reached by slot; the GPU's by key
    got, want = _trained_run(gpu, opt), _trained_run(host, opt)
    assert got == want
    assert any(want[0]) and want[-1] == []  # (bits were set, and Clear took them all)
