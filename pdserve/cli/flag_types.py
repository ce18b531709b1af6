"""How a command-line flag is declared (``Flag``), parsed and reported: the parser
whose errors are one line, each flag's ``PDSERVE_<FLAG>`` environment value parsed as
its own value, and the value parsers (a ``ValueError`` says what was expected). The
flags themselves are declared once, in ``flags.py``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from pdserve.core.lora import LORA_RANKS, LoraAdapter, parse_lora_module
from pdserve.router.http.tenants.table import check_api_key, parse_key_entry

Parse = Callable[[str], Any]


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block): scripts
    and container logs show the cause, and ``--help`` shows the rest."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default (its environment value when that is set)."""


class _EnvValue(str):
    """A default taken from the environment; remembers the variable for errors."""

    env: str

    def __new__(cls, value: str, env: str) -> _EnvValue:
        obj = super().__new__(cls, value)
        obj.env = env
        return obj


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes: "max-model-len"
    help: str
    default: Any = None
    parse: Parse = str
    choices: Sequence[str] | None = None
    switch: bool = False  # --name / --no-name
    metavar: str | None = None
    repeat: bool = False  # may be given several times; ``parse`` returns a tuple to add up
    secret: bool = False  # a bad value is not echoed in the error (keys)
    # A repeated flag that also takes several values at once (``--lora-modules a=x b=y``,
    # as vllm serve's nargs="+").
    several: bool = False

    @property
    def env(self) -> str:
        return "PDSERVE_" + self.name.upper().replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser, **override: Any) -> None:
        """Add this flag to ``parser``; ``override`` changes fields for this use only
        (a subcommand's own default port, a more specific help text)."""
        flag = replace(self, **override) if override else self
        raw = os.environ.get(flag.env)
        # A string default goes through ``type`` when the flag is not given, so a
        # bad environment value is reported by argparse like a bad flag value.
        default = flag.default if raw is None else _EnvValue(raw, flag.env)
        kwargs: dict[str, Any] = dict(default=default, type=flag._convert,
                                      help=f"{flag.help} [env {flag.env}]")
        if flag.switch:
            parser.add_argument(f"--{flag.name}", action=argparse.BooleanOptionalAction,
                                **kwargs)
        elif flag.repeat:
            parser.add_argument(f"--{flag.name}", action=_Repeated, metavar=flag.metavar,
                                nargs="+" if flag.several else None, **kwargs)
        else:
            parser.add_argument(f"--{flag.name}", choices=flag.choices,
                                metavar=flag.metavar, **kwargs)

    def _convert(self, text: str) -> Any:
        source = f" from {text.env}" if isinstance(text, _EnvValue) else ""
        try:
            value = self.parse(str(text))
        except ValueError as exc:
            shown = "" if self.secret else f" {str(text)!r}"
            raise argparse.ArgumentTypeError(
                f"invalid value{shown}{source}: {exc}") from None
        if self.choices is not None and value not in self.choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {str(text)!r}{source} (choose from "
                f"{', '.join(self.choices)})")
        return value


class _Repeated(argparse.Action):
    """A flag given several times: its values (tuples) add up, and the first one on the
    command line replaces the default (the environment's), as every flag's does."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        if current is None or current is self.default:
            current = ()
        if isinstance(values, list):  # nargs="+": one parsed tuple per value
            values = tuple(item for value in values for item in value)
        setattr(namespace, self.dest, (*current, *values))


# ---- value parsers: ValueError says what was expected --------------------------------

def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false, yes/no, on/off or 1/0")


def parse_int(low: int, high: int | None = None) -> Parse:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("expected an integer") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"expected an integer >= {low}" if high is None
                             else f"expected an integer from {low} to {high}")
        return value
    return parse


def parse_float(low: float, *, strict: bool = False) -> Parse:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("expected a number") from None
        if value < low or (strict and value == low) or value != value:
            raise ValueError(f"expected a number {'>' if strict else '>='} {low:g}")
        return value
    return parse


parse_port = parse_int(0, 65535)


def parse_chunk_tokens(text: str) -> int:
    value = parse_int(0)(text)
    if 0 < value < 16:
        raise ValueError("expected 0 (no cap) or at least 16")
    return int(value)


def parse_weight_version(text: str) -> str:
    """A weights version: it names the weights in compatibility hashes, KV handles and
    cache salts, where an empty one would mean "unnamed"."""
    if not text.strip():
        raise ValueError("expected a version name, not an empty string")
    return text


def parse_lora_modules(text: str) -> tuple[LoraAdapter, ...]:
    """``--lora-modules``: ``name=path`` entries (several, space-separated, as ``vllm
    serve`` takes them), or one adapter as vLLM's JSON object."""
    if text.strip().startswith("{"):
        return (parse_lora_module(text),)
    # Empty: none (an environment variable a deployment leaves blank).
    return tuple(parse_lora_module(entry) for entry in text.split())


def parse_lora_rank(text: str) -> int:
    rank = parse_int(1)(text)
    if rank not in LORA_RANKS:
        raise ValueError(f"expected one of {', '.join(map(str, LORA_RANKS))}")
    return int(rank)


def parse_api_keys(text: str) -> tuple[str, ...]:
    """Comma-separated keys (one per ``--admin-key``; the environment may hold several)."""
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    for key in keys:
        check_api_key(key)
    return keys


def parse_cidrs(text: str) -> tuple[str, ...]:
    """Comma-separated networks (``10.0.0.0/8``, ``fd00::/8``; an address alone is its
    own /32 or /128), each normalized."""
    nets = tuple(str(ipaddress.ip_network(n.strip(), strict=False))
                 for n in text.split(",") if n.strip())
    if not nets:
        raise ValueError("expected a CIDR such as 10.0.0.0/8")
    return nets


def parse_api_key_entries(text: str) -> tuple[str, ...]:
    """Comma-separated key entries, each a key with its tenant fields or none (an
    ``--api-key-file`` line: ``router/http/tenants/table.py``), checked here, read by
    ``router/http/edge/config.py``."""
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    for number, entry in enumerate(entries, 1):
        try:
            parse_key_entry(entry)
        except ValueError as exc:
            raise ValueError(f"entry {number}: {exc}") from None
    return entries
