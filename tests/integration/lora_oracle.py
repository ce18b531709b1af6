"""The oracle of ``test_lora_pd.py``: two random adapters (``lora_adapters.py``) and one
aggregated vLLM engine with them (``lora_reference.py``), greedy, float32, on each
prompt under the base model and each adapter. ``start`` makes the adapters and launches
the engine (conftest's ``_early_oracles`` does, at the session's first test, beside the
other oracles' engines); ``get`` waits for its tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from integration.pd_cases import LONG
from lora_adapters import make_adapter
from pdserve_testing import kill_cluster

from pdserve.core import process

MAX_TOKENS = 16
SHORT = "The capital of France is"
LONG_PROMPT = LONG + "\nQuestion: which way does the river run?\nAnswer:"
ADAPTERS = ("sql", "chat")
RUN_TIMEOUT_S = 600

Reference = dict[tuple[str, str | None], list[int]]  # (prompt kind, adapter) -> tokens


def prompts(tokenizer: Any) -> dict[str, list[int]]:
    return {"short": tokenizer.encode(SHORT), "long": tokenizer.encode(LONG_PROMPT)}


class LoraOracle:
    def __init__(self, model_path: Path, tokenizer: Any, folder: Path) -> None:
        self._model_path, self._tokenizer, self.folder = model_path, tokenizer, folder
        self.adapters: dict[str, Path] = {}
        self._cases: list[dict[str, Any]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._done: Reference | None = None

    def start(self) -> None:
        if self.adapters:
            return
        self.adapters = {name: make_adapter(self._model_path, self.folder / name, seed)
                         for seed, name in enumerate(ADAPTERS, 1)}
        self._cases = [{"prompt_token_ids": ids, "max_tokens": MAX_TOKENS, "lora_name": lora,
                        "lora_path": str(self.adapters[lora]) if lora else None,
                        "case": [kind, lora]}
                       for kind, ids in prompts(self._tokenizer).items()
                       for lora in (None, *ADAPTERS)]
        (self.folder / "in.json").write_text(json.dumps(self._cases))
        self._proc = process.spawn(
            [sys.executable, str(Path(__file__).with_name("lora_reference.py")),
             str(self._model_path), str(self.folder / "in.json"),
             str(self.folder / "out.json")], log_path=self.folder / "ref.log")

    def get(self) -> Reference:
        if self._done is None:
            self.start()
            assert self._proc is not None
            try:
                code = self._proc.wait(timeout=RUN_TIMEOUT_S)
                assert code == 0, f"the LoRA reference failed: {self.folder}/ref.log"
            finally:
                self.close()
            outputs = json.loads((self.folder / "out.json").read_text())
            self._done = {(case["case"][0], case["case"][1]): out
                          for case, out in zip(self._cases, outputs, strict=True)}
        return self._done

    def close(self) -> None:
        if self._proc is not None:
            kill_cluster(self._proc)
            self._proc = None
