"""Evaluation of the runtime, kept apart from it, one sub-package per kind of measurement: :mod:`.loop` (``dynvocab
bench``: the runner, its embedded tasks, summaries and plots), :mod:`.engines` (the Hugging Face, llama.cpp and vLLM
rows) and :mod:`.micro` (the kernel / draft-step microbenchmarks and the GPU check); :mod:`.stability` reads the
machine's load for the first two.

Nothing in :mod:`dynvocab.runtime` imports this package; it calls the runtime the way a user would.
"""
