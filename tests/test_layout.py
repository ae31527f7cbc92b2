"""The package's shape, as docs/architecture.md draws it: files of at most 400 lines and functions of
at most 60 (`train()`, the loop, on one screen: 45), no import circle, and every import pointing
down: the core imports only the core, a wing the core and the machinery wings (`rollout/`,
`learner/`), the face anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "m2po_cli"
WINGS = ("train", "eval", "inspection", "rollout", "learner")
MACHINERY = ("rollout", "learner")  # the wings the command wings build on
FACE = ("cli", "__main__")
MODULES = {
    ".".join(("m2po_cli", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in sorted(PACKAGE.rglob("*.py"))
}


def room(module: str) -> str:
    """`face`, a wing's name, or `core` (the top-level modules and the recipe schema's folder)."""
    part = module.split(".")[1] if module.count(".") else ""
    return "face" if part in FACE else part if part in WINGS else "core"


def imports(module: str, top_level_only: bool) -> set[str]:
    """The package's modules `module` imports (at module level only, or anywhere in it)."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name in MODULES and name != module}


def test_no_file_over_400_lines_and_no_function_over_60():
    too_long = [f"{m}: {len(p.read_text().splitlines())} lines" for m, p in MODULES.items()
                if len(p.read_text().splitlines()) > 400]  # fmt: skip
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = 45 if (module, node.name) == ("m2po_cli.train.loop", "train") else 60
                if node.end_lineno - node.lineno + 1 > limit:
                    too_long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, "\n".join(too_long)


def test_no_import_circle():
    graph = {m: imports(m, top_level_only=True) for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail("import circle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_imports_point_down():
    allowed = {"core": {"core"}, "face": {"face", "core", *WINGS}}
    allowed |= {w: {"core", w} for w in MACHINERY}
    allowed |= {w: {"core", w, *MACHINERY} for w in WINGS if w not in MACHINERY}
    upward = [
        f"{m} ({room(m)}) imports {other} ({room(other)})"
        for m in MODULES
        for other in sorted(imports(m, top_level_only=False))
        if room(other) not in allowed[room(m)]
    ]
    assert not upward, "\n".join(upward)
