"""Every Python block in the README and docs/ parses and its imports resolve; the blocks marked
``<!-- doc: runs -->`` run, in order, in one namespace per page (each takes seconds on CPU).

A block that needs a GPU, a download or minutes (a Trainer, a Llama-3-8B fit) is checked for its
imports only: an API renamed under it still fails here.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RUNS = "<!-- doc: runs -->"
BLOCK = re.compile(r"(?P<mark><!-- doc: runs -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks(page: pathlib.Path) -> list[tuple[bool, str]]:
    return [(bool(m["mark"]), m["code"]) for m in BLOCK.finditer(page.read_text())]


def test_pages_have_python_examples():
    assert (ROOT / "README.md").stat().st_size < 12 * 1024, "the README is the short front door (< 12 KB)"
    assert sum(run for page in PAGES for run, _ in _blocks(page)) >= 2, "no runnable example found"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_examples_parse_import_and_run(page):
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for k, (runs, code) in enumerate(_blocks(page)):
        where = f"{page.name}, python block {k + 1}"
        tree = ast.parse(code, filename=where)
        if runs:
            exec(compile(tree, where, "exec"), namespace)
            continue
        imports = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
        exec(compile(imports, where, "exec"), {})


def test_links_between_pages_resolve():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            if not (page.parent / target).exists():
                missing.append(f"{page.name} -> {target}")
    assert not missing, missing
