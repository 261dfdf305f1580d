"""dynvocab: lossless speculative decoding with a small, context-dependent draft vocabulary.

The Python API (the CLI is a thin layer over it; docs/python.md has runnable examples)::

    import dynvocab

    pair = dynvocab.load(target="demo:target", draft="demo:draft")       # models loaded once
    out = pair.generate("Write a haiku about caches.", strategy="full", max_new_tokens=64)
    out.text, out.token_ids, out.metrics.tokens_per_s
    for piece in pair.stream("Tell me a story.", strategy="fr"):          # text as cycles finish
        print(piece, end="")
    pair.bench(["Sort a list in Python."], strategies=["ar", "full"]).to_pandas()

- :func:`load` -> :class:`Pair` (``generate`` -> :class:`GenerationResult`, ``stream``, ``bench`` ->
  :class:`BenchResult`, ``encode``)
- :func:`build_index`, :func:`train_router`, :func:`export`: the offline artifacts
- :class:`DynvocabError`: every refusal, with the one-line message the CLI prints

Importing ``dynvocab`` loads nothing heavy: torch and the models load on the first call.
"""

from dynvocab.errors import DynvocabError

__version__ = "0.1.0"

_LAZY = {  # public names defined in dynvocab.api, imported on first use
    "Pair": "Pair",
    "GenerationResult": "GenerationResult",
    "BenchResult": "BenchResult",
}


def load(target="demo:target", draft="demo:draft", bundle=None, device=None, dtype=None, draft_weights=None,
         prepack=None, threads=None, status=None):
    """Load a target and its draft once and return a :class:`Pair` to generate, stream and bench on.

    ``target``/``draft``: a hub id, a local folder, a ``.gguf`` file or ``demo:*`` (the draft may also be an EAGLE
    head folder; ``draft=None`` loads the target alone, for ``ar``). ``bundle``: the file ``build-index`` /
    ``train-router`` wrote, for the strategies that read it. ``device``, ``dtype``, ``draft_weights``, ``prepack``,
    ``threads``: as the CLI's options (defaults chosen for the machine). ``status`` receives loading messages.
    """
    from dynvocab import api

    return api.load(target, draft, bundle, device, dtype, draft_weights, prepack, threads, status)


def build_index(out, target="demo:target", draft="demo:draft", config=None, progress=None):
    """Build the offline tables (freq, clusters, hnsw, graph, draft_hnsw) for a pair into the bundle ``out``.

    ``config``: a ``dynvocab.builders.pipeline.BuildConfig``; ``progress``: a callback ``(stage, done, total)``.
    Returns the build report. The file appears whole or not at all; a stopped build resumes.
    """
    from dynvocab import api

    return api.build_index(out, target, draft, config, progress)


def train_router(bundle, draft="demo:draft", target=None, config=None, out=None, progress=None):
    """Train the vocabulary selectors (router, lowrank, centroids) of ``draft`` into ``bundle`` (or ``out``).

    ``config``: a ``dynvocab.builders.router.TrainRouterConfig``; ``progress``: a callback ``(stage, done, total)``.
    Returns the report with each selector's held-out recall.
    """
    from dynvocab import api

    return api.train_router(bundle, draft, target, config, out, progress)


def export(bundle, out, format="sglang", size=None, *, strategy=None, draft=None, budget=None, copy=False):
    """Export a bundle as an SGLang / FR-Spec token map (``"sglang"``), EAGLE-3's ``{d2t, t2d}`` (``"eagle3"``),
    or a draft folder vLLM loads (``"vllm"``: ``strategy``'s selector over ``draft``, ``budget`` ids or
    candidates or blocks, ``copy`` instead of links); returns the path written."""
    from dynvocab import api

    return api.export(bundle, out, format, size, strategy=strategy, draft=draft, budget=budget, copy=copy)


def __getattr__(name):
    if name in _LAZY:
        from dynvocab import api

        return getattr(api, _LAZY[name])
    raise AttributeError(f"module 'dynvocab' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["BenchResult", "DynvocabError", "GenerationResult", "Pair", "build_index", "export", "load",
           "train_router"]
