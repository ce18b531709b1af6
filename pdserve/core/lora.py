"""LoRA adapters: what names one (``LoraAdapter``), how ``--lora-modules`` spells one, and
the cache salt a request under an adapter runs with.

An adapter is served under its name (the OpenAI ``model`` a client asks for) from a
PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``). Its KV differs
from the base model's and from every other adapter's, so a request under an adapter is
cached under ``adapter_salt``: its salt joined to the adapter's ``tag`` (its name and
its folder), which reaches every cache key through the salt, as the weight version
does (``core.block_hash.versioned_salt``): the engines' prefix caches, the KV tiers,
the pool, the cluster store and the routers' prefix index. A new folder under the same
name (a refit of the adapter) is a new tag: nothing cached under the old one matches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from hashlib import blake2b

# vLLM's adapter names are a client's ``model``: kept short and printable.
MAX_NAME_CHARS = 200
MAX_PATH_CHARS = 4096
# What ``adapter_salt`` and ``LoraAdapter.tag`` join with: not in a name.
FORBIDDEN_NAME_CHARS = ("@", "#")


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter a worker serves: its ``name`` and the folder it loads from."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS or not self.name.isprintable():
            raise ValueError(f"a LoRA name must be 1 to {MAX_NAME_CHARS} printable "
                             f"characters, not {self.name!r}")
        if any(c in self.name for c in FORBIDDEN_NAME_CHARS):
            # '@' joins a salt to the adapter's tag, '#' the tag's name to its digest.
            raise ValueError(f"a LoRA name may not hold {' or '.join(FORBIDDEN_NAME_CHARS)}"
                             f": {self.name!r}")
        if not self.path or len(self.path) > MAX_PATH_CHARS:
            raise ValueError(f"LoRA {self.name!r}: its path must be 1 to {MAX_PATH_CHARS} "
                             "characters")

    def __str__(self) -> str:
        """The ``--lora-modules`` entry that parses back to it (``parse_lora_module``):
        ``name=path``, or the JSON form where that would not read back the same."""
        name, path = self.name, self.path
        if "=" in name or name.startswith("{") or name != name.strip() or path != path.strip():
            return json.dumps({"name": name, "path": path})
        return f"{name}={path}"

    @property
    def tag(self) -> str:
        """What names this adapter's KV: its name and a digest of its folder."""
        digest = blake2b(self.path.encode(), digest_size=6).hexdigest()
        return f"{self.name}#{digest}"


# What a request asks a worker to serve: an exact adapter, a name alone (any folder: a
# request from before requests carried the folder), or None (the base model).
WantedLora = LoraAdapter | str | None


def wanted_lora(name: str | None, path: str | None) -> WantedLora:
    """A request's adapter from its ``SamplingSpec.lora_name`` and ``lora_path``."""
    if name is None:
        return None
    return name if path is None else LoraAdapter(name, path)


LORA_MARK = "@lora:"


def adapter_salt(cache_salt: str | None, adapter: LoraAdapter | None) -> str | None:
    """The salt a request's KV is cached under when it runs ``adapter`` (None: the base
    model, the salt unchanged). ``@lora:`` joins them: a client's own salt may not hold
    ``@`` (``versioned_salt``), so no client can name an adapter's blocks."""
    if adapter is None:
        return cache_salt
    return f"{cache_salt or ''}{LORA_MARK}{adapter.tag}"


def split_adapter_salt(salt: str | None) -> tuple[str | None, str | None]:
    """``adapter_salt``'s parts: the request's own salt and the adapter's tag (None,
    None: neither)."""
    if salt is None or LORA_MARK not in salt:
        return salt, None
    own, _, tag = salt.rpartition(LORA_MARK)
    return own or None, tag


def parse_lora_module(text: str) -> LoraAdapter:
    """One ``--lora-modules`` entry as ``vllm serve`` takes it: ``name=path``, or its JSON
    form ``{"name": ..., "path": ..., "base_model_name": ...}`` (the base is this
    router's model: ignored)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {text!r}: not JSON ({exc})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: JSON needs string name and path")
        return LoraAdapter(spec["name"], spec["path"])
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return LoraAdapter(name.strip(), path.strip())


# vLLM's defaults (``vllm serve``): adapters in one batch, and the largest rank.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
# vLLM's allowed ranks (``LoRAConfig.max_lora_rank``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraConfig:
    """An engine's LoRA settings, as ``vllm serve`` spells them: ``--enable-lora``,
    ``--lora-modules`` (adapters served from the start), ``--max-loras`` (adapters in
    one batch) and ``--max-lora-rank``."""

    enable_lora: bool = False
    modules: tuple[LoraAdapter, ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    def __post_init__(self) -> None:
        if self.modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ValueError("--max-loras must be >= 1")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"--max-lora-rank must be one of "
                             f"{', '.join(map(str, LORA_RANKS))}, not {self.max_lora_rank}")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

