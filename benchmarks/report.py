"""Regenerate the README's result sections from committed files in benchmarks/results/.

Every benchmark script writes its table as `benchmarks/results/<name>.md` (built from its CSV). The README
holds matching blocks:

    <!-- results:<name> -->
    ...replaced...
    <!-- /results:<name> -->

`python benchmarks/report.py` replaces each block's body with the file's content; `--check` exits 1 when
the README is out of date (the tests use it).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- results:([\w\-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def render(readme: str) -> str:
    def fill(m: re.Match) -> str:
        path = RESULTS / f"{m.group(2)}.md"
        body = path.read_text().rstrip() + "\n" if path.exists() else f"*(no results yet: {path.name})*\n"
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(fill, readme)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = ap.parse_args()
    readme_path = ROOT / "README.md"
    old = readme_path.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md is out of date: run `python benchmarks/report.py`", file=sys.stderr)
            return 1
        return 0
    readme_path.write_text(new)
    print(f"README.md: {len(BLOCK.findall(new))} result blocks refreshed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
