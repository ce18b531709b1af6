"""Every flag of every ``pdserve`` subcommand (``pdserve bench ...`` included) reads its
``PDSERVE_<FLAG>`` environment variable (or the one its help names: ``pdserve certs
--host``), as docs/configuration.md says: a flag added with a raw ``add_argument`` instead
of a ``Flag`` (``pdserve/cli/flag_types.py``) would not.

The whole tree is parsed twice: once with no ``PDSERVE_*`` variable (required flags given
on the command line), once with every flag's variable set to a value it accepts that
differs from its default (and nothing on the command line); each flag's value must have
changed."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from typing import Any

import pytest
from unit.cli_parsers import Parsers, all_parsers

# Values tried for each variable, in order, after the flag's choices: the first one every
# flag of that name accepts and that differs from each one's default is used.
CANDIDATES = ("3", "2", "64", "0.5", "on", "off", "candidate-key", "10.0.0.0/8", "a=/tmp/adapter",
              "lru", "http://127.0.0.1:9")
# Required flags' values in the run without variables (none is a candidate).
FILLER = {"--port": "7"}
FILLER_TEXT = "filler-value"

_SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, _SKIP)]


def _env(action: argparse.Action) -> str:
    """The variable its help names (``[env PDSERVE_CERTS_HOST]``), else PDSERVE_<FLAG>."""
    named = re.search(r"\[env (PDSERVE_\w+)\]", action.help or "")
    if named:
        return named.group(1)
    return "PDSERVE_" + action.option_strings[0].removeprefix("--").upper().replace("-", "_")


def _accepts(action: argparse.Action, text: str) -> bool:
    """``text`` parses for ``action`` (as its variable) to a value other than its default."""
    if action.choices is not None and action.nargs is None and text not in map(
            str, action.choices):
        return False
    try:
        value = action.type(text) if callable(action.type) else text
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False
    return bool(value != action.default)


def _choices(action: argparse.Action) -> tuple[Any, ...]:
    """argparse's choices, or a ``Flag``'s (a several-valued flag checks its own)."""
    flag = getattr(action.type, "__self__", None)
    return tuple(action.choices or getattr(flag, "choices", None) or ())


def _values(parsers: dict[str, list[argparse.Action]]) -> dict[str, str]:
    """One value per variable that every flag reading it accepts."""
    values: dict[str, str] = {}
    for env, actions in parsers.items():
        choices = [str(c) for a in actions for c in _choices(a)]
        for text in (*choices, *CANDIDATES):
            if all(_accepts(a, text) for a in actions):
                values[env] = text
                break
        else:
            pytest.fail(f"no value of CANDIDATES is one every flag reading {env} accepts")
    return values


def _required_argv(parser: argparse.ArgumentParser) -> list[str]:
    argv: list[str] = []
    for action in _flags(parser):
        if action.required:
            argv += [action.option_strings[0],
                     FILLER.get(action.option_strings[0], FILLER_TEXT)]
    for group in parser._mutually_exclusive_groups:
        if group.required:
            argv += [group._group_actions[0].option_strings[0], FILLER_TEXT]
    return argv


def _parse(parser: argparse.ArgumentParser, argv: list[str],
           context: str = "") -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{parser.prog} {' '.join(argv)}{context}: {err.getvalue().strip()}")


def _ignored(plain: Parsers, with_env: Parsers) -> list[str]:
    """``pdserve <command> --flag (PDSERVE_FLAG)`` of each flag whose value the variable
    left unchanged."""
    ignored = []
    for words, parser in plain.items():
        if not _flags(parser):  # pdserve itself, the bench placeholder, prepare-model
            continue
        before = _parse(parser, _required_argv(parser))
        after = _parse(with_env[words], [], " (every flag's variable set)")
        for action in _flags(parser):
            if getattr(before, action.dest) == getattr(after, action.dest):
                ignored.append(f"{parser.prog} {action.option_strings[0]} ({_env(action)})")
    return ignored


@pytest.fixture
def no_pdserve_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [n for n in os.environ if n.startswith("PDSERVE_") and n != "PDSERVE_CACHE"]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_every_flag_of_every_subcommand_reads_its_environment_variable(
        no_pdserve_env: pytest.MonkeyPatch) -> None:
    plain = all_parsers()
    by_env: dict[str, list[argparse.Action]] = {}
    for parser in plain.values():
        for action in _flags(parser):
            by_env.setdefault(_env(action), []).append(action)
    assert len(by_env) > 200  # the whole tree: pdserve's commands and bench's
    for env, text in _values(by_env).items():
        no_pdserve_env.setenv(env, text)
    assert _ignored(plain, all_parsers()) == []


def test_a_required_flag_is_satisfied_by_its_variable(
        no_pdserve_env: pytest.MonkeyPatch) -> None:
    no_pdserve_env.setenv("PDSERVE_BASE_URL", "http://127.0.0.1:1")
    args: Any = _parse(all_parsers()[("bench", "run")], [])
    assert args.base_url == "http://127.0.0.1:1"


def test_a_several_valued_flag_reads_its_words_from_the_variable(
        no_pdserve_env: pytest.MonkeyPatch) -> None:
    no_pdserve_env.setenv("PDSERVE_PARTS", "stream latency")
    parser = all_parsers()[("bench", "router-cost")]
    assert _parse(parser, []).parts == ("stream", "latency")
    assert _parse(parser, ["--parts", "replicas"]).parts == ("replicas",)  # a flag wins
    no_pdserve_env.setenv("PDSERVE_PARTS", "stream bogus")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        all_parsers()[("bench", "router-cost")].parse_args([])
    assert "PDSERVE_PARTS" in err.getvalue() and "choose from" in err.getvalue()


def test_certs_host_is_not_the_bind_address_a_deployment_sets(
        no_pdserve_env: pytest.MonkeyPatch) -> None:
    no_pdserve_env.setenv("PDSERVE_HOST", "0.0.0.0")
    no_pdserve_env.setenv("PDSERVE_CERTS_HOST", "router.local,10.0.0.7")
    args = _parse(all_parsers()[("certs",)], ["--out", "x"])
    assert args.host == ("router.local", "10.0.0.7")
