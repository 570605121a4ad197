#!/usr/bin/env bash
# One bench module on a lent GPU machine that reaches no registry (../shared/gpu/README.md), from the project root.
# Pack the kit here first (`bash deploy/scripts/gpu-kit.sh`: .gpu/p0, p1, ... with setup.sh in the last part), copy
# every part but the last to /tmp/kit in calls of their own (`mkdir -p /tmp/kit && cp .gpu/pI/* /tmp/kit/`), then,
# in the call that carries the last part and services/proto_gen (the checkout is the project there):
#   BENCH=accelerator_step BENCH_S=420 bash deploy/scripts/gpu-bench.sh --device cuda --dtype bfloat16
# BENCH names a module of services/bench (default accelerator_step), BENCH_S its time limit in seconds (default
# 420); the other arguments are the module's. The kit is installed once: on a machine still warm from an earlier call
# (/tmp/site there) the parts need not be carried again. The bench's output is also written to $OUT/bench.log.
# CUDA-only tests, after it: PYTHONPATH=/tmp/site python3 -m pytest -p no:cacheprovider -o addopts=-ra -k cuda
#   tests/unit/test_captured_verify.py tests/unit/test_step_graphs.py tests/unit/test_host_copies.py
#   tests/unit/test_eagle_head_graphs.py tests/unit/test_accelerator_kernels.py
# What the drafter link adds to an EAGLE ask there: BENCH=drafter_link BENCH_S=240 bash deploy/scripts/gpu-bench.sh
#   --method eagle3 --device cuda --dtype bfloat16 --rows 1 8 --contexts 300
# What the verifier's per-request output streams cost on that host's CPU (a simulated device step, no GPU used):
#   BENCH=verifier_stream_cost BENCH_S=120 bash deploy/scripts/gpu-bench.sh --rows 8 64
# ... and what the gateway adds on top, CPU per 1,000 tokens included (whole, then streamed completions):
#   BENCH=http_host_cost BENCH_S=150 bash deploy/scripts/gpu-bench.sh; the same with --stream
# The HTTP rows, the whole stack through the OpenAI API under a steady load (each client sends 3 requests):
#   BENCH=accelerator_http BENCH_S=420 bash deploy/scripts/gpu-bench.sh --device cuda --dtype bfloat16
#   --modes captured --rounds 3
set -uo pipefail
if [ ! -d /tmp/site/transformers ]; then
    setup=$(ls .gpu/p*/setup.sh 2>/dev/null | sort -V | tail -1)
    [ -n "$setup" ] || { echo "no /tmp/site and no .gpu/p*/setup.sh: carry the kit's last part" >&2; exit 2; }
    bash "$setup" || exit 2
fi
export PYTHONPATH=/tmp/site SPECSERVE_CACHE_DIR=/tmp/cache  # the kit's wheels; the project is this checkout
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
timeout "${BENCH_S:-420}" python3 -m "services.bench.${BENCH:-accelerator_step}" "$@" 2>&1 | tee "${OUT:-/tmp}/bench.log"
exit "${PIPESTATUS[0]}"
