"""Variants cannot drift from their parents: shared functions are AST-identical unless declared changed.

Every script in algos/ and worldmodels/ carries header lines `Parent: none` or
`Parent: algos/grpo.py; changed: name1, name2, ...` (a script copied from two files has two such lines).
Each top-level function or class a variant shares by name with a parent, and does not list as changed, must
be an exact copy (same AST, docstrings included), so a fix to the parent cannot silently miss a copy, and
`diff parent variant` shows the idea and nothing else. A name listed as changed must really differ.
"""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for d in ("algos", "worldmodels") for p in (ROOT / d).glob("*.py") if not p.name.startswith("_"))


def parent_lines(path: Path) -> list[tuple[str, set[str]]]:
    """[(parent path or 'none', {changed names})] from the header docstring.

    The changed list may wrap lines; it ends at a period, a blank line or any other punctuation.
    """
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    out = []
    for m in re.finditer(r"^Parent: (none|[\w/]+\.py)(?:;\s*changed:((?:[\w, \t]|\.(?=\w)|\n(?!\s*\n))*))?", doc, re.M):
        parent = m.group(1)
        changed = {n for n in re.split(r"[\s,]+", (m.group(2) or "").strip()) if n}
        out.append((parent, changed))
    return out


def class_fields(tree: ast.Module, name: str) -> dict[str, str]:
    """Each field of the module's class `name` -> the dump of its annotation, default and docstring; fields of a base
    class defined in an underscore helper of algos/ (LLMArgs in algos/_llm.py) come first, as the dataclass sees them."""
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    body, out = (cls.body if cls else []), {}
    for base in cls.bases if cls else []:
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        for helper in sorted((ROOT / "algos").glob("_*.py")):
            helper_tree = ast.parse(helper.read_text())
            if any(isinstance(n, ast.ClassDef) and n.name == base_name for n in helper_tree.body):
                out.update(class_fields(helper_tree, base_name))
                break
    for i, n in enumerate(body):
        if isinstance(n, ast.AnnAssign):
            doc = body[i + 1] if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) else None
            out[n.target.id] = ast.dump(n) + (ast.dump(doc) if doc else "")
    return out


