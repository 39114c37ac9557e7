#!/usr/bin/env bash
# One device call for issue 56 (FLUX.1's rollout): versions, `imagerl bench --family flux` with the profiles and
# variants given (the batch-4 DanceGRPO-style baseline first, in the same process), then the cuDNN attention backward
# reproduction (benchmarks/cudnn_sdpa_repro.py) with the time left.
#   PROFILES=("o,o" ...) VARIANTS=("name:o,o" ...) source benchmarks/flux_session.sh OUT
# SESSION_S (default 570): the whole call; BENCH_S (default 430): the bench; ITERATIONS (default 1) measured
# iterations after one warm-up; REPRO_S (default 90): the reproduction (skipped with REPRO_S=0). DRY=1: the same
# bench on this machine's CPU (--dry-run: 1-layer models), no GPU, no reproduction: checks the command.
out=${1:?usage: source $0 OUT}
if [ -n "${DRY:-}" ]; then
    args=(--dry-run); for p in "${PROFILES[@]}"; do args+=(--profile "$p"); done
    for v in "${VARIANTS[@]}"; do args+=(--variant "$v"); done
    python3 -m imagerl bench --family flux --warmup 0 --iterations 1 --baseline-batch-size 4 --out "$out/bench" \
        "${args[@]}" 2>&1 | grep -v "it/s\]$" | grep -v "^  *[0-9.]*%" | tail -n 40
    return 0 2>/dev/null || exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/device_session.sh"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
torch.backends.cudnn.version(), 'diffusers', diffusers.__version__)" | tee "$out/versions.txt"
args=()
for p in "${PROFILES[@]}"; do args+=(--profile "$p"); done
for v in "${VARIANTS[@]}"; do args+=(--variant "$v"); done
PYTHONUNBUFFERED=1 timeout "$(left ${BENCH_S:-430})" python3 -m imagerl bench --family flux --warmup 1 \
    --iterations "${ITERATIONS:-1}" --baseline-batch-size 4 --out "$out/bench" "${args[@]}" 2>&1 \
    | grep -v "it/s\]$" | tee "$out/bench.log"
if [ "${REPRO_S:-90}" -gt 0 ]; then
    timeout "$(left ${REPRO_S:-90})" python3 benchmarks/cudnn_sdpa_repro.py --out "$out" \
        --timeout "$(( $(left ${REPRO_S:-90}) - 5 ))" 2>&1 | tee "$out/cudnn_repro.log"
fi
echo "session used $SECONDS s"
