"""Every tool under bench/ and scripts/ starts as its docs say: `python bench/X.py --help` from the root
of a fresh clone (the tracked files alone, no PYTHONPATH), without an import error."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = sorted(p.relative_to(ROOT) for folder in ("bench", "scripts") for p in (ROOT / folder).glob("*.py"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository's tracked files, as a fresh clone has them (no caches, runs or built models)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    out = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, out / name)
    return out


def test_every_tool_answers_help_from_a_fresh_clone(clone):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def help_of(tool: Path) -> tuple[Path, subprocess.CompletedProcess]:
        cmd = [sys.executable, str(tool), "--help"]
        return tool, subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=300)

    assert len(TOOLS) > 20
    with ThreadPoolExecutor(2) as pool:
        failed = [
            f"{tool}: exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
            for tool, done in pool.map(help_of, TOOLS)
            if done.returncode or "Traceback" in done.stderr
        ]
    assert not failed, "\n".join(failed)


def test_no_tool_imports_the_test_suite():
    """A tool's imports that only run past `--help` are held too: none may reach into `tests`, which a
    tool started as `python bench/X.py` cannot import."""
    reaching = []
    for tool in TOOLS:
        for node in ast.walk(ast.parse((ROOT / tool).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            reaching += [f"{tool}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not reaching, "\n".join(reaching)
