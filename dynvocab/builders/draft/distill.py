"""Self-distilled training documents for ``train-draft --self-distill``: the target's own continuations of corpus
prompts, generated in batches, cached in shards, resumable.

A draft head must predict what the *target* writes at run time, not what people wrote: SpecForge regenerates every
assistant turn with the target before training (``scripts/regenerate_train_data.py``), Medusa-2 self-distills,
and speculators computes its verifier's states in a separate data-generation step. Each corpus document gives a
prompt, in one of two styles (``prompts``):

* ``turn`` (the default): a conversation's first user turn (cut to ``prompt_tokens`` tokens), encoded exactly as
  the runtime encodes a prompt (:func:`dynvocab.prompts.encode_prompt`: with the chat template and the
  model's turn opened; a model without a template continues the turn's text after its BOS). The target writes what
  it writes when serving, which is what a draft must predict. A plain-text row is one user turn.
* ``text``: the document's first ``prompt_tokens`` tokens (ShareGPT: of the chat-template-encoded conversation,
  so the target continues the user's text or the recorded answer), after the BOS token the tokenizer puts before
  a prompt at run time. This is how the heads shipped before ``turn`` were trained.

The target continues each prompt by ``new_tokens`` tokens, greedily (``temperature`` 0) or sampled, stopping at
an end token. Document = prompt + continuation; the feature pass (:mod:`.features`) then runs over these
documents as over corpus text.

The target generates ``batch`` prompts per call (left-padded, one batched pass per new token: a CPU makes them at
the rate of a batched pass, not one token at a time), in the dtype the runtime would use (bfloat16 on CPUs with
native bf16); with ``engine`` ``vllm`` a vLLM engine writes them, ``batch`` requests in flight
(``dynvocab.bench.engines.vllm.answers``, which the command hands the trainer). Each batch is one shard, written whole
(``dynvocab.files.write_atomic``); a rerun skips finished shards, and a manifest records the target's fingerprint
and every setting the documents depend on, so documents of another target or other settings are refused instead of
mixed. Sampling draws from a generator seeded by the seed and the shard index, so a resumed run writes the same
documents as one that never stopped.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from dynvocab.artifacts import ModelFingerprint
from dynvocab.builders.draft import manifest as manifests
from dynvocab.builders.draft.manifest import MANIFEST  # noqa: F401 (the file name, for callers)
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.progress import Reporter

FORMAT_VERSION = 1
PROMPT_STYLES = ("turn", "text")
ENGINES = ("torch", "vllm")  # who writes the answers: PyTorch in this process, or a vLLM engine (a writer)


@dataclass(frozen=True)
class DistillConfig:
    """How the target's own documents are made (any change means other documents)."""

    prompt_tokens: int = 256  # turn: the user turn is cut beyond this many tokens; text: the document's first tokens
    new_tokens: int = 192  # tokens the target writes per prompt (fewer when it ends)
    temperature: float = 0.0  # 0: greedy; > 0: sampled from the target's full distribution (no top-k/top-p)
    batch: int = 16  # prompts per generation call and per cache shard
    dtype: str | None = None  # the target's dtype while generating; None: the runtime's default for the device
    seed: int = 0
    prompts: str = "turn"  # PROMPT_STYLES: the target answers each first user turn, or continues the document
    engine: str = "torch"  # ENGINES: who writes the answers (not a setting of the documents: either serves a cache)

    def check(self) -> None:
        """One-line refusals of impossible settings."""
        for flag, value, low in (("--distill-prompt-tokens", self.prompt_tokens, 1),
                                 ("--distill-new-tokens", self.new_tokens, 1), ("--distill-batch", self.batch, 1)):
            if value < low:
                raise DynvocabError(f"{flag} must be at least {low}, got {value}")
        if self.temperature < 0:
            raise DynvocabError(f"--distill-temperature must be 0 (greedy) or positive, got {self.temperature}")
        if self.prompts not in PROMPT_STYLES:
            raise DynvocabError(f"unknown --distill-prompts '{self.prompts}'; use turn or text")
        if self.engine not in ENGINES:
            raise DynvocabError(f"unknown --distill-engine '{self.engine}'; use {' or '.join(ENGINES)}")


def shard_path(folder: Path, index: int) -> Path:
    """The file of shard ``index`` (prompts ``[index·batch, (index+1)·batch)``)."""
    return folder / f"docs-{index:05d}.safetensors"


def open_manifest(folder: Path, fingerprint: ModelFingerprint, settings: dict) -> dict:
    """The manifest of ``folder`` (created when absent); another target or other settings are refused."""
    return manifests.open_manifest(
        folder, FORMAT_VERSION, fingerprint, settings, changed=_changed, cached="documents", outs="--out",
        old_format="{folder} holds self-distilled documents in another format; delete that folder",
        other_target="{folder} holds another target's documents ({diff}); use another --out or delete it",
    )


def _changed(have: dict, want: dict) -> list[str] | None:
    """The settings in which recorded documents differ from a run's (None: they serve it)."""
    if have == want:
        return None
    return [manifests.corpus_change(have.get(k) or {}, want[k]) if k == "corpus" else k
            for k in sorted(k for k in want if have.get(k) != want[k])]


