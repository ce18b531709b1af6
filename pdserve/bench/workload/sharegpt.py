"""ShareGPT files as users bring them: a JSON list or JSONL, each entry
``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``.

The first two turns are the prompt and the reference completion (as ``vllm bench
serve``). Entries that are not of that shape are skipped and counted; a file with no
usable entry is an error."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ShareGptData:
    pairs: list[tuple[str, str]]  # (prompt, reference completion)
    num_malformed: int


def _pair(entry: Any) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    values = []
    for turn in turns[:2]:
        value = turn.get("value") if isinstance(turn, dict) else None
        if not isinstance(value, str) or not value.strip():
            return None
        values.append(value)
    return values[0], values[1]


def _entries(path: Path, text: str) -> tuple[list[Any], int]:
    """The file's entries and the number of JSONL lines that are not JSON."""
    if path.suffix == ".jsonl":
        entries, bad = [], 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
        return entries, bad
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"dataset {path}: not JSON ({exc.msg} at line {exc.lineno}); "
                         "expected a list of ShareGPT entries (or a .jsonl file)") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset {path}: expected a JSON list of ShareGPT entries, "
                         f"got {type(data).__name__}")
    return data, 0


def load_sharegpt(path: str | Path) -> ShareGptData:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"dataset {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"dataset {path}: not UTF-8 text") from None
    entries, bad = _entries(path, text)
    pairs = [p for p in map(_pair, entries) if p is not None]
    malformed = bad + len(entries) - len(pairs)
    if not pairs:
        raise ValueError(f"dataset {path}: no usable ShareGPT entry ({malformed} malformed); "
                         'each needs "conversations" with two turns that have a "value"')
    return ShareGptData(pairs, malformed)
