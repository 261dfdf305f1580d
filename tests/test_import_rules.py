"""dynvocab's floors, read from the source: every import arrow runs down.

Each module under ``dynvocab/`` is parsed with ``ast`` (nothing is imported) and every import it names is checked:
at module level, inside functions and under ``if TYPE_CHECKING`` alike, absolute or relative (``from . import x``,
``from ..artifacts import y``), and ``importlib.import_module("…")`` / ``__import__("…")`` with a literal name.
A module's floor is that of the longest package prefix :data:`FLOORS` lists for it; top to bottom::

    face (dynvocab/__init__.py, __main__.py)
    cli
    api, reply
    bench
    builders | serving      two rooms on one floor: neither imports the other
    runtime
    artifacts
    models
    data, prompts, progress, registry
    files, errors, budget, version, kernels

The rules, each failure named ``file:line -> module``:

- no arrow runs up (a module imports only its own floor or lower ones), and a module missing from the table fails
  until it is given a floor;
- ``builders`` and ``runtime`` never import each other (they meet in ``artifacts``), nor do ``builders`` and
  ``serving``, nor bench's microbenchmarks (``bench/micro``) and its loop bench or other engines' rows (:data:`APART`);
- ``dynvocab.serving`` is imported only inside ``serving/`` and from the floors above it (:data:`SERVING_USERS`);
- vLLM is imported only by the modules that must (:data:`VLLM_IMPORTERS`), so dynvocab installs and tests without it;
  so is a module whose name is computed at run time (``import_module(name)``), which this test cannot follow;
- no circles: no module reaches itself through its imports, lazy (function-level) and type-checking ones included,
  so two modules of one floor still have an order (a circle is named by its shortest loop).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dynvocab"

FLOORS = {  # package prefix -> floor; a module imports its own floor and the ones below, never one above
    "dynvocab": 10,  # the package face only (dynvocab/__init__.py); its submodules have their own entries
    "dynvocab.__main__": 10,
    "dynvocab.cli": 9,
    "dynvocab.api": 8,
    "dynvocab.reply": 8,
    "dynvocab.bench": 7,
    "dynvocab.builders": 6,
    "dynvocab.serving": 6,
    "dynvocab.runtime": 5,
    "dynvocab.artifacts": 4,
    "dynvocab.models": 3,
    "dynvocab.data": 2,
    "dynvocab.prompts": 2,
    "dynvocab.progress": 2,
    "dynvocab.registry": 2,
    "dynvocab.files": 1,
    "dynvocab.errors": 1,
    "dynvocab.budget": 1,
    "dynvocab.version": 1,
    "dynvocab.kernels": 1,
}
APART = {  # pairs that never import each other, either way, and why
    ("dynvocab.builders", "dynvocab.runtime"): "they meet in artifacts",
    ("dynvocab.builders", "dynvocab.serving"): "two rooms on one floor",
    ("dynvocab.bench.micro", "dynvocab.bench.loop"): "a microbenchmark times one part alone, the loop bench whole runs",
    ("dynvocab.bench.micro", "dynvocab.bench.engines"): "a microbenchmark times one part alone, not another engine",
}
SERVING = "dynvocab.serving"
# The floors above serving that import it: bench only (its vLLM rows write the draft folder and drive the engine).
# cli and api sit above it too but need no import: `export --format vllm` finds serving/vllm's writer through the
# dynvocab.export_formats entry point.
SERVING_USERS = ("dynvocab.bench",)
VLLM_IMPORTERS = (  # the modules that must import vLLM (files under dynvocab/)
    "serving/vllm/__init__.py",  # the plugin's entry point: registers the architectures with vLLM's ModelRegistry
    "serving/vllm/models.py",  # vLLM's model classes with the head replaced
    "serving/vllm/eagle1.py",  # vLLM's EAGLE-1 class widened to dynvocab's heads (activation, fc bias, scale)
    "serving/vllm/proposal.py",  # wraps the model runner's method where a proposal begins
    "serving/vllm/head.py",  # vLLM's head, logits processor and tensor-parallel shard
    "serving/vllm/context.py",  # the forward context's attention metadata: which draft pass ran
    "serving/vllm/contract.py",  # what the plugin asks of vLLM's classes, checked at load
    "bench/engines/vllm/driver.py",  # the child process behind bench --vllm and the engine tests
)
COMPUTED = "<computed>"  # an import_module(name) whose name is only known at run time: it may be vLLM's


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module in ``path`` (a package's ``__init__.py`` is the package)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int | None:
    """The floor of ``module``: that of its longest prefix in :data:`FLOORS` (``dynvocab`` alone: only itself)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in FLOORS and (n > 1 or len(parts) == 1):
            return FLOORS[prefix]
    return None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imported(source: str, module: str, is_package: bool, modules: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``source``, the source of ``module``: relative names resolved,
    ``from package import name`` naming the submodule when ``name`` is one of ``modules``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            found += [(node.lineno, sub) for sub in subs] or [(node.lineno, base)]
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            arg = node.args[0]
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            found.append((node.lineno, arg.value if literal else COMPUTED))
    return found


def _dynamic_import(node: ast.Call) -> bool:
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return name in ("import_module", "__import__") and bool(node.args)


def violations(source: str, module: str, where: str, is_package: bool = False,
               modules: set[str] = frozenset()) -> list[str]:
    """Every broken rule in ``source`` (the module ``module``, at ``where`` relative to ``dynvocab/``), as
    ``"where:line -> imported: why"``."""
    own = floor(module)
    if own is None:
        return [f"{where}: {module} has no floor; add its package to FLOORS in tests/test_import_rules.py"]
    out = []
    for line, target in imported(source, module, is_package, modules):
        at = f"{where}:{line} -> {target}"
        if target.split(".")[0] in ("vllm", COMPUTED) and where not in VLLM_IMPORTERS:
            out.append(f"{at}: only {', '.join(VLLM_IMPORTERS)} import vLLM (or a module named at run time)")
        if not _within(target, "dynvocab"):
            continue
        theirs = floor(target)
        if theirs is None:
            out.append(f"{at}: {target} has no floor")
        elif theirs > own:
            out.append(f"{at}: an upward arrow (floor {own} imports floor {theirs})")
        for (a, b), why in APART.items():
            if (_within(module, a) and _within(target, b)) or (_within(module, b) and _within(target, a)):
                out.append(f"{at}: {a} and {b} never import each other; {why}")
        users = (SERVING, *SERVING_USERS)
        if _within(target, SERVING) and not any(_within(module, p) for p in users):
            out.append(f"{at}: only {SERVING} itself and {', '.join(SERVING_USERS)} import the serving room")
    return out


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module under ``root`` by dotted name."""
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module under ``root`` -> the other modules under ``root`` it imports."""
    modules = package_modules(root)
    return {
        name: {t for _, t in imported(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", set(modules))
               if t in modules and t != name}
        for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop per group of modules that reach each other (a strongly connected component), as the shortest
    path from its first module back to itself: ``[a, b, …, a]``."""
    found = []
    for group in _components(graph):
        start = min(group)
        came = {start: None}
        todo = deque([start])
        while todo and "end" not in came:
            node = todo.popleft()
            for nxt in sorted(graph[node] & group):
                key = "end" if nxt == start else nxt
                if key not in came:
                    came[key] = node
                    todo.append(nxt)
        path, node = [start], came["end"]
        while node is not None:
            path.append(node)
            node = came[node]
        found.append(path[::-1])
    return sorted(found)


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_every_import_in_dynvocab_runs_down():
    modules = package_modules()
    broken = [
        v
        for name, path in modules.items()
        for v in violations(path.read_text(encoding="utf-8"), name, str(path.relative_to(PACKAGE)),
                            path.name == "__init__.py", set(modules))
    ]
    assert broken == [], "imports against dynvocab's floors:\n" + "\n".join(broken)


def test_every_module_allowed_vllm_imports_it():
    """The list stays the modules that must: a listed file that no longer imports vLLM (by name, or by a name
    computed at run time as ``serving/vllm/models.py`` does) is named; a listed file not written yet is allowed."""
    modules = package_modules()
    importers = {
        str(path.relative_to(PACKAGE))
        for name, path in modules.items()
        if any(t.split(".")[0] in ("vllm", COMPUTED) for _, t in imported(path.read_text(encoding="utf-8"), name,
                                                              path.name == "__init__.py", set(modules)))
    }
    listed = {where for where in VLLM_IMPORTERS if (PACKAGE / where).exists()}
    assert listed == importers


def test_no_module_imports_itself_in_a_circle():
    loops = [" -> ".join(loop) for loop in circles(import_graph())]
    assert loops == [], "modules that import each other:\n" + "\n".join(loops)


def test_circles_are_found_and_named_by_their_shortest_loop():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert circles(graph) == [["a", "b", "a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "x": {"y"}, "y": {"x"}}) == [["a", "b", "c", "a"],
                                                                                    ["x", "y", "x"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_checker_catches_each_kind_of_broken_arrow():
    modules = {"dynvocab.cli", "dynvocab.runtime", "dynvocab.runtime.decoding.loop", "dynvocab.runtime.selection",
               "dynvocab.artifacts", "dynvocab.artifacts.bundle", "dynvocab.serving.vllm.head"}
    up = "import torch\nfrom dynvocab.cli import main\n"
    assert violations(up, "dynvocab.runtime.decoding.loop", "runtime/decoding/loop.py", modules=modules) == [
        "runtime/decoding/loop.py:2 -> dynvocab.cli: an upward arrow (floor 5 imports floor 9)"
    ]
    relative = "def f():\n    from ... import cli\n    from ...artifacts import bundle\n"
    assert violations(relative, "dynvocab.runtime.selection.x", "runtime/selection/x.py", modules=modules) == [
        "runtime/selection/x.py:2 -> dynvocab.cli: an upward arrow (floor 5 imports floor 9)"
    ]
    assert violations("from .. import runtime\n", "dynvocab.builders", "builders/__init__.py", True, modules) == [
        "builders/__init__.py:1 -> dynvocab.runtime: dynvocab.builders and dynvocab.runtime never import each other; "
        "they meet in artifacts"
    ]
    assert violations("from dynvocab.builders import corpus\n", "dynvocab.serving.vllm.x", "serving/vllm/x.py") == [
        "serving/vllm/x.py:1 -> dynvocab.builders: dynvocab.builders and dynvocab.serving never import each other; "
        "two rooms on one floor"
    ]
    assert violations("import dynvocab.serving.vllm.head\n", "dynvocab.artifacts.export", "artifacts/export.py") == [
        "artifacts/export.py:1 -> dynvocab.serving.vllm.head: an upward arrow (floor 4 imports floor 6)",
        "artifacts/export.py:1 -> dynvocab.serving.vllm.head: only dynvocab.serving itself and dynvocab.bench import "
        "the serving room",
    ]
    assert violations("from dynvocab import __version__\n", "dynvocab.version2", "version2.py") == [
        "version2.py: dynvocab.version2 has no floor; add its package to FLOORS in tests/test_import_rules.py"
    ]
    dynamic = "import importlib\nimportlib.import_module('vllm.model_executor')\n"
    assert [v.split(": ")[0] for v in violations(dynamic, "dynvocab.models.x", "models/x.py")] == [
        "models/x.py:2 -> vllm.model_executor"
    ]
    computed = "def f(name):\n    return __import__(name)\n"
    assert [v.split(": ")[0] for v in violations(computed, "dynvocab.models.x", "models/x.py")] == [
        f"models/x.py:2 -> {COMPUTED}"
    ]
    assert violations(computed, "dynvocab.serving.vllm.models", "serving/vllm/models.py") == []
    assert violations("from vllm import LLM\n", "dynvocab.serving.vllm.models", "serving/vllm/models.py") == []
    assert violations("from dynvocab import api\n", "dynvocab.bench.x", "bench/x.py", modules={"dynvocab.api"}) == [
        "bench/x.py:1 -> dynvocab.api: an upward arrow (floor 7 imports floor 8)"
    ]
    assert violations("from dynvocab import DynvocabError\n", "dynvocab.cli.x", "cli/x.py") == [
        "cli/x.py:1 -> dynvocab: an upward arrow (floor 9 imports floor 10)"  # the package face
    ]
