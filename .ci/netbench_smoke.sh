#!/usr/bin/env bash
# CI: the emulated-cluster benchmark's smoke preset (2 hosts, 1 Gbit, a few steps, < 2 min).
# It needs root and iproute2 (network namespaces, tc); without them it says why and skips.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "netbench smoke: skipped: needs root (network namespaces and tc)"
    exit 0
fi
for tool in ip tc; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "netbench smoke: skipped: needs iproute2 ($tool not found)"
        exit 0
    fi
done
out="${NETBENCH_OUT:-results/netbench-smoke}"
.venv/bin/python -m benchmarks.netbench --preset smoke --out "$out"
leftover=$(ip netns list | grep -c '^gnb' || true)
if [ "$leftover" -ne 0 ]; then
    echo "netbench smoke: $leftover namespaces left behind" >&2
    exit 1
fi
echo "netbench smoke: ok ($out/results.md)"