def prompt_ids(cfg: DistillConfig, corpus, documents: Iterator[list[int]], tokenizer) -> Iterator[list[int]]:
    """The prompts the target continues, in corpus order: ``documents`` (the corpus's token ids) cut to
    ``cfg.prompt_tokens`` after a BOS (``text``), or each conversation's first user turn as the runtime encodes it
    (``turn``, read from ``corpus``, a :class:`~dynvocab.builders.corpus.CorpusConfig`)."""
    if cfg.prompts == "text":
        return (with_bos(p[: cfg.prompt_tokens], tokenizer) for p in documents)
    from dynvocab.builders.corpus import first_turns
    from dynvocab.prompts import encode_prompt

    def cut(messages: list[dict]) -> list[dict]:
        *before, user = messages
        ids = tokenizer(user["content"], add_special_tokens=False)["input_ids"]
        if len(ids) <= cfg.prompt_tokens:
            return messages
        return [*before, {"role": "user", "content": tokenizer.decode(ids[: cfg.prompt_tokens]).rstrip() + " …"}]

    return (encode_prompt(tokenizer, cut(m)) for m in first_turns(corpus))


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts a BOS token before the text it encodes (``tokenizer(text)``)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def with_bos(prompt: list[int], tokenizer) -> list[int]:
    """``prompt`` after the BOS token the tokenizer puts before a prompt (``tokenizer(text)``), as the runtime
    encodes prompts; unchanged for a tokenizer that adds none."""
    bos = tokenizer.bos_token_id
    return [bos, *prompt] if adds_bos(tokenizer) and prompt[:1] != [bos] else list(prompt)


@torch.inference_mode()
def continue_batch(model, prompts: list[list[int]], cfg: DistillConfig, pad_id: int, end_ids: list[int],
                   seed: int) -> list[list[int]]:
    """The target's continuations of ``prompts`` (one generation call, left-padded), each cut after its first end
    token. Sampling (``cfg.temperature`` > 0) draws from the target's full distribution with a generator seeded
    by ``seed``; the global random state is left as it was."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    options = dict(max_new_tokens=cfg.new_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=end_ids,
                   temperature=None, top_k=None, top_p=None)
    if cfg.temperature > 0:  # greedy search over scores that are -inf but at one sampled id a row: a sample
        generator = torch.Generator(device=device).manual_seed(seed)
        options["logits_processor"] = _sampler(lambda scores: sample_by_cdf(scores, cfg.temperature, generator))
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **options)
    return [[*p, *through_end(row, end_ids)] for p, row in zip(prompts, out[:, width:].tolist())]


def through_end(row: list[int], end_ids: list[int]) -> list[int]:
    """``row`` up to and including its first end token (all of it where there is none)."""
    ends = set(end_ids)
    return row[: next((k + 1 for k, t in enumerate(row) if t in ends), len(row))]


def sample_by_cdf(scores: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One draw a row from softmax(``scores`` / ``temperature``) ([B, V] -> [B]), by inverting each row's cumulative
    distribution (summed in float64) at one uniform: on a CPU core, 0.12 s for 32 rows of 262,144 ids against
    ``torch.multinomial``'s 0.5 s, which made sampled generation 3.7x slower than greedy. Ids of probability 0 are
    never drawn."""
    cdf = torch.softmax(scores.float() / temperature, dim=-1).cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)[:, 0]


