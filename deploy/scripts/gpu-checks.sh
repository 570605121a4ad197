#!/usr/bin/env bash
# Issue 29's device checks in one call, within one time budget. A lent GPU machine goes back after a short idle
# spell (../shared/gpu/README.md, the device tool's idle_release_s), so checks run as separate calls risk a fresh
# start (minutes of a 15-minute budget) between two of them. Run from the project root in the call that carries
# the kit's last part and services/proto_gen, once the other parts are in /tmp/kit (gpu-bench.sh says how):
#   CHECKS_S=540 bash deploy/scripts/gpu-checks.sh
# The checks, in this order, each under its own limit and all within CHECKS_S (default 540 s); a check that runs
# out of its limit is stopped and the next one starts. Each writes $OUT/<name>.log, and a summary ends the output:
#   tests  the CUDA-only tests (captured verify, step graphs, host copies, EAGLE head graphs, kernels, launches)
#   step   accelerator_step: captured steps, decode step and launches, none/ngram-or-suffix/EAGLE-3 (chains and
#          trees) at 1, 8, 64 chats under a steady load (3 requests a client), and the code edit (STEP_ARGS replaces
#          its arguments after --device and --dtype)
#   ngram  accelerator_step with the ngram drafter (issue 29's ngram target; `step` drafts with serve's default,
#          suffix where it installs), no EAGLE rows; each request asks for its own length (--lengths varied)
#   lockstep  the same with every request of one length (--lengths equal), as every run before stop 75 was: a
#          load without speculation then runs in lockstep (services/bench/request_lengths.py), and the difference
#          from `ngram` says how much of the 8 and 64 chats rows' losses that was
#   prediction  predicted_outputs: OpenAI's predicted outputs on the code edits, in float32, where every output
#          must equal the output without speculation (exit 1 if one differs; bf16 reduces a verify in another order)
#   http   accelerator_http: the same stack through the OpenAI HTTP API, steady load
#   link   drafter_link: what the gRPC link adds to an EAGLE-3 ask
# CHECKS names a subset or another order (e.g. CHECKS="step http"); DEVICE (default cuda) and DTYPE (bfloat16)
# are passed on, so `DEVICE=cpu DTYPE=float32 CHECKS_S=120` is a dry run of the sequencing on a CPU machine that
# has the kit's site-packages at /tmp/site.
set -uo pipefail
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
out=${OUT:-/tmp}
budget=${CHECKS_S:-540}
started=$(date +%s)
summary=()

limit_of() {  # each check's own limit in seconds
    case "$1" in
        tests) echo 90 ;; step) echo 300 ;; ngram) echo 120 ;; lockstep) echo 120 ;; prediction) echo 120 ;;
        http) echo 240 ;;
        link) echo 120 ;; *) echo 0 ;;
    esac
}

command_of() {
    case "$1" in
        tests) echo "PYTHONPATH=/tmp/site python3 -m pytest -q -p no:cacheprovider -o addopts=-ra \
tests/unit/test_eagle_head_graphs.py tests/unit/test_captured_verify.py tests/unit/test_captured_tree_verify.py \
tests/unit/test_step_graphs.py tests/unit/test_hidden_states.py \
tests/unit/test_host_copies.py tests/unit/test_accelerator_kernels.py tests/unit/test_step_launch.py \
-k 'cuda or launch'" ;;
        step) echo "BENCH=accelerator_step bash deploy/scripts/gpu-bench.sh --device $device --dtype $dtype \
${STEP_ARGS:---modes captured --rounds 3 --eagle eagle3 eagle3-tree}" ;;
        ngram) echo "BENCH=accelerator_step bash deploy/scripts/gpu-bench.sh --device $device --dtype $dtype \
--modes captured --rounds 3 --method ngram --no-eagle" ;;
        lockstep) echo "BENCH=accelerator_step bash deploy/scripts/gpu-bench.sh --device $device --dtype $dtype \
--modes captured --rounds 3 --method ngram --no-eagle --lengths equal" ;;
        prediction) echo "BENCH=predicted_outputs bash deploy/scripts/gpu-bench.sh --device $device --dtype float32" ;;
        http) echo "BENCH=accelerator_http bash deploy/scripts/gpu-bench.sh --device $device --dtype $dtype \
--modes captured --rounds 3" ;;
        link) echo "BENCH=drafter_link bash deploy/scripts/gpu-bench.sh --method eagle3 --device $device \
--dtype $dtype --rows 1 8 --contexts 300" ;;
    esac
}

# The kit is installed once, before the first check's clock starts (gpu-bench.sh would otherwise do it inside one).
if [ ! -d /tmp/site/transformers ]; then
    setup=$(ls .gpu/p*/setup.sh 2>/dev/null | sort -V | tail -1)
    [ -n "$setup" ] || { echo "no /tmp/site and no .gpu/p*/setup.sh: carry the kit's last part" >&2; exit 2; }
    bash "$setup" || exit 2
fi
for name in ${CHECKS:-tests step ngram lockstep prediction http link}; do
    limit=$(limit_of "$name")
    [ "$limit" -gt 0 ] || { summary+=("$name: unknown check"); continue; }
    left=$(( budget - ($(date +%s) - started) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then summary+=("$name: not run (${left} s of the budget left)"); continue; fi
    echo "=== $name (at most $limit s): $(command_of "$name")"
    check_started=$(date +%s)
    BENCH_S=$limit OUT=$out timeout "$((limit + 10))" bash -c "$(command_of "$name")" > "$out/$name.log" 2>&1
    code=$?
    tail -40 "$out/$name.log"
    summary+=("$name: exit $code after $(( $(date +%s) - check_started )) s$([ "$code" -eq 124 ] && echo ' (out of time)')")
done
echo "=== summary ($(( $(date +%s) - started )) s of $budget)"
printf '%s\n' "${summary[@]}"
