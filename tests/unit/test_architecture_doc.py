"""docs/architecture.md names only modules and files the repository has.

The names checked: the inline code spans of the page's prose (fenced blocks skipped; a
span may wrap onto the next line), cut at whitespace, ``=``, ``,`` and parentheses; of
the pieces,

- a path: segments joined by ``/``, the first lowercase, holding a ``/`` or (a bare
  file name) ending in ``.py`` (``router/dispatch/phases.py``, ``kv_transfer/tiers/``,
  ``bench/results/compare-prefill-admission*``, ``plan.py``). A last segment
  ``module.name`` whose suffix is no file suffix names ``module.py`` and a name defined
  there (``worker/lora/adapters.LoraRuns``). Not paths: placeholders in capitals
  (``DIR/checkpoints.json``), URLs, HTTP routes (a leading ``/``), bare file names of
  other kinds (``workers.json``, an example's);
- a dotted name whose first part is ``pdserve`` or one of its packages
  (``pdserve.kv_transfer.connector``, ``core.block_hash.tier_hashes``): a module from
  the repository root (``pdserve.``) or from ``pdserve/``, then at most one name defined
  there. ``NOT_MODULES`` lists the few dotted names of other things that look like one.

Where a path resolves, the first that has it of: the repository root; ``pdserve/``; the
packages its ``##`` section (with its ``###`` subsections) is about, that is each folder
the section names, the folder of each file it names (found by these same rules), and
their parents inside the repository. So ``handoff_codec.py`` beside
``kv_transfer/coded_pull.py`` is ``pdserve/kv_transfer/handoff_codec.py``, and
``plan.py`` in the section on ``pdserve/kv_transfer/remote/`` is that package's. A glob
must match something."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "pdserve"

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
# an inline code span within one paragraph: it may wrap onto the next line, not past a blank one
_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.S)
_SECTION = re.compile(r"^## ", re.M)
_PATH = re.compile(r"[a-z_][a-z0-9_.*-]*(?:/[A-Za-z0-9_.*-]+)*/?")
_DOTTED = re.compile(r"[a-z_]\w*(?:\.[A-Za-z_]\w*)+")
_FILE_SUFFIXES = {"py", "pyi", "proto", "json", "md", "toml", "yml", "yaml", "txt", "csv"}
_ROOTS = (REPO, PACKAGE)
# Dotted names in the page's code that look like a pdserve module's and are not one.
NOT_MODULES = {
    "router.processes": "the Helm chart's value (deploy/helm), not pdserve.router's",
}


def sections(text: str) -> Iterator[str]:
    """The page's prose cut at each ``##`` heading, fenced code blocks blanked."""
    prose: list[str] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            line = ""
        prose.append("" if fenced else line)
    yield from _SECTION.split("\n".join(prose))


def named(section: str) -> Iterator[str]:
    """The names of modules and files the section's inline code holds, as written."""
    for match in _CODE.finditer(section):
        for piece in re.split(r"[\s=,()]+", match.group(2)):
            piece = piece.rstrip(".:;")
            if _PATH.fullmatch(piece) and ("/" in piece or _suffix(piece) == "py"):
                yield piece
            elif (_DOTTED.fullmatch(piece) and _suffix(piece) not in _FILE_SUFFIXES
                  and _is_package(piece.split(".")[0]) and piece not in NOT_MODULES):
                yield piece


def _suffix(name: str) -> str:
    return name.rpartition("/")[2].rpartition(".")[2] if "." in name else ""


def _is_package(first: str) -> bool:
    return first == "pdserve" or (PACKAGE / first / "__init__.py").is_file()


def _defines(module: Path, name: str) -> bool:
    """Whether ``module`` defines ``name`` at some level (a class, function or assignment)."""
    source = module.read_text()
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]",
                     source, re.M) is not None


def _module(base: Path, parts: list[str]) -> Path | None:
    """The module or package file ``parts`` names under ``base``, if any."""
    stem = base.joinpath(*parts)
    for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolve(name: str, bases: list[Path]) -> Path | None:
    """What ``name`` names: a dotted name from the root or ``pdserve/``, a path under the
    first of ``bases`` that has it; None where none does."""
    if "/" not in name and _DOTTED.fullmatch(name) and _suffix(name) not in _FILE_SUFFIXES:
        return _resolve_dotted(name.split("."))
    for base in bases:
        found = _resolve_under(name, base)
        if found is not None:
            return found
    return None


def _resolve_dotted(parts: list[str]) -> Path | None:
    base = REPO if parts[0] == "pdserve" else PACKAGE
    for cut in (len(parts), len(parts) - 1):
        module = _module(base, parts[:cut])
        if module is not None and (cut == len(parts) or _defines(module, parts[-1])):
            return module
    return None


def _resolve_under(name: str, base: Path) -> Path | None:
    head, _, last = name.rstrip("/").rpartition("/")
    stem, dot, attr = last.partition(".")
    if dot and attr not in _FILE_SUFFIXES and "*" not in last and "." not in attr:
        module = base / head / f"{stem}.py"
        return module if module.is_file() and _defines(module, attr) else None
    if "*" in name:
        return next(iter(sorted(base.glob(name.rstrip("/")))), None)
    path = base / name
    return path if (path.is_dir() if name.endswith("/") else path.exists()) else None


def _packages(path: Path) -> list[Path]:
    """The folder ``path`` is or lies in, and its parents inside the repository."""
    folder = path if path.is_dir() else path.parent
    return [folder, *(p for p in folder.parents if p != REPO and REPO in p.parents)]


def missing(text: str) -> list[str]:
    """Every name the page's text holds that resolves nowhere, with its section's heading."""
    bad: list[str] = []
    for section in sections(text):
        names = sorted(set(named(section)))
        bases = list(_ROOTS)
        pending = names
        while pending:  # a name found makes its folder a base for the others
            still: list[str] = []
            for name in pending:
                found = resolve(name, bases)
                if found is None:
                    still.append(name)
                else:
                    bases += [p for p in _packages(found) if p not in bases]
            if len(still) == len(pending):
                break
            pending = still
        heading = section.splitlines()[0] if section else ""
        bad += [f"{name} (section: {heading[:60]})" for name in pending]
    return bad


def test_every_name_the_architecture_page_gives_exists() -> None:
    bad = missing(PAGE.read_text())
    assert not bad, "docs/architecture.md names what the tree lacks:\n" + "\n".join(bad)


def test_the_check_finds_names_in_each_form_the_page_uses() -> None:
    page = PAGE.read_text()
    found = {name for section in sections(page) for name in named(section)}
    for example in ("pdserve/worker/servicer.py", "router/dispatch/phases.py",
                    "worker/session.py", "router/dispatch/workers/session.py",
                    "dispatch/migration.py", "pdserve.core.types",
                    "core.block_hash.tier_hashes", "worker/lora/adapters.LoraRuns", "plan.py",
                    "kv_transfer/tiers/policy.py", "pdserve/kv_transfer/remote/"):
        assert example in found, example
    for not_a_module in ("/metrics", "DIR/checkpoints.json", "SamplingParams.lora_name",
                         "pdserve.egg-info"):
        assert not_a_module not in found, not_a_module


def test_a_planted_name_is_reported() -> None:
    planted = "## Section\n\nSee `router/dispatch/nowhere.py`, `pdserve.core.nothing`,\n" \
              "`core/block_hash.no_such_function` and `router/dispatch/phases.py`.\n"
    assert missing(planted) == [
        "core/block_hash.no_such_function (section: Section)",
        "pdserve.core.nothing (section: Section)",
        "router/dispatch/nowhere.py (section: Section)",
    ]
