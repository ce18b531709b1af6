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
    choices: Sequence[Any] | None = None  # of the parsed values (each one's, with several)
    switch: bool = False  # --name / --no-name
    metavar: str | None = None
    repeat: bool = False  # may be given several times; ``parse`` returns a tuple to add up
    secret: bool = False  # a bad value is not echoed in the error (keys)
    # Takes several values at once (``--parts latency stream``, argparse's nargs="+"):
    # ``parse`` returns a tuple for each, and the environment value (all of them, e.g.
    # space-separated: ``parse_words``) is parsed by it too; the tuples add up. Given
    # twice, the last one wins, unless ``repeat`` (``--lora-modules a=x b=y``, as vllm
    # serve's nargs="+" action="append"), where every one adds up.
    several: bool = False
    # --name alone turns it on (argparse's store_true: no --no-name form); its
    # environment value is read by ``parse_bool``, its default is False.
    store_true: bool = False
    # Must be given, on the command line or by its environment variable.
    required: bool = False
    aliases: tuple[str, ...] = ()  # other spellings ("num-prompts", vllm bench serve's)
    # Its variable, where PDSERVE_<FLAG> is another command's flag of another meaning
    # (``pdserve certs --host``, the certificate's names, is not the bind address).
    env_var: str | None = None

    @property
    def env(self) -> str:
        return self.env_var or "PDSERVE_" + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        """The attribute the parsed value lands on: ``args.max_model_len``."""
        return self.name.replace("-", "_")

    def add_to(self, parser: Any, **override: Any) -> None:
        """Add this flag to ``parser`` (an ``ArgumentParser`` or one of its groups);
        ``override`` changes fields for this use only (a subcommand's own default port,
        a more specific help text)."""
        flag = replace(self, **override) if override else self
        if flag.store_true:
            flag = replace(flag, parse=parse_bool, default=bool(flag.default))
        raw = os.environ.get(flag.env)
        # A string default goes through ``type`` when the flag is not given, so a
        # bad environment value is reported by argparse like a bad flag value.
        default = flag.default if raw is None else _EnvValue(raw, flag.env)
        names = [f"--{name}" for name in (flag.name, *flag.aliases)]
        kwargs: dict[str, Any] = dict(default=default, type=flag._convert,
                                      help=f"{flag.help} [env {flag.env}]".lstrip())
        if flag.switch:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
        elif flag.store_true:
            parser.add_argument(*names, action=_Present, **kwargs)
        elif flag.repeat or flag.several:
            shown = flag.metavar or ("{" + ",".join(map(str, flag.choices)) + "}"
                                     if flag.choices else None)
            parser.add_argument(*names, action=_Repeated if flag.repeat else _Several,
                                metavar=shown, nargs="+" if flag.several else None,
                                required=flag.required and raw is None, **kwargs)
        else:
            parser.add_argument(*names, choices=flag.choices, metavar=flag.metavar,
                                required=flag.required and raw is None, **kwargs)

    def argv(self, value: Any) -> list[str]:
        """The command line that gives a child process this flag's parsed ``value``
        (``pdserve up`` hands its router the flags it parsed): nothing for None,
        ``--name``/``--no-name`` for a switch, ``--name ITEM`` per item of a repeated
        flag. The value's ``str`` must parse back to it, as every value handed on does
        (strings, numbers, choices; ``tests/unit/test_cli_handoff.py``)."""
        option = f"--{self.name}"
        if value is None:
            return []
        if self.switch:
            return [option if value else f"--no-{self.name}"]
        if self.store_true:
            return [option] if value else []
        if self.repeat:
            return [word for item in value for word in (option, str(item))]
        if self.several:
            return [option, *map(str, value)]
        return [option, str(value)]

    def _convert(self, text: str) -> Any:
        source = f" from {text.env}" if isinstance(text, _EnvValue) else ""
        try:
            value = self.parse(str(text))
        except ValueError as exc:
            shown = "" if self.secret else f" {str(text)!r}"
            raise argparse.ArgumentTypeError(
                f"invalid value{shown}{source}: {exc}") from None
        values = value if self.several else (value,)
        if self.choices is not None and any(v not in self.choices for v in values):
            raise argparse.ArgumentTypeError(
                f"invalid choice {str(text)!r}{source} (choose from "
                f"{', '.join(map(str, self.choices))})")
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


class _Several(argparse.Action):
    """A flag that takes several values at once (nargs="+"), each parsed to a tuple:
    their items, in order (given twice, the last one wins, as any flag's value)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, tuple(item for value in values for item in value))


class _Present(argparse.Action):
    """``--name`` alone: True (argparse's store_true, but its default, the environment's
    value, goes through ``type`` as every flag's does)."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = False,
                 type: Parse | None = None, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, type=type,
                         help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


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


def parse_integer(text: str) -> int:
    """Any integer (a bench's count, where its config says what it accepts)."""
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def parse_number(text: str) -> float:
    """Any number, ``inf`` included (a bench's rate or time; its config checks it)."""
    try:
        return float(text)
    except ValueError:
        raise ValueError("expected a number (or inf)") from None


def parse_names(text: str) -> tuple[str, ...]:
    """Comma-separated names (one per repeated flag; the environment may hold several)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_words(item: Parse) -> Parse:
    """A ``several`` flag's value: space-separated words, each parsed by ``item``."""
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(item(word) for word in text.split())
    return parse


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
