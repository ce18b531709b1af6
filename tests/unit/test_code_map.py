"""README's code map is the tree's: regenerated from the packages' and modules'
docstrings (``scripts/code_map.py``), it must equal what README says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _code_map():  # noqa: ANN202 - a module loaded from a path
    spec = importlib.util.spec_from_file_location("code_map", REPO / "tools" / "code_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_code_map_is_the_trees() -> None:
    code_map = _code_map()
    readme = (REPO / "README.md").read_text()
    start, end = readme.index(code_map.BEGIN), readme.index(code_map.END) + len(code_map.END)
    assert readme[start:end] == code_map.render(), (
        "README's code map is stale: run `python scripts/code_map.py --write`")


def test_every_package_and_module_says_what_it_owns() -> None:
    code_map = _code_map()
    for folder in code_map.packages():
        for path in folder.glob("*.py"):
            assert code_map._doc(path), (
                f"{path.relative_to(REPO)} has no docstring: the code map shows it")
