"""The grammar a request's output follows: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extension, validated here and carried to both engines as one
``StructuredOutput`` (vLLM's structured-output backend compiles and applies it there).

Across a handoff the grammar holds: prefill samples the first token under it, and the
decode engine resumes it after that token (``kv_transfer/continuation.py``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.core.types import StructuredOutput


class JsonSchemaFormat(BaseModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object``, ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self


class StructuredOutputsParam(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``,
    ``choice``, ``grammar`` (EBNF/Lark), ``json_object``."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParam:
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        if self.regex == "" or self.grammar == "" or self.choice is not None and "" in self.choice:
            raise ValueError("a regex, a grammar or a choice must not be empty")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"regex does not compile: {exc}") from None
        if isinstance(self.json_, str):
            try:
                json.loads(self.json_)
            except ValueError as exc:
                raise ValueError(f"json is not a JSON schema: {exc}") from None
        return self

    def to_spec(self) -> StructuredOutput:
        if self.json_ is not None:
            text = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json", text)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        return StructuredOutput("json_object")


def structured_output(response_format: ResponseFormat | None,
                      structured_outputs: StructuredOutputsParam | None
                      ) -> StructuredOutput | None:
    """The grammar the request asks for (None: free text)."""
    if structured_outputs is not None:
        return structured_outputs.to_spec()
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema is None:
        return StructuredOutput("json_object")  # (json_schema always has one: validated)
    return StructuredOutput("json", json.dumps(response_format.json_schema.schema_))

