"""The runtime: model wrappers, the speculative loop, verification, vocabulary policies, metrics."""
