#!/usr/bin/env bash
# The GPU checks in one command, for a machine with an NVIDIA GPU:
#   1. builds hps._core with the CUDA launchers (sm_80 and sm_90 unless CMAKE_CUDA_ARCHITECTURES
#      is set) into build-gpu/, outside any installed copy;
#   2. checks that the build sees the GPU (hps.cuda_compiled(), hps.cuda_device_count());
#   3. runs the GPU tests: tests/test_gpu.py (table ops and optimizers on the GPU against the
#      CPU launcher) and tests/test_device_tier.py (the device tier, which takes the GPUs
#      whenever the node has as many as it asks for);
#   4. runs the device-tier hash table benchmark on the GPU beside the CPU launcher
#      (bench/gpu_table_bench.py: Mops/s, and bytes moved as a fraction of the GPU's memory
#      bandwidth limit);
#   5. trains on the GPU: tests/test_model_devices.py (hps train with model_devices = "cuda"
#      equal to the CPU run to float tolerance), then W4 with every MLP on GPU 0 against plain
#      PyTorch with nn.EmbeddingBag on the same GPU (bench/train_bench.py --model-device cuda;
#      --quick: 300k examples).
# Not covered yet (issue 15): the embeddings still reach the GPU through host memory (the
# device tier gathers to the host, the MLP's input is copied over once a batch).
#
#   bash bench/gpu_check.sh            # full: the benchmark at 10M keys, rows of 16 and 64 floats
#   bash bench/gpu_check.sh --quick    # the benchmark at 200k keys
#
# Without a GPU it says so and exits 0. Python packages the build and tests need (pybind11,
# numpy, pytest) must be importable by python3 ($PYTHON); where the machine cannot fetch them,
# put their wheels in a folder named by $HPS_WHEELS and they are installed from there.
# Results go to stdout, and to $OUT/gpu_check/ when $OUT is set (the device tool's folder).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
quick=()
if [ "${1:-}" = "--quick" ]; then quick=(--quick); fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! gpus="$(nvidia-smi -L 2>&1)" || [ -z "$gpus" ]; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi missing or it lists none); nothing to check"
  exit 0
fi
echo "gpu_check: $gpus"
results="${OUT:+$OUT/gpu_check}"
results="${results:-$root/bench/results/gpu_check}"
mkdir -p "$results"

# ---- Python packages: present, or installed from $HPS_WHEELS ----
missing=()
for mod in pybind11 numpy pytest; do
  "$py" -c "import $mod" >/dev/null 2>&1 || missing+=("$mod")
done
if ((${#missing[@]})); then
  if [ -n "${HPS_WHEELS:-}" ]; then
    "$py" -m pip install --no-index --find-links "$HPS_WHEELS" "${missing[@]}"
  else
    echo "gpu_check: $py cannot import ${missing[*]}; install them, or set HPS_WHEELS to a folder of their wheels" >&2
    exit 1
  fi
fi

# ---- 1. build with CUDA ----
build="$root/${HPS_GPU_BUILD:-build-gpu}"
arch=()
if [ -n "${CMAKE_CUDA_ARCHITECTURES:-}" ]; then arch=(-DCMAKE_CUDA_ARCHITECTURES="$CMAKE_CUDA_ARCHITECTURES"); fi
gen=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DHPS_CUDA=ON -DHPS_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$(command -v "$py")" -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" "${arch[@]}" \
  | tee "$results/configure.log"
cmake --build "$build" --target _core -j "$(nproc)" 2>&1 | tail -5
site="$build/site/hps"
rm -rf "$build/site"
mkdir -p "$site"
for f in "$root"/python/hps/*; do ln -s "$f" "$site/"; done
cp "$build"/_core*.so "$site/"
export PYTHONPATH="$build/site"

# ---- 2. the build sees the GPU ----
"$py" - <<'EOF'
import hps
if not hps.cuda_compiled():
    raise SystemExit("gpu_check: hps was built without the CUDA launchers")
n = hps.cuda_device_count()
if n == 0:
    raise SystemExit("gpu_check: nvidia-smi lists a GPU, but hps.cuda_device_count() is 0 (driver too old for the runtime?)")
print(f"gpu_check: hps {hps.__version__} sees {n} CUDA device(s)")
EOF

# ---- 3. GPU tests ----
status=0
"$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_device_tier.py \
  --junitxml="$results/gpu_tests.xml" || status=$?

# ---- 4. the table benchmark on the GPU ----
"$py" bench/gpu_table_bench.py "${quick[@]}" --out "$results/gpu_table.json" || status=$?

# ---- 5. training on the GPU ----
"$py" -m pytest -q -p no:cacheprovider tests/test_model_devices.py --junitxml="$results/gpu_training_tests.xml" \
  || status=$?
"$py" bench/train_bench.py "${quick[@]}" --model-device cuda --rounds 2 >"$results/w4_gpu.json" || status=$?

echo "gpu_check: results in $results; exit status $status"
exit "$status"
