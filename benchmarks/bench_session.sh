#!/usr/bin/env bash
# One device call (capped at 600 s): `imagerl bench` for FAMILY with the given variants beside its baseline in one
# process, then, when PYTEST_K is set, the GPU tests it selects (tests/test_gpu.py -k "$PYTEST_K").
#   bash benchmarks/bench_session.sh FAMILY OUT ["name:override,override" ...]   (no variants: the family's defaults)
# The wheels of ../shared/tools/device-wheels.sh in .whl/; one deadline (SESSION_S, default 570 s), the bench under
# BENCH_S (default 460 s), variants measured in the order given (a cut-short run keeps the rows it finished).
family=${1:?usage: $0 FAMILY OUT [name:overrides ...]}
out=${2:?usage: $0 FAMILY OUT [name:overrides ...]}
shift 2
source "$(dirname "$0")/device_session.sh"
variants=()
for v in "$@"; do variants+=(--variant "$v"); done
timeout "$(left ${BENCH_S:-460})" python3 -m imagerl bench --family "$family" --warmup 1 --iterations 2 \
    --out "$out/bench" "${variants[@]}" 2>&1 | grep -v "it/s\]$" | tee "$out/bench.log"
if [ -n "${PYTEST_K:-}" ]; then
    timeout "$(left 150)" python3 -m pytest -q tests/test_gpu.py -k "$PYTEST_K" 2>&1 | tail -n 15 | tee "$out/pytest.log"
fi
echo "session used $SECONDS s"
