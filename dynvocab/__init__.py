"""dynvocab: lossless speculative decoding with a small, context-dependent draft vocabulary."""

__version__ = "0.1.0"
