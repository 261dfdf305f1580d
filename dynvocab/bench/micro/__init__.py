"""The microbenchmarks (``dynvocab microbench``): one part of a draft step timed alone at real shapes with random
weights (head kernels, policy steps, EAGLE and draft-model steps, batched heads, graph replay, tree cycles), their
shared timing, and the GPU check that runs them on a CUDA machine."""
