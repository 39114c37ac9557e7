#!/usr/bin/env bash
# Issue 23 on one GPU in one call (device calls are capped at 600 s): the qwen_image recipe with its off-window
# steps in FP8 (sample.off_window_fp8) beside the recipe and the baseline in one process, then the FP8 GPU tests.
#   bash benchmarks/qwen_image_fp8_session.sh $OUT        (the wheels of ../shared/tools/device-wheels.sh in .whl/)
# Each step under `timeout` within one deadline (SESSION_S, default 570 s). Extra bench variants: "name:overrides"
# arguments after OUT.
out=${1:?usage: $0 OUT [name:overrides ...]}
shift
source "$(dirname "$0")/device_session.sh"
variants=(--variant "imagerl (recipe):" --variant "imagerl (recipe), off-window steps in FP8:sample.off_window_fp8=true")
for v in "$@"; do variants+=(--variant "$v"); done
timeout "$(left ${BENCH_S:-460})" python3 -m imagerl bench --family qwen_image --warmup 1 --iterations 2 \
    --out "$out/bench" "${variants[@]}" 2>&1 | grep -v "it/s\]$" | tee "$out/bench.log"
timeout "$(left 150)" python3 -m pytest -q tests/test_gpu.py -k "fp8" 2>&1 | tail -n 15 | tee "$out/pytest.log"
echo "session used $SECONDS s"
