"""pdserve's modules import each other without a circle, counting imports inside
functions too (grimp sees every import statement): a function-level import may keep an
optional dependency lazy, never hide a circle."""

from __future__ import annotations

import graphlib

import grimp
import pytest


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in ``graph`` (module -> modules it imports), or None."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_no_module_of_pdserve_is_in_an_import_circle() -> None:
    modules = grimp.build_graph("pdserve", cache_dir=None)
    graph = {m: modules.find_modules_directly_imported_by(m) for m in modules.modules}
    assert import_cycle(graph) is None


@pytest.mark.parametrize(("graph", "circle"), [
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
])
def test_the_check_finds_a_circle_where_there_is_one(graph: dict[str, set[str]],
                                                      circle: bool) -> None:
    assert (import_cycle(graph) is not None) is circle
