"""Repository rules: self-contained scripts, complete headers, a small tested common.py, a README that stands alone."""
import ast
import functools
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
    """common.py holds what every family shares, in at most 700 lines (the LLM scripts' flags, tasks and optimiser
    step live in algos/_llm.py); every function of both has a unit test."""
    src = (ROOT / "common.py").read_text()
    assert len(src.splitlines()) <= 700, "common.py is over its 700-line budget"
    tests = (ROOT / "tests" / "test_common.py").read_text() + (ROOT / "tests" / "test_llm.py").read_text()
    for path in (ROOT / "common.py", ROOT / "algos" / "_llm.py"):
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        untested = [n for n in names if n not in tests]
        assert not untested, f"functions of {path.name} with no unit test: {untested}"


# ---- every flag read ----
HELPER_MODULES = {"common": ROOT / "common.py", "llm": ROOT / "algos" / "_llm.py"}


def args_reads(tree: ast.AST, names=("args",)) -> set[str]:
    """Attributes read from a variable called `args` (or `self.args`), and getattr(args, "x") names."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            v = n.value
            if isinstance(v, ast.Name) and v.id in names or isinstance(v, ast.Attribute) and v.attr in names:
                out.add(n.attr)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and len(n.args) >= 2 \
                and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            out.add(n.args[1].value)
    return out


@functools.cache
def helper_tree(module: str) -> ast.Module:
    """common.py or algos/_llm.py parsed once for the whole session (every script's flag check walks them)."""
    return ast.parse(HELPER_MODULES[module].read_text())


def helper_reads(module: str, function: str, seen=None) -> set[str]:
    """The args fields a common.py / algos/_llm.py function reads, through the helpers it passes args to as well."""
    seen = set() if seen is None else seen
    if (module, function) in seen:
        return set()
    seen.add((module, function))
    tree = helper_tree(module)
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == function), None)
    if fn is None:
        return set()
    out = args_reads(fn, ("args", "self"))
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        if any(isinstance(a, ast.Name) and a.id == "args" for a in call.args):
            f = call.func
            if isinstance(f, ast.Name):
                out |= helper_reads(module, f.id, seen)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in HELPER_MODULES:
                out |= helper_reads(f.value.id, f.attr, seen)
    return out


def unread_flags(path: Path, fields) -> list[str]:
    """Fields of the script's Args that neither the script nor a common / _llm function it passes args to reads."""
    tree = ast.parse(path.read_text())
    read = args_reads(tree) | {"exp_name"}  # LLMArgs.__post_init__ fills it in, the run folder reads it
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        f = call.func
        passes_args = any(isinstance(a, ast.Name) and a.id == "args" for a in [*call.args,
                                                                                 *(k.value for k in call.keywords)])
        if passes_args and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and f.value.id in HELPER_MODULES:
            read |= helper_reads(f.value.id, f.attr)
    return sorted(set(fields) - read)


LLM_SCRIPTS = [p for p in SCRIPTS if "(LLMArgs)" in p.read_text()]


@pytest.mark.parametrize("path", LLM_SCRIPTS, ids=lambda p: p.name)
def test_every_flag_is_read(path):
    """Every Args field, inherited ones included, is read by the script or by the common / _llm function it passes
    args to; a flag a configuration cannot honour is refused in check_args (which reads it), never ignored."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_variants import args_fields

    dead = unread_flags(path, args_fields(path))
    assert not dead, f"{path.name}: flags never read: {dead} (wire them, refuse them in check_args, or delete them)"


def test_the_flag_rule_can_fail(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import common\nfrom algos import _llm as llm\n\ndef main(args):\n"
                      "    llm.optimizer_step(None, None, args, 0, 1)\n    return args.lr_extra\n")
    fields = ["lr", "max_grad_norm", "lr_extra", "dead_flag", "warmup_steps", "lr_schedule"]
    assert unread_flags(script, fields) == ["dead_flag"]  # lr, clip and schedule: read by llm.optimizer_step


# ---- the sampler correction in every copy of the update ----
def grpo_descendants() -> list[Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_variants import parent_lines

    out, frontier = [], {"algos/grpo.py"}
    while frontier:
        children = [p for p in SCRIPTS if any(par in frontier for par, _ in parent_lines(p))]
        out += children
        frontier = {f"{p.parent.name}/{p.name}" for p in children}
    return out


def corrects_or_refuses(src: str) -> bool:
    """The module applies the truncated sampler weight where the sampler is not the trainer (it calls
    truncated_is_weight and reads .is_trainer), or refuses that case (an `if` on .is_trainer that raises)."""
    tree = ast.parse(src)
    reads = lambda n: any(isinstance(a, ast.Attribute) and a.attr == "is_trainer" for a in ast.walk(n))  # noqa: E731
    calls = any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) ==
                "truncated_is_weight" for n in ast.walk(tree))
    refuses = any(isinstance(n, ast.If) and reads(n.test) and any(isinstance(b, ast.Raise) for b in ast.walk(n))
                  for n in ast.walk(tree))
    return calls and reads(tree) or refuses


@pytest.mark.parametrize("path", grpo_descendants(), ids=lambda p: p.name)
def test_every_update_corrects_for_the_sampler(path):
    """A GRPO descendant whose update differs from grpo.py's applies the sampler-trainer weight when the sampler is
    not the trainer (a bf16 copy, vLLM), or refuses that configuration with a message."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_variants import top_level

    mine, theirs = top_level(path), top_level(ROOT / "algos" / "grpo.py")
    if "update" in mine and ast.dump(mine["update"]) == ast.dump(theirs["update"]):
        return  # grpo's own update: corrected there
    assert corrects_or_refuses(path.read_text()), \
        f"{path.name}: its own update neither applies truncated_is_weight when not sampler.is_trainer nor refuses it"


