"""Output tokens that reach an engine inside its prompt, counted as output.

A decode call continues a request: its prompt ends with tokens the request already
produced (prefill's first token; what was sent before a migration). vLLM counts them as
prompt, but OpenAI's presence and frequency penalties count only output. This vLLM
logits processor adds, for each such token, what the engine's own penalties leave out,
so that the next token is the one a single engine would have picked.

The request names the tokens in ``SamplingParams.extra_args[OUTPUT_IN_PROMPT]``
(``vllm_engine.to_sampling_params`` puts them there); requests without them cost
nothing. vLLM applies this processor before its penalties, which are
``rep(l) - f*c - p*[c > 0]`` (``rep``: the repetition penalty, multiplicative). For a
token ``t`` counted ``c_p`` times in the prompt's output and ``c_e`` times in this
engine's output, one engine would subtract ``f*(c_p+c_e) + p*[c_p+c_e > 0]`` after
``rep``; this engine subtracts ``f*c_e + p*[c_e > 0]``. So the logit here becomes
``rep⁻¹(rep(l) - f*c_p - p*[c_e = 0])``, and the engine's penalties then give exactly
one engine's value. (``t`` is in the prompt, so ``rep`` applies to it on both.)

The structured-output grammar and ``min_tokens`` are advanced elsewhere: the grammar by
the connector's scheduler side (``kv_transfer/scheduler_side.py``), ``min_tokens`` by
subtracting the count when the request is built.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pdserve.kv_transfer.continuation import OUTPUT_IN_PROMPT

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig



@dataclass(frozen=True)
class _Row:
    token_ids: torch.Tensor  # the distinct output-in-prompt tokens
    counts: torch.Tensor  # how often each occurs there
    distinct: tuple[int, ...]
    output: list[int]  # vLLM's live list of this engine's output tokens
    presence: float
    frequency: float
    repetition: float


def _row(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> _Row | None:
    prior = (params.extra_args or {}).get(OUTPUT_IN_PROMPT)
    if not prior or not (params.presence_penalty or params.frequency_penalty):
        return None
    counts = Counter(int(t) for t in prior)
    distinct = tuple(counts)
    return _Row(torch.tensor(distinct, dtype=torch.long),
                torch.tensor([counts[t] for t in distinct], dtype=torch.float32),
                distinct, output, float(params.presence_penalty),
                float(params.frequency_penalty), float(params.repetition_penalty))


def _repeat(x: torch.Tensor, rep: float) -> torch.Tensor:
    return torch.where(x > 0, x / rep, x * rep)


def _unrepeat(x: torch.Tensor, rep: float) -> torch.Tensor:
    return torch.where(x > 0, x * rep, x / rep)


class OutputInPromptPenalties(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self._rows.items():
            ids = row.token_ids.to(logits.device)
            logits[index, ids] = self._adjusted(logits[index, ids], row)
        return logits

    @staticmethod
    def _adjusted(values: torch.Tensor, row: _Row) -> torch.Tensor:
        seen = set(row.output)
        unseen = torch.tensor([t not in seen for t in row.distinct], dtype=values.dtype,
                              device=values.device)
        extra = row.frequency * row.counts.to(values.device) + row.presence * unseen
        if row.repetition == 1.0:
            return values - extra
        return _unrepeat(_repeat(values, row.repetition) - extra, row.repetition)


def output_in_prompt_args(prompt_token_ids: Any, num_output_in_prompt: int
                          ) -> dict[str, list[int]]:
    """The ``extra_args`` entry naming a call's output-in-prompt tokens (none: empty)."""
    if num_output_in_prompt <= 0:
        return {}
    return {OUTPUT_IN_PROMPT: [int(t) for t in prompt_token_ids[-num_output_in_prompt:]]}
