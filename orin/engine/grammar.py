"""Grammars for structured output: any JSON value, or JSON that follows a schema.

The grammars are GBNF text, built by llama-cpp-python's converter; the engine
parses them against the model's vocabulary when it builds a request's sampler
(a grammar that does not parse is an ``InvalidRequest`` there). This module is
where the server gets them, so that nothing above the engine imports llama_cpp.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from orin.engine.errors import InvalidRequest
from orin.llamacpp import llama


def _converter() -> ModuleType:
    llama()  # llama_cpp imported once, with its log routed (LlamaCppError when missing)
    from llama_cpp import llama_grammar

    return llama_grammar


def json_grammar() -> str:
    """Any JSON value (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return str(_converter().JSON_GBNF)


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format") -> str:
    """JSON that follows ``schema``; InvalidRequest naming ``param`` when the
    converter cannot turn it into a grammar."""
    if not schema:
        raise InvalidRequest(param, "a json_schema needs a schema")
    try:
        return str(_converter().json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # the converter raises plain exceptions on bad schemas
        raise InvalidRequest(param, f"cannot turn the schema into a grammar: {exc}") from exc