def test_the_correction_rule_can_fail():
    assert not corrects_or_refuses("def update(model, batch):\n    return model(batch)\n")
    assert corrects_or_refuses("def update(s, b):\n    w = truncated_is_weight(1, 2, 3) if not s.is_trainer else 1\n")
    assert corrects_or_refuses("def main(sampler):\n    if not sampler.is_trainer:\n        raise SystemExit('no')\n")


# ---- every equation's function is tested by name ----
def equation_functions(path: Path) -> list[str]:
    """Functions of the script named at the end of a line of its header's equation table (from the line that says
    'Equation' up to 'Parent:' or 'Deviations'), less exact copies of a parent's (the parent's tests cover those)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_variants import parent_lines, top_level

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    table = re.search(r"^[^\n]*Equation[^\n]*$(.*?)^(?:Parent:|Deviations)", doc, re.M | re.S | re.I)
    mine = top_level(path)
    named = {m for line in (table.group(1) if table else "").splitlines()
             for m in re.findall(r"\b([A-Za-z_]\w*)\s*$", line) if m in mine}
    for parent, _ in parent_lines(path):
        theirs = top_level(ROOT / parent) if parent != "none" else {}
        named -= {n for n in named if n in theirs and ast.dump(mine[n]) == ast.dump(theirs[n])}
    return sorted(named)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_equation_functions_are_tested_by_name(path):
    tests = "".join(t.read_text() for t in (ROOT / "tests").glob(f"test_*{path.stem}*.py"))
    untested = [n for n in equation_functions(path) if not re.search(rf"\b{n}\b", tests)]
    assert not untested, f"{path.name}: equation functions {untested} are not exercised by name in its tests"


def test_the_equation_rule_can_fail(tmp_path):
    script = tmp_path / "s.py"
    script.write_text('"""S.\n\nEquations:\n  A = r - mean(r)     centred\n  J = -A log p     loss_fn\n\n'
                      'Parent: none\n"""\n\ndef centred(r):\n    return r\n\ndef loss_fn(a):\n    return a\n')
    assert equation_functions(script) == ["centred", "loss_fn"]


def test_world_model_tests_say_so():
    """A world-model script's tests are tests/test_wm_<name>.py, so a reader sees they belong to worldmodels/."""
    for path in (ROOT / "worldmodels").glob("*.py"):
        if not path.name.startswith("_"):
            assert (ROOT / "tests" / f"test_wm_{path.stem}.py").exists(), f"no tests/test_wm_{path.stem}.py"


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
    extended = f"{cmd} -m extended"  # the long checks the suite leaves out (pytest.ini): CI runs them too
    assert extended in readme and any(line.startswith(extended) for line in ci.splitlines())


def marks_of(path: Path) -> dict[str, set[str]]:
    """{test function: the names of its pytest.mark decorators} of one test file."""
    marks = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            names = set()
            for d in node.decorator_list:
                d = d.func if isinstance(d, ast.Call) else d
                if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Attribute) and d.value.attr == "mark":
                    names.add(d.attr)
            marks[node.name] = names
    return marks


def test_the_extended_checks_leave_each_scripts_learning_in_the_suite():
    """The README's test command skips the `extended` mark (pytest.ini), so an extended test is one whose file keeps a
    learning test in the suite (a test named for learning that is not extended), and it is also `slow`, so the quick
    command (-m "not slow") and CI's AVX2 pass skip it as before."""
    found = 0
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        marks = marks_of(path)
        extended = [t for t, m in marks.items() if "extended" in m]
        found += len(extended)
        assert all("slow" in marks[t] for t in extended), (path.name, extended)
        if any("learn" in t for t in extended):
            assert any("learn" in t and "extended" not in m for t, m in marks.items()), \
                f"{path.name}: its only learning tests are extended, so the suite never shows that script learning"
    assert found >= 4


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


def table_width_errors(text: str) -> list[str]:
    """Rows of a markdown table whose cell count differs from its header's (code spans and escaped pipes aside)."""
    errors, width = [], None
    for k, line in enumerate(text.split("\n"), 1):
        if not line.startswith("|"):
            width = None
            continue
        n = len(re.findall(r"(?<!\\)\|", re.sub(r"`[^`]*`", "", line)))
        if width is None:
            width = n
        elif n != width:
            errors.append(f"line {k}: {n - 1} cells, the header {width - 1}")
    return errors


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.md")) +
                         [ROOT / "README.md", ROOT / "benchmarks" / "README.md"], ids=lambda p: p.name)
def test_markdown_tables_keep_their_width(path):
    assert not table_width_errors(path.read_text())


def test_the_table_width_rule_can_fail():
    assert table_width_errors("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n\n| c |\n|---|\n| `x | y` |") == [
        "line 3: 3 cells, the header 2"]
