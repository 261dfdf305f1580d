"""Draft trees: the one tree type (a chain is a tree of one path), their growth, ``--tree auto``'s budget,
verification."""
