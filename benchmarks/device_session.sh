# Sourced by the one-call GPU session scripts (benchmarks/bench_session.sh, flux_session.sh) after they set
# `out`: one deadline for the whole call (SESSION_S, default 570 s; device calls are capped at 600 s), `left N`
# (the seconds a step may take: N or what is left, never 0, which `timeout` reads as none), the wheels of
# ../shared/tools/device-wheels.sh from .whl/ on PYTHONPATH, and the GPU's name in $out/gpu.txt.
deadline=$((SECONDS + ${SESSION_S:-570}))
left() { local s=$((deadline - SECONDS)); [ "$s" -lt 1 ] && s=1; [ "$s" -lt "$1" ] && echo "$s" || echo "$1"; }
mkdir -p "$out"
# (skipped where the command installed them already)
[ -d /tmp/site/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
