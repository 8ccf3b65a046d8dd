"""Repository rules: self-contained scripts, complete headers, a small tested common.py, a README that stands alone."""
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for d in ("algos", "worldmodels") for p in (ROOT / d).glob("*.py") if not p.name.startswith("_"))
# every Python file of the project's code, helpers included (the tests are not held to the function length)
CODE = [ROOT / "common.py"] + sorted(p for d in ("algos", "worldmodels", "kernels", "benchmarks")
                                     for p in (ROOT / d).glob("*.py"))
MAX_FUNCTION_LINES = 80


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in ("algos", "worldmodels"):  # `from algos import x` imports algos.x
                mods |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                mods.add(node.module)
    return mods


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_never_import_scripts(path):
    for mod in imported_modules(path):
        top, _, rest = mod.partition(".")
        if top in ("algos", "worldmodels"):
            assert rest.startswith("_"), f"{path.name} imports the script {mod}"
        sibling = ROOT / path.parent.name / f"{top}.py"
        assert not (sibling.exists() and not top.startswith("_")), f"{path.name} imports sibling script {top}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_headers(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert len(doc) > 300, f"{path.name}: header docstring too short"
    assert re.search(r"deviation", doc, re.I), f"{path.name}: header lists no deviations"
    assert f"python {path.parent.name}/{path.name}" in doc, f"{path.name}: header gives no command"
    assert re.search(r"expected|result", doc, re.I), f"{path.name}: header states no expected result"
    src = path.read_text()
    assert "def main(" in src and '__name__ == "__main__"' in src, f"{path.name}: no main()"
    assert "class Args" in src, f"{path.name}: no Args dataclass"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_script_has_a_test_and_a_readme_row(path):
    assert list((ROOT / "tests").glob(f"test_*{path.stem}*.py")), f"no tests/test_*{path.stem}*.py"
    assert f"{path.parent.name}/{path.name}" in (ROOT / "README.md").read_text(), f"{path.name} not in README"


def test_common_budget_and_every_function_tested():
    src = (ROOT / "common.py").read_text()
    # 600 lines of plumbing, plus the room that the long-response task and the evaluation / summary / curve helpers
    # (moved in from nine scripts, where they were copies) took, and the scale-out plumbing (FSDP2 sharding, sharded
    # checkpoints, the word-problem task a pretrained model learns on); a helper that fewer than three scripts use leaves
    assert len(src.splitlines()) <= 860, "common.py is over its 860-line budget"
    tree = ast.parse(src)
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    tests = (ROOT / "tests" / "test_common.py").read_text()
    untested = [n for n in names if n not in tests]
    assert not untested, f"functions of common.py with no unit test: {untested}"


def test_readme_results_are_current():
    out = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_readme_is_a_short_entry_point():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is over 200 lines: results belong in benchmarks/README.md"
    assert "benchmarks/README.md" in readme, "README.md does not link to benchmarks/README.md"


# The repository stands alone: no catalogue ids of the paper abstracts the project started from (a capital A or
# B, a hyphen and a number), and no paths or documents outside it. The strings are split so that this file does
# not match itself.
OUTSIDE_REFERENCES = re.compile(r"\b[AB]-\d+\b|" + "|".join(re.escape(s) for s in
                                ("paper" + "s/", "PAPERS" + ".md", "DESIGN" + ".md", "shar" + "ed/")))


