"""Evaluation of the runtime, kept apart from it: the bench runner, its embedded tasks, the Hugging Face
baseline rows, summaries and plots, and the kernel / draft-step microbenchmarks.

Nothing in :mod:`dynvocab.runtime` imports this package; it calls the runtime the way a user would.
"""
