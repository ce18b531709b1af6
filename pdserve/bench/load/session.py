"""A benchmark session: everything checked before the first request (flags, dataset,
endpoint, model, tokenizer), then one run per schedule on one HTTP client, each turned
into a ``pdserve.bench.run/v1`` result."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import platform
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.load.client import Endpoint
from pdserve.bench.load.config import RunConfig
from pdserve.bench.load.metrics import Slo, summarize
from pdserve.bench.load.runner import (
    WARMUP_SEED_OFFSET,
    Outcome,
    Runner,
    Schedule,
    check_model,
    list_models,
)
from pdserve.bench.workload.bench_tokenizer import load_bench_tokenizer
from pdserve.bench.workload.generators import check_workload_flags, make_workload, workload_info
from pdserve.bench.workload.prompts import PromptEncoder
from pdserve.core.dtype import resolve_dtype
from pdserve.core.files import write_atomic
from pdserve.core.model import DEFAULT_MODEL_NAME, cache_dir
from pdserve.core.version import version

RUN_SCHEMA = "pdserve.bench.run/v1"
DEFAULT_NUM_REQUESTS = 100


def schedule(cfg: RunConfig) -> Schedule:
    num = cfg.num_requests
    if num is None and cfg.duration_s is None:
        num = DEFAULT_NUM_REQUESTS
    return Schedule(num, cfg.duration_s, cfg.request_rate, cfg.burstiness,
                    cfg.max_concurrency, cfg.seed)


def _tokenizer_path(cfg: RunConfig) -> Path:
    if cfg.tokenizer:
        path = Path(cfg.tokenizer).expanduser()
    elif cfg.model and Path(cfg.model).expanduser().is_dir():
        path = Path(cfg.model).expanduser()
    else:
        path = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer at {path}: pass --tokenizer FOLDER (the served "
                         "model's Hugging Face folder)")
    return path


def _load_tokenizer(path: Path) -> Any:
    # Only a run loads one (the flag checks of compare and gaps build a Session without a
    # tokenizer); transformers is imported there.
    try:
        return load_bench_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer at {path}: {exc}") from None


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def _versions() -> dict[str, str]:
    return {"pdserve": version(), "python": platform.python_version(),
            "httpx": httpx.__version__}


def _machine() -> dict[str, Any]:
    """This machine's CPU, and what ``--dtype auto`` runs on it (what a server started
    here with ``auto`` runs): results from different machines are not comparable."""
    choice = resolve_dtype("auto")
    return {"cpu_model": choice.hardware.cpu_model, "cores": list(choice.hardware.cores),
            "cpu_flags": choice.hardware.flag_table(), "auto_dtype": choice.dtype,
            "auto_dtype_reason": choice.reason}


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Atomically: a reader never sees a partial file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, json.dumps(payload, indent=1))


class Session:
    def __init__(self, cfg: RunConfig, recorded: Mapping[str, Any] | None = None) -> None:
        """Checks that need neither a server nor a tokenizer: they fail in milliseconds.
        ``recorded``: the command's config as each result's ``config`` records it
        (default: ``cfg.recorded()``)."""
        self.cfg = cfg
        self.recorded = dict(cfg.recorded() if recorded is None else recorded)
        self.slo = Slo.parse(cfg.slo)
        self.dataset = check_workload_flags(cfg)
        if cfg.max_model_len is not None and cfg.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        if cfg.num_warmup < 0 or not cfg.request_timeout_s > 0:
            raise ValueError("--num-warmup must be >= 0 and --request-timeout-s > 0")
        self.base_url = Endpoint.normalize(cfg.base_url)
        self.ignore_eos = (cfg.workload != "sharegpt" if cfg.ignore_eos is None
                           else cfg.ignore_eos)

    async def run(self, schedules: list[Schedule]) -> list[dict[str, Any]]:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
            ep = Endpoint(self.base_url, cfg.model or "", cfg.endpoint, cfg.api_key,
                          self.ignore_eos, cfg.request_timeout_s)
            cards = await list_models(client, ep)
            if not cfg.model:
                if not cards:
                    raise ValueError(f"no --model given and {ep.base_url}/models names none")
                ep = replace(ep, model=next(iter(cards)))
            max_len = check_model(cards, ep) or cfg.max_model_len
            tokenizer_path = _tokenizer_path(cfg)
            encoder = PromptEncoder(await asyncio.to_thread(_load_tokenizer, tokenizer_path),
                                    cfg.endpoint)
            runner = Runner(client, ep, encoder, max_len, not cfg.no_progress)
            await runner.warm_up(make_workload(cfg, encoder, cfg.seed + WARMUP_SEED_OFFSET,
                                               self.dataset), cfg.num_warmup)
            results = []
            for sched in schedules:
                # The schedule's rate: a trace replay scales its times to it (sweeps).
                workload = make_workload(replace(cfg, request_rate=sched.request_rate),
                                         encoder, cfg.seed, self.dataset)
                started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
                outcome = await runner.run(workload, sched)
                config = self._config(ep, sched, tokenizer_path, max_len)
                info = workload_info(workload, max_len)
                results.append(self._result(config, started, outcome, info))
            return results

    def _config(self, ep: Endpoint, sched: Schedule, tokenizer: Path,
                max_len: int | None) -> dict[str, Any]:
        config = {k: _json_safe(v) for k, v in self.recorded.items()}
        config.update(base_url=ep.base_url, model=ep.model, tokenizer=str(tokenizer),
                      ignore_eos=ep.ignore_eos, max_model_len=max_len,
                      api_key="<set>" if ep.api_key else None,
                      num_requests=sched.num_requests, duration_s=sched.duration_s,
                      request_rate=_json_safe(sched.request_rate),
                      max_concurrency=sched.max_concurrency)
        return config

    def _result(self, config: dict[str, Any], started: str, out: Outcome,
                info: dict[str, Any]) -> dict[str, Any]:
        summary = summarize(out.records, out.duration_s, self.slo)
        return {
            "schema": RUN_SCHEMA, "config": config, "versions": _versions(),
            "machine": _machine(), "started_at": started, "duration_s": out.duration_s,
            "num_requests": out.num_drawn, "completed": summary.pop("completed"),
            "failed": summary.pop("failed"), "skipped": out.num_skipped, **summary,
            "error_examples": out.error_examples, **info,
            "requests": [r.to_json() for r in out.records],
        }
