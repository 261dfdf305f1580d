"""The strategies that read the request's context: MicroSpec's window and the hybrid in dynvocab's loop (each a
policy that learns from cycles), and their selectors in a batched host."""
