#!/usr/bin/env bash
# The first hour on a GPU, in one command: build random-weight models at real shapes (nothing is downloaded), run
# the CUDA-marked tests and the step microbenchmarks (a demo-draft step eager vs CUDA-graph replay, microbench
# draft-step's body/head split, microbench eagle-step at every EAGLE shape, microbench kernels, every vLLM strategy's
# batched head at 1, 4 and 8 rows eager vs CUDA-graph replay, EAGLE-2 tree cycles beside the chain), and write one JSON,
# all inside 10 minutes. `--device cpu` runs the same sections at small shapes (CI does, so it cannot rot); its
# JSON names what the CUDA run would time (`would_time_on_cuda`). The code is dynvocab/bench/micro/gpu_check.py.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/gpu_check.sh [--device cuda|cpu] [--out FILE] [--quick|--full] [--budget-s SECONDS]

  --device cuda|cpu   where to run (default cuda; fails with status 2 when torch sees no CUDA device)
  --out FILE          the JSON report (default gpu_check.json in the current folder)
  --quick | --full    small shapes and few repeats, or real shapes (default: --full on cuda, --quick on cpu)
  --budget-s SECONDS  the whole run's time (default 570; more stretches each section's limit alike)
  -h, --help          this text

Environment: PYTHON, the interpreter with dynvocab installed (default: python, else python3).
Exit status: 0 when every section passed, 1 when one failed or timed out (the JSON says which), 2 for bad usage.
USAGE
}

device=cuda
out=gpu_check.json
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=${2:?--device needs cuda or cpu}; shift 2 ;;
        --device=*) device=${1#*=}; shift ;;
        --out) out=${2:?--out needs a file}; shift 2 ;;
        --out=*) out=${1#*=}; shift ;;
        --quick | --full) extra+=("$1"); shift ;;
        --budget-s) extra+=(--budget-s "${2:?--budget-s needs seconds}"); shift 2 ;;
        --budget-s=*) extra+=(--budget-s "${1#*=}"); shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$device" in
    cuda | cpu) ;;
    *) echo "gpu_check: --device must be cuda or cpu, not '$device'" >&2; exit 2 ;;
esac
case "$out" in
    /*) ;;
    *) out="$PWD/$out" ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$(command -v python || command -v python3 || true)}
if [ -z "$python" ]; then
    echo "gpu_check: no python found; set PYTHON" >&2
    exit 2
fi
cd "$root"
if ! "$python" -c "import torch, transformers, dynvocab" 2>/dev/null; then
    echo "gpu_check: $python cannot import torch, transformers and dynvocab; pip install -e '.[test]' first" >&2
    exit 2
fi
exec "$python" -m dynvocab.bench.micro.gpu_check --device "$device" --out "$out" --root "$root" ${extra[@]+"${extra[@]}"}