def args_fields(path: Path) -> dict[str, str]:
    """Each field of the script's `Args` dataclass, inherited ones included -> its annotation, default and docstring."""
    return class_fields(ast.parse(path.read_text()), "Args")


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
        changed = {n for n in changed if not n.startswith("Args.")}  # fields: test_unlisted_args_fields_...
        drifted = [n for n in sorted(set(mine) & set(theirs) - changed)
                   if ast.dump(mine[n]) != ast.dump(theirs[n])]
        assert not drifted, (f"{path.name}: {drifted} differ from {parent} but are not listed as changed "
                             f"(copy the parent's version, or add them to the 'changed:' list)")
        not_in_parent = sorted(changed - set(theirs))
        assert not not_in_parent, f"{path.name}: 'changed' lists {not_in_parent}, which {parent} does not define"
        unchanged = [n for n in sorted(changed & set(mine)) if ast.dump(mine[n]) == ast.dump(theirs[n])]
        assert not unchanged, f"{path.name}: 'changed' lists {unchanged}, which are identical to {parent}'s"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_unlisted_args_fields_are_the_parents(path):
    """A field of Args shared with the parent has the parent's type, default and docstring unless the header lists
    it (`changed: Args.lr, ...`); a field it lists really differs. Fields the parent lacks are the variant's own."""
    mine = args_fields(path)
    for parent, changed in parent_lines(path):
        theirs, listed = args_fields(ROOT / parent) if parent != "none" else {}, {n[5:] for n in changed if n.startswith("Args.")}
        drifted = sorted(f for f in set(mine) & set(theirs) - listed if mine[f] != theirs[f])
        assert not drifted, f"{path.name}: Args fields {drifted} differ from {parent}'s; copy them or list Args.<name>"
        same = sorted(f for f in listed if f not in theirs or mine.get(f) == theirs[f])
        assert not same, f"{path.name}: lists Args fields {same} that {parent} lacks or that are identical to its own"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_kept_names_are_not_rebound(path):
    """A kept function or class may not be replaced further down the module (`k3_kl = lambda ...` after the def)."""
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    rebound = sorted({t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                      for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
                     & defined)
    assert not rebound, f"{path.name}: module-level assignments rebind {rebound}"


def borrows(path: Path) -> list[tuple[str, list[str]]]:
    """[(source path, [names])] from header lines `Borrows: algos/x.py (name1, name2)`: a file that is its own
    design (`Parent: none`) names what it copies, and those copies are checked like a parent's."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [(m.group(1), [n for n in re.split(r"[\s,]+", m.group(2)) if n])
            for m in re.finditer(r"Borrows: ([\w/]+\.py) \(([^)]*)\)", doc)]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_borrowed_functions_are_exact_copies(path):
    mine = top_level(path)
    for source, names in borrows(path):
        theirs = top_level(ROOT / source)
        drifted = [n for n in names if n not in mine or n not in theirs or ast.dump(mine[n]) != ast.dump(theirs[n])]
        assert not drifted, f"{path.name}: borrowed {drifted} are not exact copies of {source}'s"


def test_parent_links_keep_at_least_half():
    """'Parent' means the diff is the idea: each link keeps at least half of its parent's functions and classes
    (Args, check_args and main aside) as exact copies. The counts print with `pytest -s`."""
    hollow = []
    for path in SCRIPTS:
        mine = top_level(path)
        for parent, _ in parent_lines(path):
            if parent == "none":
                continue
            theirs = {n: v for n, v in top_level(ROOT / parent).items() if n not in ("Args", "check_args", "main")}
            kept = [n for n in theirs if n in mine and ast.dump(mine[n]) == ast.dump(theirs[n])]
            print(f"{path.name} <- {parent}: {len(kept)} of {len(theirs)} functions kept, "
                  f"{len(set(args_fields(path)) & set(args_fields(ROOT / parent)))} Args fields shared")
            if 2 * len(kept) < len(theirs):
                hollow.append(f"{path.name} <- {parent} ({len(kept)}/{len(theirs)})")
    assert not hollow, f"links that keep less than half of the parent: {hollow}; say 'Parent: none' and Borrows:"


# A function two variants define identically and their parents lack belongs in one place (the parent, common.py
# when it is plumbing for three scripts, or one variant becomes the other's parent). The two pool helpers of the
# prompt-pool scripts stay copies: two users, below common.py's three, and neither script is the other's parent.
SIBLING_COPIES_ALLOWED = {"draw_prompts", "make_pool"}


def sibling_copies(scripts) -> dict[str, list[str]]:
    """{function: [scripts]} for top-level functions defined identically in several scripts, absent from all their
    parents."""
    seen = {}
    for path in scripts:
        parents = [ROOT / p for p, _ in parent_lines(path) if p != "none"]
        if not parents:
            continue
        kept = set().union(*(top_level(p) for p in parents))
        for name, node in top_level(path).items():
            if name not in kept and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                seen.setdefault((name, ast.dump(node)), []).append(path.name)
    return {name: paths for (name, _), paths in seen.items() if len(paths) > 1}


def test_no_copied_sibling_functions():
    copies = {n: p for n, p in sibling_copies(SCRIPTS).items() if n not in SIBLING_COPIES_ALLOWED}
    assert not copies, f"functions copied between variants but not in their parents: {copies}"


def test_the_extended_checks_can_fail(tmp_path, monkeypatch):
    """Drift in an Args default, a rebinding of a kept name, and a function copied between two siblings each fail."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "p.py").write_text('"""Parent: none"""\nclass Args:\n    lr: float = 1.0\n    """lr"""\n\n'
                                   'def k3(x):\n    return x\n')
    child = '"""Parent: p.py; changed: Args"""\nclass Args:\n    lr: float = 2.0\n    """lr"""\n\ndef k3(x):\n    return x\n'
    (tmp_path / "c.py").write_text(child)
    with pytest.raises(AssertionError, match=r"Args fields \['lr'\] differ"):
        test_unlisted_args_fields_are_the_parents(tmp_path / "c.py")
    (tmp_path / "c.py").write_text(child.replace("changed: Args", "changed: Args, Args.lr"))
    test_unlisted_args_fields_are_the_parents(tmp_path / "c.py")  # listed: allowed
    (tmp_path / "c.py").write_text(child + "k3 = lambda x: x + 1\n")
    with pytest.raises(AssertionError, match=r"rebind \['k3'\]"):
        test_kept_names_are_not_rebound(tmp_path / "c.py")
    helper = "\ndef pool(n):\n    return list(range(n))\n"
    for name in ("c1.py", "c2.py"):
        (tmp_path / name).write_text(child.replace("changed: Args", "changed: Args, Args.lr") + helper)
    assert sibling_copies([tmp_path / "c1.py", tmp_path / "c2.py"]) == {"pool": ["c1.py", "c2.py"]}


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
