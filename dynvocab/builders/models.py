"""What the builders need from the models: LM-head shapes and weights, end tokens, target hidden states.

LM heads are read straight from the safetensors files when the model is a local folder (the demo cache
is), so a build never holds a whole float32 model in memory; anything else falls back to loading it.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from dynvocab.artifacts import ModelFingerprint
from dynvocab.errors import DynvocabError
from dynvocab.models import ModelSpec, default_dtype, load_model, resolve_model
from dynvocab.models.eagle import eagle_checkpoint
from dynvocab.models.vocab import end_token_ids as _end_token_ids

_HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")


def _config(spec: ModelSpec):
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(spec.path, gguf_file=spec.gguf_file)
    except Exception as exc:
        raise DynvocabError(f"cannot read the config of model '{spec.source}' ({type(exc).__name__}); check --target/--draft") from exc
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def resolve_draft_model(source: str) -> ModelSpec:
    """``source`` resolved as a draft model. An EAGLE head is refused in one line: the builders run the draft's
    own passes, and a head has those only over its target's hidden states; its selectors and index are built on
    the model whose head rows it drafts through (its target)."""
    spec = resolve_model(source)
    if eagle_checkpoint(spec) is not None:
        raise DynvocabError(
            f"'{source}' is an EAGLE head; build-index and train-router run a draft model's own passes, which a "
            "head has only over its target: pass the target as --draft (an EAGLE-1 head drafts through the "
            "target's head rows; e.g. --draft demo:gemma for demo:gemma-eagle1)"
        )
    return spec


def head_shape(spec: ModelSpec) -> tuple[int, int]:
    """``(rows, hidden)`` of the model's LM head, from its config (no weights loaded)."""
    cfg = _config(spec)
    return int(cfg.vocab_size), int(cfg.hidden_size)


def fingerprint(spec: ModelSpec, tokenizer) -> ModelFingerprint:
    """The fingerprint stored in the bundle for this model."""
    return ModelFingerprint.of(tokenizer, head_shape(spec), spec.source)


def _safetensors_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in weight_map.items()}
    out = {}
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out


def load_head(spec: ModelSpec) -> torch.Tensor:
    """The LM-head weight as float32 [rows, hidden] (tied heads read the input embedding)."""
    rows, hidden = head_shape(spec)
    folder = Path(spec.path)
    if spec.gguf_file is None and folder.is_dir():
        from safetensors import safe_open

        files = _safetensors_files(folder)
        # A checkpoint without lm_head.weight ties its head to the input embedding.
        key = next((k for k in _HEAD_KEYS if k in files), None)
        if key is not None:
            with safe_open(str(files[key]), framework="pt") as f:
                weight = f.get_tensor(key)
            if tuple(weight.shape) == (rows, hidden):
                return weight.float()
    model = load_model(spec, "cpu", "float32")
    weight = model.get_output_embeddings().weight.detach().clone()
    del model
    gc.collect()
    return weight


def end_token_ids(spec: ModelSpec, tokenizer) -> list[int]:
    """EOS and end-of-turn ids: tokenizer EOS, the generation config's EOS, and known end-of-turn tokens."""
    gen = Path(spec.path) / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    ids = _end_token_ids(tokenizer, eos)
    return sorted(ids)


def query_dtype(device: str) -> str:
    """The dtype for the recall/preconditioner target pass: float32 on CPU, where a 64-token bfloat16 prefill
    runs ~5× slower than float32 (the speed-up of bf16 holds for 1-token decoding only); bf16 on CUDA."""
    return "float32" if device == "cpu" else default_dtype(device)


@torch.inference_mode()
def hidden_states(
    spec: ModelSpec, tokenizer, texts: list[str], max_tokens: int, device: str = "cpu", batch_size: int = 8
) -> list[torch.Tensor]:
    """Final (post-norm) hidden states of the model body on each text's first ``max_tokens`` tokens.

    Returns one float32 [T_i, hidden] tensor per text: the vectors the LM head multiplies, one per position.
    Texts run in right-padded batches; causal attention keeps the real positions unaffected by the padding.
    """
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens] or [tokenizer.eos_token_id or 0] for t in texts]
    model = load_model(spec, device, query_dtype(device))
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    states = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        width = max(map(len, batch))
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        out = body(input_ids=input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [B, T, hidden]
        states += [out[row, : len(seq)].float().cpu() for row, seq in enumerate(batch)]
    del model, body
    gc.collect()
    return states
