"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class DynvocabError(Exception):
    """A bad input or an unusable resource; the message says what is wrong and what to do."""
