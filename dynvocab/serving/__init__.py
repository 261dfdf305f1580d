"""Adapters that run dynvocab's selectors inside serving engines. Nothing outside this package imports an engine,
so dynvocab installs and tests without one."""
