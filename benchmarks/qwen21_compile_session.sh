#!/usr/bin/env bash
# Issue 22 on one GPU in one call (device calls are capped at 600 s): is the compiled 2.1 backward right with
# prepare_compile (RoPE as real pairs, attention without cuDNN: families/layers/attention_backends.py), and if so, the
# compiled variants beside the baseline in one process.
#   bash benchmarks/qwen21_compile_session.sh $OUT        (the wheels of ../shared/tools/device-wheels.sh in .whl/)
# Steps, each under `timeout` within one deadline (SESSION_S, default 570 s), so one hang leaves the rest:
#   1. LoRA gradients compiled vs eager after the baseline ran in the process (qwen21_compile_grad_check.py);
#   2. if they agree (relative error < 5e-2, finite): `imagerl bench --family qwen_image21`: the baseline and the
#      compiled variants (RESULTS.md run Z);
#   3. the GPU tests of the compiled 2.1 replay (tests/test_gpu.py, tests/test_compile21_gradients.py).
out=${1:?usage: $0 OUT}
source "$(dirname "$0")/device_session.sh"
timeout "$(left 150)" python3 benchmarks/qwen21_compile_grad_check.py --layers 2 --baseline-first --out "$out/pairs" \
    2>&1 | tail -n 20 | tee "$out/grad_pairs.log"
if python3 - "$out/pairs/grad_check.json" <<'PY'
import json, math, sys
rows = json.load(open(sys.argv[1]))
worst = max(r["relative_error"] for r in rows)
print(f"gate: worst gradient relative error {worst:.3e}")
sys.exit(0 if math.isfinite(worst) and worst < 5e-2 else 1)
PY
then
    timeout "$(left $((${BENCH_S:-390})))" python3 - "$out/bench" <<'PY' 2>&1 | grep -v "it/s\]$" | tee "$out/bench.log"
import sys
from imagerl.cli import main
c, b8m = "parallel.compile=true", "sample.batch_size=8,sample.merge_lora=true"
sys.exit(main(["bench", "--family", "qwen_image21", "--warmup", "1", "--iterations", "2", "--out", sys.argv[1],
               "--variant", f"imagerl compile:{c}",
               "--variant", f"imagerl compile b8 merged:{c},{b8m}",
               "--variant", f"imagerl compile b8 merged FP8:{c},{b8m},sample.off_window_fp8=true"]))
PY
    timeout "$(left 150)" python3 -m pytest -q -x tests/test_compile21_gradients.py \
        "tests/test_gpu.py::test_compiled_qwen_image21_training_is_on_policy" 2>&1 | tail -n 15 | tee "$out/pytest.log"
else
    echo "gate failed: no bench"
fi
echo "session used $SECONDS s"
