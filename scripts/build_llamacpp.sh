#!/usr/bin/env bash
# Build llama-completion and llama-speculative-simple (for `dynvocab bench --llamacpp BIN_DIR`) from the registry's
# llama-cpp-python 0.3.36 sdist; arguments go to scripts/build_llamacpp.py (--work DIR, --jobs N, --patch-qwen2).
# The last line printed is BIN_DIR.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec nice -n 10 python "$here/build_llamacpp.py" "$@"
