#!/usr/bin/env bash
# Everything issue #6 wants checked on a GPU, as one run (about 5 minutes on an H200):
#   1. the kernel tests compiled for the device (not interpreted) and the CUDA-graph tests;
#   2. benchmarks/kernel_bench.py: decode-attention bandwidth vs SDPA, batch 1..256 x context 512..32k;
#   3. benchmarks/decode_graphs.py: decode-step time, CUDA graphs vs eager, on a random-weight model shaped
#      like SmolLM2-135M (real weights are too large to travel to the device machine);
#   4. benchmarks/engine_throughput.py: the engine's tok/s on the peer workload (256 requests, prompts 16-512,
#      outputs 16-256, greedy, ignore_eos) on that model, with CUDA graphs and with TIDEPOOL_ENFORCE_EAGER=1;
#   5. benchmarks/hybrid_sla.py --device cuda: realtime TTFT/ITL with a full offline load, on that model.
# Uses the machine's python3 (torch, triton, transformers, pytest, hypothesis) with this tree on PYTHONPATH.
# Logs go to $OUT (the device tool's folder) or test-artifacts/gpu.
#
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-test-artifacts/gpu}"
mkdir -p "$out"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "| triton", triton.__version__)' | tee -a "$out/device.txt"

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_decode_graphs.py \
    2>&1 | tee "$out/tests.log" || status=1

timeout 240 python3 benchmarks/kernel_bench.py --iters 20 2>&1 | tee "$out/kernels.txt" || status=1

model="$(mktemp -d)/smollm2-shaped"
python3 - "$model" <<'EOF' || status=1
import sys
from workers.tools.tiny_model import make_tiny_model
make_tiny_model(sys.argv[1], hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, vocab_size=49152)
EOF
timeout 120 python3 benchmarks/decode_graphs.py --model "$model" --batches 1,8,32,128,256 --context 512 \
    2>&1 | tee "$out/decode_graphs.txt" || status=1

for eager in 0 1; do
    TIDEPOOL_ENFORCE_EAGER=$eager timeout 300 python3 benchmarks/engine_throughput.py --model "$model" --device cuda \
        --num-requests 256 --no-baselines 2>&1 | sed "s/^/enforce_eager=$eager  /" | tee -a "$out/engine_throughput.txt" \
        || status=1
done

# issue #10: online latency under full offline load (ratios and the JSON line at the end).
timeout 600 python3 benchmarks/hybrid_sla.py --model "$model" --device cuda --offline 256 --rt-rate 8 \
    2>&1 | tee "$out/hybrid_sla.txt" || status=1

exit $status
