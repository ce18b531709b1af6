"""docs/code-map.md is the tree's: regenerated from the packages' and modules'
docstrings (``scripts/code_map.py``), it must equal what the page says."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _code_map() -> ModuleType:  # a module loaded from a path
    spec = importlib.util.spec_from_file_location("code_map", REPO / "scripts" / "code_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_code_map_is_the_trees() -> None:
    code_map = _code_map()
    assert code_map.PAGE == REPO / "docs" / "code-map.md"
    assert code_map.PAGE.read_text() == code_map.render(), (
        "docs/code-map.md is stale: run `.venv/bin/python scripts/code_map.py --write`")


def test_the_page_says_how_to_regenerate_it() -> None:
    header = _code_map().render().split("\n\n")[1]
    assert "`.venv/bin/python scripts/code_map.py --write`" in header


def test_write_reports_a_change_once(tmp_path: Path) -> None:
    code_map = _code_map()
    page = tmp_path / "code-map.md"
    assert code_map.write(page) is True
    assert code_map.write(page) is False
    assert page.read_text() == code_map.render()


def test_every_package_and_module_says_what_it_owns() -> None:
    code_map = _code_map()
    for folder in code_map.packages():
        for path in folder.glob("*.py"):
            assert code_map._doc(path), (
                f"{path.relative_to(REPO)} has no docstring: the code map shows it")
