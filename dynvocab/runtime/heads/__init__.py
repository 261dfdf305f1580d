"""Heads over active sets: the active set and its segment keys, the packed/range/gather heads, EAGLE-3's mapped head,
token maps."""
