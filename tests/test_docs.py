"""Every Python block in the README and docs/ parses and its imports resolve; the blocks marked
``<!-- doc: runs -->`` run, in order, in one namespace per page (each takes seconds on CPU).

A block marked ``<!-- doc: excerpt of PATH -->`` is lines of that script, which exists and which
the page links: each of its lines is checked to be in the script as written. Every block of the
README is one or the other: its first hour runs as written, or says where the whole script is.

A block of docs/ that needs a GPU, a download or minutes (a Trainer, a Llama-3-8B fit) is checked
for its imports only: an API renamed under it still fails here.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:<!-- doc: (?P<mark>runs|excerpt of (?P<script>\S+)) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks(page: pathlib.Path) -> list[tuple[str | None, str | None, str]]:
    """(mark: "runs", "excerpt" or None; the excerpt's script; code) of each Python block."""
    return [((m["mark"] or "").split(" ")[0] or None, m["script"], m["code"]) for m in BLOCK.finditer(page.read_text())]


def test_pages_have_python_examples():
    assert README.stat().st_size < 12 * 1024, "the README is the short front door (< 12 KB)"
    assert sum(mark == "runs" for page in PAGES for mark, _, _ in _blocks(page)) >= 2, "no runnable example found"


def test_readme_blocks_run_or_are_excerpts():
    unmarked = [k + 1 for k, (mark, _, _) in enumerate(_blocks(README)) if mark is None]
    assert not unmarked, f"README python blocks {unmarked}: mark them <!-- doc: runs --> or <!-- doc: excerpt of PATH -->"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_excerpts_are_lines_of_their_linked_script(page):
    text = page.read_text()
    for k, (mark, script, code) in enumerate(_blocks(page)):
        if mark != "excerpt":
            continue
        where = f"{page.name}, python block {k + 1}"
        path = (page.parent / script).resolve()
        assert path.is_file(), f"{where}: {script} not found"
        assert f"]({script})" in text, f"{where}: the page does not link {script}"
        whole = {line.strip() for line in path.read_text().splitlines()}
        for line in code.splitlines():
            assert not line.strip() or line.strip() in whole, f"{where}: not a line of {script}: {line.strip()!r}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_examples_parse_import_and_run(page):
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for k, (mark, _, code) in enumerate(_blocks(page)):
        where = f"{page.name}, python block {k + 1}"
        tree = ast.parse(code, filename=where)
        if mark == "runs":
            exec(compile(tree, where, "exec"), namespace)
            continue
        imports = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
        exec(compile(imports, where, "exec"), {})


def test_long_context_figures_give_their_command():
    """The README's longest-context figure comes with the command that gives it, flags included
    (the 8-bit paged optimizer and the host budget among them): the line after the figure."""
    text = README.read_text()
    figure = text.index("164,864 tokens on 24 GiB")
    command = text[figure:].split("```sh\n", 1)[1].split("```", 1)[0]
    for flag in ("--model llama-3.1-8b", "--lora 16", "--load-in-4bit", "--optim paged_adamw8bit", "--memory 24GiB",
                 "--host-memory 48GiB", "--max-seq"):
        assert flag in command, flag


def test_cited_files_exist():
    """Each test, bench script and example a page cites by path is there (files move: tests/<room>/)."""
    missing = []
    for page in PAGES:
        for path in re.findall(r"\b((?:tests|bench|examples)/[\w/]+\.(?:py|sh))\b", page.read_text()):
            if not (ROOT / path).is_file():
                missing.append(f"{page.name} -> {path}")
    assert not missing, missing


def test_checkpointing_flag_gives_both_names():
    """transformers 5.25 names it activation_checkpointing=True (gradient_checkpointing=True is its
    deprecated alias); the versions the package allows before it know only the old name. Where a
    page writes the old name, the same paragraph gives the new one."""
    for page in PAGES:
        for paragraph in page.read_text().split("\n\n"):
            if "gradient_checkpointing=True" in paragraph:
                assert "activation_checkpointing=True" in paragraph, f"{page.name}: {paragraph[:200]}"


def test_links_between_pages_resolve():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            if not (page.parent / target).exists():
                missing.append(f"{page.name} -> {target}")
    assert not missing, missing
