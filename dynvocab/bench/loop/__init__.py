"""The loop bench (``dynvocab bench``): rows × prompts through dynvocab's own loop and the other engines' rows, what
each cycle's active sets held, the summaries, tables, CSV and plots, the embedded tasks and prompt files."""
