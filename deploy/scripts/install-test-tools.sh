#!/bin/sh
# Tools `make test` needs besides Python packages: a real Prometheus server, Debian's `prometheus` package, for
# tests/e2e/test_prometheus_metrics.py (it scrapes the running stack and runs every dashboard query).
#
# Usage: deploy/scripts/install-test-tools.sh [BIN_DIR]   (default .venv/bin)
#
# Nothing happens when a prometheus binary is already on PATH or in BIN_DIR. Otherwise the package is
# downloaded with `apt-get download` and only its binary is unpacked into BIN_DIR: no root needed, and no
# system service is installed or started (`apt-get install prometheus` would start one on port 9090).
set -eu

BIN_DIR=${1:-.venv/bin}

if command -v prometheus >/dev/null 2>&1 || [ -x "$BIN_DIR/prometheus" ]; then
    exit 0
fi

fail() {
    echo "install-test-tools: $1" >&2
    echo "install-test-tools: install Prometheus >= 2.33 yourself (Debian/Ubuntu: 'sudo apt-get install" \
         "prometheus'; elsewhere: https://prometheus.io/download/) and put 'prometheus' on PATH or in $BIN_DIR" >&2
    exit 1
}

command -v apt-get >/dev/null 2>&1 || fail "no prometheus binary and no apt-get to fetch Debian's package"
command -v dpkg-deb >/dev/null 2>&1 || fail "no prometheus binary and no dpkg-deb to unpack Debian's package"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! (cd "$work" && apt-get download prometheus >/dev/null 2>&1); then
    # The package lists may be missing (a fresh container): refresh them where we may.
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null 2>&1 || fail "'apt-get update' failed (no network or no Debian mirror?)"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo -n apt-get update -qq >/dev/null 2>&1 || fail "'sudo apt-get update' failed"
    else
        fail "'apt-get download prometheus' failed and refreshing the package lists needs root"
    fi
    (cd "$work" && apt-get download prometheus >/dev/null 2>&1) \
        || fail "'apt-get download prometheus' failed (is the package in this distribution's sources?)"
fi

dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
mkdir -p "$BIN_DIR"
cp "$work/root/usr/bin/prometheus" "$BIN_DIR/prometheus"
"$BIN_DIR/prometheus" --version >/dev/null 2>&1 || fail "the unpacked $BIN_DIR/prometheus does not run"
echo "install-test-tools: Debian's prometheus unpacked into $BIN_DIR"
