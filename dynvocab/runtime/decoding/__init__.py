"""The speculative loop: one generation, its cycle, n-gram drafts, counters and section timers."""
