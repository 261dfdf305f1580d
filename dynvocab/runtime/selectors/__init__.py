"""The batched selectors: what a batched host (the vLLM plugin, through :mod:`dynvocab.runtime.batched`) runs for a
strategy, ``hidden [B, d] -> ids [B, k]`` (:mod:`.batch_select`) or, reading the request's context,
``(hidden, StepContext) -> BatchSets`` (:mod:`.context_select`, :mod:`.request_window`, :mod:`.evospec_select`),
and the pieces the loop's one-row policies share with them (:mod:`.arc`, :mod:`.candidates`)."""
