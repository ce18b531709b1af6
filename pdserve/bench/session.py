"""A benchmark session: everything checked before the first request (flags, dataset,
endpoint, model, tokenizer), then one run per schedule on one HTTP client, each turned
into a ``pdserve.bench.run/v1`` result."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.client import Endpoint
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.prompts import PromptEncoder
from pdserve.bench.runner import (
    WARMUP_SEED_OFFSET,
    Outcome,
    Runner,
    Schedule,
    check_model,
    list_models,
)
from pdserve.bench.workloads import check_workload_flags, make_workload, workload_info

RUN_SCHEMA = "pdserve.bench.run/v1"
DEFAULT_NUM_REQUESTS = 100


def schedule(args: argparse.Namespace) -> Schedule:
    num = args.num_requests
    if num is None and args.duration_s is None:
        num = DEFAULT_NUM_REQUESTS
    return Schedule(num, args.duration_s, args.request_rate, args.burstiness,
                    args.max_concurrency, args.seed)


def _tokenizer_path(args: argparse.Namespace) -> Path:
    from pdserve.core.model import DEFAULT_MODEL_NAME, cache_dir

    if args.tokenizer:
        path = Path(args.tokenizer).expanduser()
    elif args.model and Path(args.model).expanduser().is_dir():
        path = Path(args.model).expanduser()
    else:
        path = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer at {path}: pass --tokenizer FOLDER (the served "
                         "model's Hugging Face folder)")
    return path


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer at {path}: {exc}") from None


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def _versions() -> dict[str, str]:
    from pdserve.cli.main import _version

    return {"pdserve": _version(), "python": platform.python_version(),
            "httpx": httpx.__version__}


def _machine() -> dict[str, Any]:
    """This machine's CPU, and what ``--dtype auto`` runs on it (what a server started
    here with ``auto`` runs): results from different machines are not comparable."""
    from pdserve.core.dtype import resolve_dtype

    choice = resolve_dtype("auto")
    return {"cpu_model": choice.hardware.cpu_model, "cores": list(choice.hardware.cores),
            "cpu_flags": choice.hardware.flag_table(), "auto_dtype": choice.dtype,
            "auto_dtype_reason": choice.reason}


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Atomically: a reader never sees a partial file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "w") as out:
        json.dump(payload, out, indent=1)
    os.replace(tmp, target)


class Session:
    def __init__(self, args: argparse.Namespace) -> None:
        """Checks that need neither a server nor a tokenizer: they fail in milliseconds."""
        self.args = args
        self.slo = Slo.parse(args.slo)
        self.dataset = check_workload_flags(args)
        if args.max_model_len is not None and args.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        if args.num_warmup < 0 or not args.request_timeout_s > 0:
            raise ValueError("--num-warmup must be >= 0 and --request-timeout-s > 0")
        self.base_url = Endpoint.normalize(args.base_url)
        self.ignore_eos = (args.workload != "sharegpt" if args.ignore_eos is None
                           else args.ignore_eos)

    async def run(self, schedules: list[Schedule]) -> list[dict[str, Any]]:
        args = self.args
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
            ep = Endpoint(self.base_url, args.model or "", args.endpoint, args.api_key,
                          self.ignore_eos, args.request_timeout_s)
            cards = await list_models(client, ep)
            if not args.model:
                if not cards:
                    raise ValueError(f"no --model given and {ep.base_url}/models names none")
                ep = replace(ep, model=next(iter(cards)))
            max_len = check_model(cards, ep) or args.max_model_len
            tokenizer_path = _tokenizer_path(args)
            encoder = PromptEncoder(await asyncio.to_thread(_load_tokenizer, tokenizer_path),
                                    args.endpoint)
            runner = Runner(client, ep, encoder, max_len, not args.no_progress)
            await runner.warm_up(make_workload(args, encoder, args.seed + WARMUP_SEED_OFFSET,
                                               self.dataset), args.num_warmup)
            results = []
            for sched in schedules:
                workload = make_workload(args, encoder, args.seed, self.dataset)
                started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
                outcome = await runner.run(workload, sched)
                config = self._config(ep, sched, tokenizer_path, max_len)
                results.append(self._result(config, started, outcome, workload_info(workload)))
            return results

    def _config(self, ep: Endpoint, sched: Schedule, tokenizer: Path,
                max_len: int | None) -> dict[str, Any]:
        config = {k: _json_safe(v) for k, v in vars(self.args).items() if k != "func"}
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
