"""dynvocab's version, in the lowest layer so that the bundle and the build checkpoints can stamp it without
importing the package's face (:mod:`dynvocab` re-exports it as ``dynvocab.__version__``)."""

__version__ = "0.1.0"
