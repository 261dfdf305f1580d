"""Drafts: the proposer boundary, the target and draft models, EAGLE heads, and the registry of draft kinds."""
