"""The README's map of the code matches the tree: a newcomer reading it finds every module, and every file it
names is there; every module says what it holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "batch_pipeline"


def reading_section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Reading the code")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end >= 0 else None]


def modules() -> list[Path]:
    return sorted(
        path.relative_to(PACKAGE)
        for path in PACKAGE.rglob("*.py")
        if "store/migrations/versions" not in path.as_posix() or path.name != "__init__.py"
    )


def test_every_module_is_on_the_readme_map():
    section = reading_section()
    unnamed = [
        str(module)
        for module in modules()
        if module.name != "__init__.py"
        and "migrations" not in module.parts
        and module.as_posix() not in section
        and module.name not in section
    ]
    assert not unnamed, f"modules the README's 'Reading the code' does not name: {unnamed}"


def test_every_file_the_map_names_exists():
    named = set(re.findall(r"`([a-z_]+/[a-z_]+\.py)", reading_section()))
    assert named, "the map names no file"
    missing = sorted(path for path in named if not (PACKAGE / path).exists())
    assert not missing, f"the README's 'Reading the code' names files that are not in batch_pipeline/: {missing}"


def test_every_module_says_what_it_holds():
    silent = [
        str(module)
        for module in modules()
        if "versions" not in module.parts and not ast.get_docstring(ast.parse((PACKAGE / module).read_text()))
    ]
    assert not silent, f"modules without a docstring: {silent}"


def test_every_test_the_guarantees_table_names_exists():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Guarantees") : readme.index("\n## ", readme.index("## Guarantees") + 1)]
    missing, named = [], 0
    for row in table.splitlines():
        module = None  # `::test_y` names a test of the module named last in the row
        for file_part, test_part in re.findall(r"`(test_[a-z0-9_]+)?(::test_[a-z0-9_]+)?`", row):
            module = file_part or module
            if module is None:
                continue
            path = REPO / "tests" / f"{module}.py"
            named += 1
            if not path.exists() or (test_part and f"def {test_part[2:]}(" not in path.read_text()):
                missing.append(f"{module}{test_part}")
    assert named > 50, "the table names no test"
    assert not missing, f"the README's guarantees name tests that do not exist: {missing}"
