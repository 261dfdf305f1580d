"""Build the llama.cpp binaries ``dynvocab bench --llamacpp BIN_DIR`` runs, from the registry's llama-cpp-python sdist.

``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` into WORK, unpack it, and build
``llama-completion`` and ``llama-speculative-simple`` from its ``vendor/llama.cpp`` with cmake (Release,
``GGML_NATIVE=ON``, no curl; Ninja when it is installed). Each step is skipped when its output is there already.
Prints BIN_DIR last. ``--patch-qwen2`` applies scripts/llamacpp_eagle3.py's one-line patch so that an EAGLE-3
head over a Qwen2 target (``llama.cpp-spec`` with ``draft-eagle3``) does not abort; plain and draft-model rows
need no patch.

    python scripts/build_llamacpp.py --work /work/llama-build --jobs 2
    dynvocab bench --tasks code,chat --num-prompts 2 --llamacpp /work/llama-build/build/bin
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynvocab.bench.engines.llamacpp import build, llama_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("llamacpp-work"), help="download and build folder")
    ap.add_argument("--jobs", type=int, default=2, help="parallel build jobs")
    ap.add_argument("--patch-qwen2", action="store_true", help="let EAGLE-3 heads run over Qwen2 targets")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = llama_tree(work)
    if args.patch_qwen2:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from llamacpp_eagle3 import patch_qwen2

        patch_qwen2(tree)
    print(build(tree, work, args.jobs))


if __name__ == "__main__":
    main()
