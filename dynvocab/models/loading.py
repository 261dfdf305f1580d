"""Resolve a model argument (hub id, local folder, .gguf file, demo:NAME) and load it."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from dynvocab.errors import DynvocabError
from dynvocab.models.int8 import INT8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the names options take
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}  # microbenchmarks' too


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's files are: ``path`` is a folder or hub id; ``gguf_file`` names a GGUF inside it."""

    source: str
    path: str
    gguf_file: str | None = None

    @property
    def is_local(self) -> bool:
        """True when the model is read from this machine rather than from a hub."""
        return Path(self.path).exists()


def resolve_model(source: str) -> ModelSpec:
    """Turn a ``--target``/``--draft`` argument into a :class:`ModelSpec` (builds the demo cache if needed)."""
    source = source.strip()
    if not source:
        raise DynvocabError("empty model name; pass a hub id, a local folder, a .gguf file or demo:target/demo:draft")
    if source.startswith("demo:"):
        from dynvocab.models.demo import ensure_demo

        return ModelSpec(source, str(ensure_demo(source.split(":", 1)[1])))
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise DynvocabError(f"GGUF file {source} does not exist; check the path")
        return ModelSpec(source, str(path.parent.resolve()), path.name)
    if path.exists():
        if not (path / "config.json").is_file():
            raise DynvocabError(f"{source} has no config.json; pass a transformers model folder or a .gguf file")
        return ModelSpec(source, str(path.resolve()))
    looks_local = source.startswith((".", "/", "~")) or source.count("/") > 1
    if looks_local:
        raise DynvocabError(f"model path {source} does not exist; check the path or use demo:target / demo:draft")
    return ModelSpec(source, source)


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bfloat16 matmul (AVX-512 BF16 or AMX), where bf16 beats float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA and on CPUs with native bf16; float32 elsewhere."""
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def check_device_options(device: str | None, dtype: str | None, draft_weights: str | None = None) -> None:
    """Refuse, in one line and before any model is loaded, an unknown device, dtype or draft-weights value, and int8
    draft weights off a CPU."""
    if device is not None and device != "cpu" and not device.startswith("cuda"):
        raise DynvocabError(f"unknown device '{device}'; use cpu or cuda")
    if dtype is not None and dtype not in DTYPES:
        raise DynvocabError(f"unknown dtype '{dtype}'; use float32, bfloat16 or float16")
    if draft_weights is not None and draft_weights not in (INT8, *DTYPES):
        raise DynvocabError(f"unknown draft weights '{draft_weights}'; use int8, bfloat16, float32 or float16")
    if draft_weights == "int8" and device is not None and device != "cpu":
        raise DynvocabError("--draft-weights int8 runs on a CPU (fbgemm); pass --draft-weights bfloat16 on a GPU")


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name to a torch dtype, with a clear error for anything else."""
    if name not in DTYPES:
        raise DynvocabError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _hub_error(spec: ModelSpec, exc: Exception) -> DynvocabError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DynvocabError(
        f"cannot load model '{spec.source}': {first[:200]}; pass a local folder, a .gguf file or demo:target/demo:draft"
    )


def load_tokenizer(spec: ModelSpec):
    """Load the tokenizer of a model (fast tokenizer where one exists)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.gguf_file)
    except Exception as exc:  # transformers raises many types for a missing or damaged model
        raise _hub_error(spec, exc) from exc


def load_model(spec: ModelSpec, device: str, dtype: str):
    """Load a causal LM in eval mode on ``device`` in ``dtype`` (GGUF files are dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DynvocabError("--device cuda was given but no CUDA GPU is visible; use --device cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.path, gguf_file=spec.gguf_file, dtype=torch_dtype)
    except Exception as exc:
        raise _hub_error(spec, exc) from exc
    return model.to(device).eval()
