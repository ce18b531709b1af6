"""What a worker asks of vLLM per call (``worker/vllm/engine.py``). Output that reaches a
decode engine inside its prompt is penalized as output
(``pdserve/worker/output_in_prompt.py``): our logits processor, then vLLM's own
penalties over the shorter output, give exactly vLLM's penalties over the whole output.
And the engine never detokenizes: the router owns text."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import BatchUpdate

from pdserve.kv_transfer.continuation import OUTPUT_IN_PROMPT
from pdserve.worker.output_in_prompt import OutputInPromptPenalties, output_in_prompt_args

VOCAB = 12


def _params(presence: float, frequency: float, repetition: float,
            prior: list[int] | None) -> Any:
    return SimpleNamespace(presence_penalty=presence, frequency_penalty=frequency,
                           repetition_penalty=repetition,
                           extra_args={OUTPUT_IN_PROMPT: prior} if prior else None)


def _penalize(logits: torch.Tensor, prompt: list[int], output: list[int],
              presence: float, frequency: float, repetition: float) -> torch.Tensor:
    pad = lambda ids: torch.tensor([ids or [VOCAB]], dtype=torch.long)  # noqa: E731
    return apply_penalties(logits.clone(), pad(prompt), pad(output),
                           torch.tensor([presence]), torch.tensor([frequency]),
                           torch.tensor([repetition]))


@pytest.mark.parametrize(("presence", "frequency", "repetition"), [
    (1.5, 0.0, 1.0), (0.0, 0.7, 1.0), (1.0, 0.5, 1.3), (-0.5, 1.2, 0.8)])
def test_penalties_over_output_in_the_prompt_equal_one_engines(
        presence: float, frequency: float, repetition: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    prompt, prior, engine_output = [1, 2, 3], [4, 5, 4], [5, 6]
    # One engine: the prompt, and all of the output.
    want = _penalize(logits, prompt, [*prior, *engine_output], presence, frequency, repetition)
    # A decode call: the prior output is in its prompt; its own output is the rest.
    processor = OutputInPromptPenalties(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    processor.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[
        (0, _params(presence, frequency, repetition, prior), [*prompt, *prior],
         engine_output)]))
    got = _penalize(processor.apply(logits.clone()), [*prompt, *prior], engine_output,
                    presence, frequency, repetition)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_requests_without_output_in_the_prompt_are_left_alone() -> None:
    logits = torch.randn(2, VOCAB)
    processor = OutputInPromptPenalties(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    processor.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, _params(1.0, 1.0, 1.0, None), [1], []),  # starts a request
        (1, _params(0.0, 0.0, 1.0, [3]), [1, 3], [])]))  # continues one, no penalty asked
    assert torch.equal(processor.apply(logits.clone()), logits)


def test_the_tokens_named_are_the_prompts_last() -> None:
    assert output_in_prompt_args([9, 8, 7, 6], 2) == {OUTPUT_IN_PROMPT: [7, 6]}
    assert output_in_prompt_args([9, 8], 0) == {}


def test_engines_do_not_detokenize() -> None:
    """The router owns text: every call asks vLLM for token ids alone (logprobs too)."""
    from pdserve.core.types import SamplingSpec
    from pdserve.worker.engine import EngineParams
    from pdserve.worker.vllm.engine import to_sampling_params

    params = to_sampling_params(SamplingSpec(max_tokens=8, temperature=0.0, logprobs=2),
                                EngineParams(max_tokens=8, prompt_logprobs=1), [1, 2, 3])
    assert params.detokenize is False
    assert params.logprobs == 2 and params.prompt_logprobs == 1
