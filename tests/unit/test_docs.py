"""The documentation says only what the repository has: every relative link in README.md,
docs/, bench/README.md and deploy's READMEs reaches a file (and its ``#anchor`` a heading
there), every flag named in a ``pdserve ...`` command is one that command's parser accepts,
every other flag in inline code or a code block is one some ``pdserve`` parser accepts or
another program's flag from a short list (that program named beside it), and README.md stays
short."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from unit.cli_parsers import all_parsers

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# an inline code span within one paragraph: it may wrap onto the next lines, not past a blank one
_WRAPPED_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
# pdserve in command position: first, after && ; | ` or VAR=value, or as a path (.venv/bin/pdserve);
# not an error message's ``pdserve router: error: ...``
_COMMAND = re.compile(r"(?:^|&&|;|\||`)\s*(?:[A-Z_]+=\S*\s+)*(?:\S*/)?pdserve(?!\s+[a-z-]+:)"
                      r"((?:\s+[a-z][a-z-]*)*)(?=\s|$)(.*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")

# Other programs' flags the pages name, by program: one passes only where its program is named
# on the same line (in the same code block). The rest must be some pdserve parser's.
FOREIGN_FLAGS = {
    "vllm": {"--max-num-seqs", "--long-prefill-token-threshold",
             "--enable-prompt-tokens-details"},
    "vllm-router": {"--vllm-pd-disaggregation"},
    "etcd": {"--cert-file", "--key-file", "--trusted-ca-file", "--client-cert-auth",
             "--auth-token-ttl"},
    "etcdctl": {"--prefix"},
    "pytest-xdist": {"--dist"},
    "redis-server": {"--save", "--appendonly", "--maxmemory", "--maxmemory-policy", "--port",
                     "--tls-port", "--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file",
                     "--tls-auth-clients"},
    "redis-cli": {"--cluster"},
    "docker": {"--build-arg"},
    "helm": {"--set", "--set-file"},
    "kubectl": {"--from-file"},
    "pip": {"--no-deps"},
    "code_map.py": {"--write"},
}


def doc_files() -> list[Path]:
    """The pages checked: README.md, docs/*.md, bench/README.md, deploy/**/README.md."""
    found = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "deploy").rglob("README.md"))]
    bench = REPO / "bench" / "README.md"
    return found + ([bench] if bench.exists() else [])


def split_code(text: str) -> tuple[list[str], list[str]]:
    """The page's prose lines (fenced blocks blanked) and its fenced code blocks' texts."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            if fenced:
                blocks.append([])
            prose.append("")
        elif fenced:
            blocks[-1].append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, ["\n".join(block) for block in blocks]


