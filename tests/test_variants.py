"""Variants cannot drift from their parents: shared functions are AST-identical unless declared changed.

Every script in algos/ and worldmodels/ carries header lines `Parent: none` or
`Parent: algos/grpo.py; changed: name1, name2, ...` (a script copied from two files has two such lines).
Each top-level function or class a variant shares by name with a parent, and does not list as changed, must
be an exact copy (same AST, docstrings included), so a fix to the parent cannot silently miss a copy, and
`diff parent variant` shows the idea and nothing else. A name listed as changed must really differ.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for d in ("algos", "worldmodels") for p in (ROOT / d).glob("*.py") if not p.name.startswith("_"))
MAX_FUNCTION_LINES = 100


def parent_lines(path: Path) -> list[tuple[str, set[str]]]:
    """[(parent path or 'none', {changed names})] from the header docstring.

    The changed list may wrap lines; it ends at a period, a blank line or any other punctuation.
    """
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    out = []
    for m in re.finditer(r"^Parent: (none|[\w/]+\.py)(?:;\s*changed:((?:[\w, \t]|\n(?!\s*\n))*))?", doc, re.M):
        parent = m.group(1)
        changed = {n for n in re.split(r"[\s,]+", (m.group(2) or "").strip()) if n}
        out.append((parent, changed))
    return out


def top_level(path: Path) -> dict[str, ast.AST]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_header_names_its_parent(path):
    parents = parent_lines(path)
    assert parents, f"{path.name}: header has no 'Parent: none' or 'Parent: algos/x.py; changed: ...' line"
    for parent, _ in parents:
        assert parent == "none" or (ROOT / parent).is_file(), f"{path.name}: parent {parent} does not exist"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_unchanged_functions_are_exact_copies_of_the_parent(path):
    mine = top_level(path)
    for parent, changed in parent_lines(path):
        if parent == "none":
            continue
        theirs = top_level(ROOT / parent)
        drifted = [n for n in sorted(set(mine) & set(theirs) - changed)
                   if ast.dump(mine[n]) != ast.dump(theirs[n])]
        assert not drifted, (f"{path.name}: {drifted} differ from {parent} but are not listed as changed "
                             f"(copy the parent's version, or add them to the 'changed:' list)")
        not_in_parent = sorted(changed - set(theirs))
        assert not not_in_parent, f"{path.name}: 'changed' lists {not_in_parent}, which {parent} does not define"
        unchanged = [n for n in sorted(changed & set(mine)) if ast.dump(mine[n]) == ast.dump(theirs[n])]
        assert not unchanged, f"{path.name}: 'changed' lists {unchanged}, which are identical to {parent}'s"


def test_drift_is_caught(tmp_path):
    """The rule itself can fail: a one-character edit of a copied function is reported."""
    parent = tmp_path / "p.py"
    parent.write_text('"""Parent: none"""\ndef f(x):\n    return x + 1\n\ndef g():\n    return 0\n')
    child = tmp_path / "c.py"
    child.write_text('"""Parent: p.py; changed: g"""\ndef f(x):\n    return x + 2\n\ndef g():\n    return 1\n')
    mine, theirs = top_level(child), top_level(parent)
    (p, changed), = parent_lines(child)
    assert p == "p.py" and changed == {"g"}
    assert ast.dump(mine["f"]) != ast.dump(theirs["f"])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_long_functions_without_a_reason(path):
    """A function over 100 lines must be named in the header with the reason (`Long functions: name (why)`)."""
    src = path.read_text()
    doc = ast.get_docstring(ast.parse(src)) or ""
    excused = re.search(r"^Long functions:(.*?)(?:\n\s*\n|\Z)", doc, re.M | re.S)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n_lines = node.end_lineno - node.lineno + 1
            if n_lines > MAX_FUNCTION_LINES:
                assert excused and re.search(rf"\b{node.name}\b", excused.group(1)), \
                    f"{path.name}: {node.name} has {n_lines} lines; split it or say why under 'Long functions:'"
