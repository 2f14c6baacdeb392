"""The docs' map of the code (docs/architecture.md, "Reading the code") matches the tree: a newcomer reading it
finds every module, and every file it names is there; every module says what it holds; every test the
guarantees page (docs/guarantees.md) names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "batch_pipeline"
ARCHITECTURE = REPO / "docs" / "architecture.md"
GUARANTEES = REPO / "docs" / "guarantees.md"


def reading_section() -> str:
    page = ARCHITECTURE.read_text()
    assert page.startswith("# Reading the code\n"), f"{ARCHITECTURE} is no longer the map of the code"
    return page


def modules() -> list[Path]:
    return sorted(
        path.relative_to(PACKAGE)
        for path in PACKAGE.rglob("*.py")
        if "store/migrations/versions" not in path.as_posix() or path.name != "__init__.py"
    )


def test_every_module_is_on_the_docs_map():
    section = reading_section()
    unnamed = [
        str(module)
        for module in modules()
        if module.name != "__init__.py"
        and "migrations" not in module.parts
        and module.as_posix() not in section
        and module.name not in section
    ]
    assert not unnamed, f"modules docs/architecture.md ('Reading the code') does not name: {unnamed}"


def test_every_file_the_map_names_exists():
    named = set(re.findall(r"`([a-z_]+/[a-z_]+\.py)", reading_section()))
    assert named, "the map names no file"
    missing = sorted(path for path in named if not (PACKAGE / path).exists())
    assert not missing, (
        f"docs/architecture.md ('Reading the code') names files that are not in batch_pipeline/: {missing}"
    )


def test_every_module_says_what_it_holds():
    silent = [
        str(module)
        for module in modules()
        if "versions" not in module.parts and not ast.get_docstring(ast.parse((PACKAGE / module).read_text()))
    ]
    assert not silent, f"modules without a docstring: {silent}"


def test_every_test_the_guarantees_table_names_exists():
    page = GUARANTEES.read_text()
    table = page[page.index("| guarantee | test |") : page.index("**Runs heal themselves.**")]
    missing, named = [], 0
    for row in table.splitlines():
        module = None  # `::test_y` names a test of the module named last in the row
        for file_part, test_part in re.findall(r"`(test_[a-z0-9_]+)?(::test_[a-z0-9_]+)?`", row):
            module = file_part or module
            if module is None:
                continue
            # Tests live as the package does (tests/<package>/test_x.py): a module is named by its file alone.
            paths = list((REPO / "tests").rglob(f"{module}.py"))
            named += 1
            if len(paths) != 1 or (test_part and f"def {test_part[2:]}(" not in paths[0].read_text()):
                missing.append(f"{module}{test_part}")
    assert named > 50, "the table names no test"
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
