"""The exception types the CLI turns into a one-line message and a non-zero exit."""


class DynvocabError(Exception):
    """A bad input or an unusable resource; the message says what is wrong and what to do."""

    exit_code = 1


class Interrupted(DynvocabError):
    """Ctrl-C, after what was done so far has been printed or written; the message says how far it got, and
    ``result`` holds what was finished (e.g. a bench's finished rows), or None."""

    exit_code = 130

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result
