"""EvoSpec: the loop's policy (an ARC cache refilled by retrieval, online LoRA alignment) and the batched host's
selector (a cache per request)."""