def test_no_references_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.csv", "*.sh", "*.txt"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    hits = []
    for name in files:
        path = ROOT / name
        if not path.exists():  # deleted in the working tree, not yet committed
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in OUTSIDE_REFERENCES.finditer(line):
                hits.append(f"{name}:{i}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "name papers by title and arXiv id, not by catalogue id or outside path:\n" + "\n".join(hits)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = "python -m pytest -q"
    assert cmd in readme and ci.strip().splitlines()[-1] == cmd
    assert f'{cmd} -m "not slow"' in readme, "README.md gives no quick test command beside the full one"


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces -> -."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_benchmarks_readme_contents_list_every_section():
    page = (ROOT / "benchmarks" / "README.md").read_text()
    heads = re.findall(r"^#{2,3} (.+)$", re.sub(r"^```.*?^```", "", page, flags=re.M | re.S), re.M)
    contents = page.split("\n## ", 1)[0]
    missing = [h for h in heads if f"](#{anchor(h)})" not in contents]
    assert heads and not missing, f"benchmarks/README.md: the contents list lacks the sections {missing}"
    assert anchor("Memory plan: what fits on which GPUs") == "memory-plan-what-fits-on-which-gpus"


def long_functions(src: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method, nested ones included, longer than `limit` lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


@pytest.mark.parametrize("path", CODE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_long_functions_without_a_reason(path):
    """A function reads as one idea: at most 80 lines (grpo.py's main is the model), unless the file's header names
    it with the reason (`Long functions: name (why)`)."""
    src = path.read_text()
    doc = ast.get_docstring(ast.parse(src)) or ""
    excused = re.search(r"^Long functions:(.*?)(?:\n\s*\n|\Z)", doc, re.M | re.S)
    for name, n_lines in long_functions(src):
        assert excused and re.search(rf"\b{name}\b", excused.group(1)), \
            f"{path.name}: {name} has {n_lines} lines; split it or say why under 'Long functions:' in the header"


def test_the_length_rule_can_fail():
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES + 1) == []


# Paths that the text names (headers, docstrings, comments, pages) must exist. A name followed by `*`, `{a,b}` or
# `[_x]` is a pattern and must match a file; a dotted tail names a module attribute (benchmarks/_results.append_rows).
# The placeholders of the README's how-to-add-a-method steps and of the header rules are the only missing names.
NAMED_PATH = re.compile(r"(?<![\w./-])((?:algos|benchmarks|worldmodels|kernels|tests)/[\w./-]*\w|common\.py)"
                        r"(\.?[*{\[])?")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
PLACEHOLDERS = {"algos/my_idea.py", "tests/test_my_idea.py", "algos/x.py"}


def text_lines(path: Path):
    """(line number, text) of a page, or of the comments and strings (docstrings included) of a Python file."""
    src = path.read_text()
    if path.suffix == ".md":
        yield from enumerate(src.splitlines(), 1)
        return
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for i, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, line


def dangling_paths(root: Path, names: list[str]) -> list[str]:
    hits = []
    for name in names:
        path = root / name
        if not path.exists():  # deleted in the working tree, not yet committed
            continue
        for n, line in text_lines(path):
            for m in NAMED_PATH.finditer(line):
                p, pattern = m.groups()
                found = (any(root.glob(p + "*")) if pattern else (root / p).exists()
                         or (root / (p.rsplit(".", 1)[0] + ".py")).exists())
                if not found and p not in PLACEHOLDERS:
                    hits.append(f"{name}:{n}: {p}")
            if path.suffix == ".md":  # relative links; a results fragment's links are relative to the page it joins
                for m in MD_LINK.finditer(line):
                    t = m.group(1)
                    if not re.match(r"[a-z]+:", t) and not any((d / t).exists() for d in
                                                               (path.parent, path.parent.parent, root)):
                        hits.append(f"{name}:{n}: link {t}")
    return hits


def test_named_paths_exist():
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py", "*.md"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    hits = dangling_paths(ROOT, [n for n in names if n != "tests/test_repo_rules.py"])  # its examples are made up
    assert not hits, "text names files that do not exist:\n" + "\n".join(hits)


def test_the_path_rule_can_fail(tmp_path):
    (tmp_path / "algos").mkdir()
    (tmp_path / "algos" / "a.py").write_text('"""See algos/b.py and algos/a.py, tests/test_*.py."""\n'
                                             '# benchmarks/x.md\n')
    (tmp_path / "README.md").write_text("[a](algos/a.py) [b](algos/c.py) `algos/my_idea.py`\n")
    assert dangling_paths(tmp_path, ["algos/a.py", "README.md"]) == [
        "algos/a.py:1: algos/b.py", "algos/a.py:1: tests/test_", "algos/a.py:2: benchmarks/x.md",
        "README.md:1: algos/c.py", "README.md:1: link algos/c.py"]