def inline_code(prose: list[str]) -> Iterator[tuple[str, str]]:
    """Each inline code span of the prose (one wrapped onto the next lines joined by a space)
    with the source lines it sits on."""
    text = "\n".join(prose)
    for match in _WRAPPED_CODE.finditer(text):
        start = text.rfind("\n", 0, match.start()) + 1
        end = text.find("\n", match.end())
        lines = text[start:end if end >= 0 else len(text)]
        yield match.group(2).replace("\n", " "), lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than
    ``-`` and ``_`` dropped, spaces made ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a page, numbered as GitHub numbers repeats (``-1``, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in split_code(path.read_text())[0]:
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def dead_links(path: Path) -> Iterator[str]:
    """Relative links in ``path``'s prose whose file or heading does not exist."""
    for line in split_code(path.read_text())[0]:
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                yield f"{target}: no such file"
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                yield f"{target}: no heading #{anchor} in {resolved.name}"


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def command_flags() -> dict[tuple[str, ...], set[str]]:
    """Every ``pdserve`` command (``("up",)``, ``("bench", "run")``, ...) and its options."""
    return {words: _option_strings(parser) for words, parser in all_parsers().items()}


def command_lines(path: Path) -> Iterator[str]:
    """Each ``pdserve ...`` command the page shows: in inline code, or a fenced code line
    (continuations joined, a trailing ``# comment`` dropped)."""
    prose, blocks = split_code(path.read_text())
    for span, _ in inline_code(prose):
        yield span.replace("\\|", "|")
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            yield re.sub(r"\s#\s.*$", "", line)


def bad_flags(path: Path, commands: dict[tuple[str, ...], set[str]]) -> Iterator[str]:
    """Flags (or subcommands) named in ``path``'s ``pdserve`` commands that do not exist.
    Quoted arguments are skipped: they are another command's flags (``--pdserve
    name='--disagg slo'`` passes ``pdserve up``'s flags through ``bench compare``)."""
    for line in command_lines(path):
        for match in _COMMAND.finditer(line):
            words = match.group(1).split()
            command = _longest_command(tuple(words), commands)
            if command is None:
                yield f"`pdserve {' '.join(words)}`: no such command"
                continue
            rest = " ".join(words[len(command):]) + " " + _QUOTED.sub("", match.group(2))
            for flag in _FLAG.findall(rest):
                if flag not in commands[command]:
                    yield f"`pdserve {' '.join(command)} {flag}`: no such flag"


def pdserve_flags() -> set[str]:
    """Every option of every ``pdserve`` parser (commands and ``bench`` subcommands)."""
    return set().union(*command_flags().values())


def code_with_context(path: Path) -> Iterator[tuple[str, str]]:
    """The page's code: each inline span with its source lines, each fenced block with
    itself."""
    prose, blocks = split_code(path.read_text())
    yield from inline_code(prose)
    yield from ((block, block) for block in blocks)


def unknown_flags(path: Path, known: set[str]) -> Iterator[str]:
    """Flags in ``path``'s inline code and code blocks that no ``pdserve`` parser has and that
    are not a program's in ``FOREIGN_FLAGS`` named beside them."""
    for code, context in code_with_context(path):
        for flag in _FLAG.findall(code):
            if flag not in known and not _foreign(flag, context):
                yield f"{flag}: no pdserve option (in: {' '.join(context.split())[:80]})"


def _foreign(flag: str, context: str) -> bool:
    """Whether ``flag`` is the flag of a program ``context`` names."""
    return any(flag in flags and re.search(rf"(?<![\w-]){re.escape(program)}(?![\w-])",
                                           context, re.I)
               for program, flags in FOREIGN_FLAGS.items())


def _longest_command(words: tuple[str, ...], commands: dict[tuple[str, ...], set[str]]
                     ) -> tuple[str, ...] | None:
    """The longest known command ``words`` start with (``()``: none named); None when its
    first word is no command (a positional argument after a known one is not a command)."""
    for size in range(min(len(words), 2), 0, -1):
        if words[:size] in commands:
            return words[:size]
    return None if words else ()


@pytest.fixture(scope="module")
def commands() -> dict[tuple[str, ...], set[str]]:
    return command_flags()


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    return pdserve_flags()


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert list(dead_links(path)) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_pdserve_flag_exists(path: Path, commands: dict[tuple[str, ...], set[str]]
                                   ) -> None:
    assert list(bad_flags(path, commands)) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_in_code_is_pdserves_or_a_named_programs(path: Path, known_flags: set[str]
                                                           ) -> None:
    assert list(unknown_flags(path, known_flags)) == []


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/"


def test_the_checks_catch_a_dead_link_and_a_bogus_flag(
        tmp_path: Path, commands: dict[tuple[str, ...], set[str]]) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[there](missing.md) [here](#nowhere) [ok](#top)\n\n"
                    "```bash\npdserve up --port 8000 \\\n    --no-such-flag\n```\n"
                    "`pdserve bench run --request-rate 1 --bogus` `pdserve frobnicate`\n"
                    "`vllm serve --anything` `pdserve bench compare --pdserve x='--disagg slo'`\n"
                    "`pdserve router: error: argument --nothing: invalid value` (a message)\n")
    assert list(dead_links(page)) == ["missing.md: no such file",
                                      "#nowhere: no heading #nowhere in page.md"]
    assert sorted(bad_flags(page, commands)) == [
        "`pdserve bench run --bogus`: no such flag",
        "`pdserve frobnicate`: no such command",
        "`pdserve up --no-such-flag`: no such flag",
    ]


def test_the_check_catches_a_flag_no_one_has(tmp_path: Path, known_flags: set[str]) -> None:
    page = tmp_path / "page.md"
    page.write_text("Set `--kv-cache-gib` and `--no-such-option`; give vLLM `--max-num-seqs`,\n"
                    "not here `--max-num-seqs`. A span that `--wraps\nonto` the next line.\n\n"
                    "```bash\nhelm install x --set a=1\n```\n```bash\ndocker run --set b\n```\n")
    assert [flag.split(":")[0] for flag in unknown_flags(page, known_flags)] == [
        "--no-such-option", "--max-num-seqs", "--wraps", "--set"]


def test_slug_follows_github() -> None:
    assert slug("Conditional disaggregation (`--disagg auto|always|never|slo`)") == (
        "conditional-disaggregation---disagg-autoalwaysneverslo")
    assert slug("KV tiers under each engine's cache") == "kv-tiers-under-each-engines-cache"
