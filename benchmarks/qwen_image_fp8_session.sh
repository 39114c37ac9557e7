#!/usr/bin/env bash
# Issue 23 in one device call: the qwen_image recipe with its off-window steps in FP8 (sample.off_window_fp8) beside
# the recipe and the baseline in one process, then the FP8 GPU tests. Extra variants ("name:overrides") after OUT.
#   bash benchmarks/qwen_image_fp8_session.sh $OUT        (the wheels of ../shared/tools/device-wheels.sh in .whl/)
out=${1:?usage: $0 OUT [name:overrides ...]}
shift
PYTEST_K=${PYTEST_K:-fp8} exec bash "$(dirname "$0")/bench_session.sh" qwen_image "$out" "imagerl (recipe):" \
    "imagerl (recipe), off-window steps in FP8:sample.off_window_fp8=true" "$@"
