"""dynvocab: lossless speculative decoding with a small, context-dependent draft vocabulary.

The Python API (the CLI is a thin layer over it; docs/python.md has runnable examples)::

    import dynvocab

    pair = dynvocab.load(target="demo:target", draft="demo:draft")       # models loaded once
    out = pair.generate("Write a haiku about caches.", strategy="full", max_new_tokens=64)
    out.text, out.token_ids, out.metrics.tokens_per_s
    for piece in pair.stream("Tell me a story.", strategy="fr"):          # text as cycles finish
        print(piece, end="")
    pair.bench(["Sort a list in Python."], strategies=["ar", "full"]).to_pandas()

- :func:`load` -> :class:`Pair` (``start`` -> :class:`Reply`, iterated one cycle at a time, ``generate`` ->
  :class:`GenerationResult`, ``stream``, ``bench`` -> :class:`BenchResult`, ``encode``)
- :func:`build_index`, :func:`train_router`, :func:`export`: the offline artifacts
- :class:`DynvocabError`: every refusal, with the one-line message the CLI prints

Importing ``dynvocab`` loads nothing heavy: torch and the models load on the first call.
"""

from dynvocab.errors import DynvocabError
from dynvocab.version import __version__

TYPE_CHECKING = False  # True to type checkers (mypy, pyright read the name); spares importing typing (~3 ms)
if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names come from dynvocab.api on first use
    from dynvocab.api import BenchResult, GenerationResult, Pair, Reply, build_index, export, load, train_router

_API = ("BenchResult", "GenerationResult", "Pair", "Reply", "build_index", "export", "load", "train_router")


def __getattr__(name):
    """The API's names, taken from :mod:`dynvocab.api` (which imports torch) on first use."""
    if name in _API:
        from dynvocab import api

        return getattr(api, name)
    raise AttributeError(f"module 'dynvocab' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])


__all__ = ["DynvocabError", *_API]
