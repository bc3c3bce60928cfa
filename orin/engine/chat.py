"""Chat messages -> prompt text, with the model's own Jinja chat template."""

from __future__ import annotations

from typing import Any

from orin.engine.errors import InvalidRequest


class ChatTemplate:
    """Renders messages with the GGUF metadata's template (or the profile's override)
    through llama-cpp-python's sandboxed Jinja2 formatter."""

    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.template = template
        self.bos_token = bos_token
        self._formatter: Any = None
        if template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            self._formatter = Jinja2ChatFormatter(template, eos_token, bos_token)

    def render(self, messages: list[dict[str, str]]) -> tuple[str, bool]:
        """(prompt, whether the tokenizer should still add BOS)."""
        if self._formatter is None:
            raise InvalidRequest(
                "messages",
                "this model has no chat template; use /v1/completions or set "
                "model.chat_template in the profile",
            )
        try:
            prompt = str(self._formatter(messages=messages).prompt)
        except Exception as exc:  # the template may raise on messages it does not accept
            raise InvalidRequest("messages", f"the chat template rejected them: {exc}") from exc
        # a template that writes the BOS token itself must not get a second one
        return prompt, not (self.bos_token and prompt.startswith(self.bos_token))
