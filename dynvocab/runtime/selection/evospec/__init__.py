"""EvoSpec: one selector for dynvocab's loop and a batched host (a static core and each request's ARC cache refilled
by retrieval), and the loop's adapter (retrieval in a worker thread, online LoRA alignment)."""
