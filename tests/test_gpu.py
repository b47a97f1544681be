"""The CUDA launcher against the CPU launcher. Skipped without a GPU."""
import numpy as np
import pytest

import hps

GPUS = hps.cuda_device_count()
needs_gpu = pytest.mark.skipif(
    GPUS == 0, reason="no usable CUDA device (no GPU, or the driver is missing or too old)")


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
