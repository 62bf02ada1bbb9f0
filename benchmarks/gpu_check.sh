#!/usr/bin/env bash
# Everything the GPU must prove, as one run inside a time budget (GPU_CHECK_BUDGET_S, default 450 s; each step gets
# at most its cap and what is left, so a slow or hung step costs only its share):
#   1. the kernel tests compiled for the device (not interpreted) and the CUDA-graph tests;
#   2. benchmarks/engine_throughput.py: the engine's tok/s on the peer workload (256 requests, prompts 16-512,
#      outputs 16-256, greedy, ignore_eos) on a random-weight model shaped like SmolLM2-135M (real weights are
#      too large to travel to the device machine), with CUDA graphs;
#   3. benchmarks/hybrid_sla.py --device cuda: realtime TTFT/ITL with a full offline load, on that model (the GPU
#      step-policy figures);
#   4. the same engine_throughput with --enforce-eager (each run prints its decode-graph replays);
#   5. benchmarks/decode_graphs.py: decode-step time, CUDA graphs vs eager;
#   6. benchmarks/kernel_bench.py: decode-attention bandwidth vs SDPA;
#   7. benchmarks/tensor_parallel.py --device cuda: TP=2 against TP=1 over NCCL (only with two or more GPUs);
#   8. benchmarks/hybrid_http.py: `tidepool serve` on the GPU host over HTTP (skipped with under 150 s left).
# Uses the machine's python3 (torch, triton, transformers, pytest, hypothesis) with this tree on PYTHONPATH; the
# service's own packages (Flask, SQLAlchemy, Celery...) are not on that image: benchmarks/gpu_wheels.sh fetches
# them into .whl/ here, and the device call carries it (`carry: [".whl"]`); without .whl steps 3 and 7 fail.
# Logs go to $OUT (the device tool's folder, at most 8 files) or test-artifacts/gpu.
#
#     bash benchmarks/gpu_check.sh [STEP ...]       # steps by name: tests graphs hybrid_sla eager decode kernels tp http
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-test-artifacts/gpu}"
mkdir -p "$out"
budget="${GPU_CHECK_BUDGET_S:-450}"
steps="${*:-tests graphs hybrid_sla eager decode kernels tp http}"
status=0

left() { echo $((budget - SECONDS)); }
# step NAME CAP LOG CMD...: runs CMD with at most CAP seconds (and never past the budget), its output teed to LOG.
step() {
    local name=$1 cap=$2 log=$3; shift 3
    [[ " $steps " == *" $name "* ]] || return 0
    local t; t=$(left); ((t > cap)) && t=$cap
    if ((t < 20)); then echo "== $name: skipped, budget spent" | tee -a "$out/$log"; status=1; return; fi
    echo "== $name (at ${SECONDS}s, timeout ${t}s)" | tee -a "$out/$log"
    timeout "$t" "$@" 2>&1 | tee -a "$out/$log"
    local rc=${PIPESTATUS[0]}
    ((rc == 0)) || { echo "== $name: exit $rc" | tee -a "$out/$log"; status=1; }
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch", torch.__version__,
              "| triton", triton.__version__, "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name())'
  nproc; } 2>&1 | tee "$out/device.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -2 | tee -a "$out/device.txt" && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

model="$(mktemp -d)/smollm2-shaped"
python3 - "$model" <<'EOF' 2>&1 | tee -a "$out/device.txt" || status=1
import sys
from tidepool.workers.tools.tiny_model import make_tiny_model
make_tiny_model(sys.argv[1], hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, vocab_size=49152)
print("model", sys.argv[1])
EOF

step tests 200 tests.log python3 -m pytest -q -p no:cacheprovider -n 4 -o addopts="--import-mode=importlib" \
    tests/kernels/test_triton_kernels.py tests/kernels/test_triton_compile.py tests/kernels/test_decode_graph_buffers.py \
    tests/kernels/test_lora_sgmv.py tests/engine/test_decode_graphs.py

step graphs 90 engine_throughput.txt python3 benchmarks/engine_throughput.py --model "$model" --device cuda \
    --num-requests 256 --no-baselines

# online latency under full offline load (ratios and the JSON line at the end).
step hybrid_sla 150 hybrid_sla.txt python3 benchmarks/hybrid_sla.py --model "$model" --device cuda --offline 256 \
    --rt-rate 8 --no-fcfs

step eager 60 engine_throughput.txt python3 benchmarks/engine_throughput.py --model "$model" --device cuda \
    --num-requests 256 --no-baselines --enforce-eager

step decode 40 decode_graphs.txt python3 benchmarks/decode_graphs.py --model "$model" --batches 1,8,32,128,256 \
    --context 512

step kernels 50 kernels.txt python3 benchmarks/kernel_bench.py --iters 20 --batches 1,32,256 \
    --contexts 512,4096,32768

# tensor parallelism over NCCL (two ranks on GPUs 0 and 1): parity, throughput, per-rank weights; needs 2+ GPUs.
if (($(nvidia-smi -L 2>/dev/null | wc -l) >= 2)); then
    step tp 120 tensor_parallel.txt python3 benchmarks/tensor_parallel.py --model "$model" --device cuda \
        --num-requests 128 --max-num-seqs 128
else
    [[ " $steps " == *" tp "* ]] && echo "== tp: skipped, one GPU" | tee -a "$out/tensor_parallel.txt"
fi

if (($(left) >= 150)) || [[ "${steps}" == "http" ]]; then
    step http 240 hybrid_http.txt python3 benchmarks/hybrid_http.py --model "$model" --rt-duration 30 \
        --env "PYTHONPATH=$PYTHONPATH"
fi
echo "== done at ${SECONDS}s, status $status"
exit $status
