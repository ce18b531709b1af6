"""The import contracts (pyproject's ``[tool.importlinter]``: layers, the roles' rooms,
cluster control without HTTP, pure policies, protobuf at the edge) hold on the tree, and an
import against it fails ``lint-imports``: the contract is checked, not decoration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on ``tree``'s ``pdserve`` package with ``tree``'s contract."""
    env = {**os.environ, "PYTHONPATH": str(tree)}  # ``tree``'s pdserve before the installed one
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", "pyproject.toml"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    shutil.copytree(REPO / "pdserve", tree / "pdserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_the_tree_keeps_its_layers(tree_copy: Path) -> None:
    result = _lint(tree_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(("module", "upward", "rule"), [
    # the bottom layer reaching the top: shared types importing the router
    ("core/types.py", "import pdserve.router.server", "pdserve.core is not allowed to import"),
    # a host reaching into a role (roles sit on the host, not under it)
    ("worker/host.py", "import pdserve.roles.prefill.policy",
     "pdserve.worker is not allowed to import"),
    # the dispatcher reaching up into the HTTP edge
    ("router/dispatch/policies/placement.py", "import pdserve.router.http.errors",
     "pdserve.router.dispatch is not allowed to import"),
    # protobuf leaking past its edge
    ("router/dispatch/dispatcher.py", "import pdserve.proto.pdserve.v1.worker_pb2",
     "protobuf stays at the edge"),
    # one role reaching into the other's room
    ("roles/decode/policy.py", "import pdserve.roles.prefill.policy",
     "each role lives in its own room"),
    # a pure policy calling a worker, or waiting on the event loop
    ("router/dispatch/policies/slo.py", "import pdserve.router.dispatch.workers.client",
     "the dispatcher's policies are pure"),
    ("router/dispatch/policies/planner.py", "import asyncio",
     "the dispatcher's policies are pure"),
    # cluster control reaching up into the HTTP edge, or into a web framework
    ("router/cluster/roles.py", "import pdserve.router.http.errors",
     "cluster control knows no HTTP"),
    ("router/cluster/weight_updates.py", "import fastapi",
     "cluster control knows no HTTP"),
])
def test_an_import_against_the_layers_fails(tree_copy: Path, module: str, upward: str,
                                            rule: str) -> None:
    path = tree_copy / "pdserve" / module
    original = path.read_text()
    path.write_text(original + f"\n{upward}  # noqa\n")
    try:
        result = _lint(tree_copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    assert rule in result.stdout, result.stdout
    assert upward.split()[-1] in result.stdout
