#!/usr/bin/env bash
# Issue 22: where does the compiled 2.1 model fault after another model ran in the process? One device call.
#   bash benchmarks/qwen21_crash_locate.sh $OUT        (the wheels of ../shared/tools/device-wheels.sh in .whl/)
#   1. the gradient check alone in its process (no baseline first): are the compiled gradients right there?
#   2. after the baseline, every kernel launched synchronously (CUDA_LAUNCH_BLOCKING=1): the faulting kernel's
#      traceback, and the generated Inductor code (*.py of the cache) in OUT/inductor_py.tgz.
out=${1:?usage: $0 OUT}
source "$(dirname "$0")/device_session.sh"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout "$(left 170)" python3 benchmarks/qwen21_compile_grad_check.py --layers 2 --out /tmp/alone 2>&1 \
    | grep -v "it/s\]$" | tail -n 12 | tee "$out/alone.log"
cp /tmp/alone/grad_check.json "$out/alone.json" 2>/dev/null
CUDA_LAUNCH_BLOCKING=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor timeout "$(left 330)" \
    python3 benchmarks/qwen21_compile_grad_check.py --layers 2 --baseline-first --out /tmp/blocking 2>&1 \
    | grep -v "it/s\]$" | tail -n 80 | tee "$out/blocking.log"
cp /tmp/blocking/grad_check.json "$out/blocking.json" 2>/dev/null
(cd /tmp/inductor && find . -name '*.py' | tar czf "$out/inductor_py.tgz" -T -)
echo "session used $SECONDS s"