def _sampler(draw):
    """A transformers logits processor that leaves only ``draw(scores)``'s id a row (0, the rest -inf)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Sampled(LogitsProcessor):
        def __call__(self, input_ids, scores):
            picked = draw(scores)  # [B]
            return torch.full_like(scores, float("-inf")).scatter_(1, picked[:, None], 0.0)

    return LogitsProcessorList([Sampled()])


def generate(model, tokenizer, prompts: Iterator[list[int]], folder: Path, manifest: dict, cfg: DistillConfig,
             max_docs: int, end_ids: list[int], reporter: Reporter, writer=None) -> dict:
    """Fill ``folder`` with the shards of the first ``max_docs`` prompts' documents not yet written; returns the
    manifest. ``prompts`` yields the prompts' token ids in a fixed order (:func:`prompt_ids`). The target ``model``
    writes each shard's answers in one batched call; a ``writer`` (``dynvocab.bench.engines.vllm.answers.VllmWriter``:
    an ``answers`` method and ``shards_per_call``) instead answers several shards' prompts per call, and ``model`` is
    not used."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    docs, made, started = 0, 0, time.perf_counter()
    written = manifests.finished_docs(lambda i: _shard_docs(shard_path(folder, i)), cfg.batch, max_docs)
    if written:
        reporter.log(f"self-distilled documents: {written:,} of {max_docs:,} written before; resuming")

    def answer(shards: list[tuple[int, list[list[int]]]]) -> list[list[list[int]]]:
        """Each shard's documents (prompt + answer): the model shard by shard, or the writer for all at once."""
        if writer is None:
            return [continue_batch(model, chunk, cfg, pad_id, end_ids, cfg.seed * 1_000_003 + index)
                    for index, chunk in shards]
        flat = [p for _, chunk in shards for p in chunk]
        new = iter(writer.answers(flat, cfg.new_tokens, cfg.temperature, end_ids, cfg.batch,
                                  cfg.seed * 1_000_003 + shards[0][0], cfg.dtype))
        return [[[*p, *through_end(next(new), end_ids)] for p in chunk] for _, chunk in shards]

    with reporter.task("self-distilled documents (the target writes)", total=max_docs - written) as advance:
        def write(shards: list[tuple[int, list[list[int]]]]) -> None:
            nonlocal made
            for (index, chunk), shard_docs in zip(shards, answer(shards)):
                made += _write_shard(shard_path(folder, index), shard_docs, [len(p) for p in chunk])
                seconds = time.perf_counter() - started
                rate = f" · {made / seconds:,.0f} new tok/s" if made and seconds > 0 else ""
                advance(len(chunk), description=f"self-distilled documents{rate}")

        group = 1 if writer is None else writer.shards_per_call
        pending: list[tuple[int, list[list[int]]]] = []
        chunks = iter(lambda: list(itertools.islice(prompts, cfg.batch)), [])
        for index, chunk in enumerate(itertools.islice(chunks, -(-max_docs // cfg.batch))):
            chunk = chunk[: max_docs - docs]
            docs += len(chunk)
            if _shard_docs(shard_path(folder, index)) == len(chunk):
                continue  # written before: not counted in this run's bar, rate or ETA
            pending.append((index, chunk))
            if len(pending) == group:
                write(pending)
                pending = []
        if pending:
            write(pending)
    if docs == 0:
        raise DynvocabError("the corpus gave no prompts; check --corpus and --max-docs")
    manifest = {**manifest, "docs": max(docs, manifest["docs"]), "exhausted": docs < max_docs}
    if made:
        seconds = time.perf_counter() - started
        manifest["generate"] = {"new_tokens": made, "seconds": round(seconds, 2), "tokens_per_s": round(made / seconds, 1)}
    manifests.write_manifest(folder, manifest)
    return manifest


def needs_generation(manifest: dict, max_docs: int) -> bool:
    """Whether the cache lacks documents a run of ``max_docs`` documents reads."""
    return manifest["docs"] < max_docs and not manifest["exhausted"]


def documents(folder: Path, max_docs: int, max_tokens: int) -> Iterator[list[int]]:
    """The first ``max_docs`` self-distilled documents (prompt + continuation), each at most ``max_tokens``."""
    from safetensors import safe_open

    count, index = 0, 0
    while count < max_docs and shard_path(folder, index).is_file():
        with safe_open(str(shard_path(folder, index)), framework="pt") as f:
            ids, offsets = f.get_tensor("ids").tolist(), f.get_tensor("offsets").tolist()
        for a, b in zip(offsets, offsets[1:]):
            if count >= max_docs:
                return
            yield ids[a:b][:max_tokens]
            count += 1
        index += 1


def summary(folder: Path, max_docs: int) -> dict:
    """Prompt and continuation tokens of the first ``max_docs`` documents, for ``training.json``."""
    from safetensors import safe_open

    prompt = new = count = 0
    index = 0
    while count < max_docs and shard_path(folder, index).is_file():
        with safe_open(str(shard_path(folder, index)), framework="pt") as f:
            lengths = f.get_tensor("offsets").diff().tolist()
            prompts = f.get_tensor("prompt").tolist()
        for total, p in list(zip(lengths, prompts))[: max_docs - count]:
            prompt, new, count = prompt + p, new + total - p, count + 1
        index += 1
    return {"docs": count, "prompt_tokens": prompt, "new_tokens": new}


def _shard_docs(path: Path) -> int:
    from safetensors import safe_open

    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("prompt").get_shape()[0]


def _write_shard(path: Path, docs: list[list[int]], prompt_lengths: list[int]) -> int:
    """One batch's documents, written whole; returns the tokens the target wrote."""
    from safetensors.torch import save_file

    lengths = [len(d) for d in docs]
    tensors = {
        "ids": torch.tensor([t for d in docs for t in d], dtype=torch.int32),  # [N]
        "offsets": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64),  # [D+1]
        "prompt": torch.tensor(prompt_lengths, dtype=torch.int64),  # [D]
    }
    write_atomic(path, lambda p: save_file(tensors, str(p)))
    return sum(lengths) - sum(prompt_lengths)


def settings_of(cfg: DistillConfig, corpus: dict) -> dict:
    """What the documents depend on, as the manifest records it (the document limit is not: a cache grows)."""
    return {"distill": as_settings(cfg), "corpus": {k: v for k, v in corpus.items() if k != "max_docs"}}


def as_settings(cfg: DistillConfig) -> dict:
    """``cfg`` as caches record it. ``prompts`` is left out when it is ``text``: caches made before it existed are
    all ``text`` caches and record no such key, and they still serve the runs that made them."""
    out = asdict(cfg)
    if out["prompts"] == "text":
        del out["prompts"]
    del out["engine"]  # how the answers were written, not what they are
    return out
