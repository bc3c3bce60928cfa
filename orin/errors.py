"""The root of every error orin-llm raises on purpose.

Surfaces (CLI, server) map these types to exit codes and HTTP statuses in one
table each; nothing matches on message text.
"""

from __future__ import annotations

import re


class OrinError(Exception):
    """An expected failure with a message fit to show a user as one line."""


class ModelFileError(OrinError):
    """A model file is missing, unreadable, not GGUF, truncated or unsupported."""


class ProfileError(OrinError):
    """A profile cannot be found, parsed or validated."""


class KVConfigError(OrinError):
    """A KV-cache configuration that llama.cpp would refuse or run badly."""


class DemoModelError(OrinError):
    """A generated model cannot be made as asked."""


class LlamaCppError(OrinError):
    """llama.cpp is missing or failed in a way the caller cannot fix by input."""


class BindError(OrinError):
    """The server cannot listen where it was told: the address is in use or not this host's."""


class HubError(OrinError):
    """A model cannot be fetched from the hub: not found, refused, or a checksum mismatch."""


class RpcWorkerError(LlamaCppError):
    """An RPC worker (``serve --rpc``) cannot be reached, offers no device, or was lost."""


def os_error_text(text: str) -> str:
    """An OS error's words without its number: '[Errno 111] Connection refused' ->
    'connection refused'."""
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", text)
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def unreachable(url: str, error: str | None) -> str:
    """What a client says when no server answers at ``url``."""
    return f"nothing answers at {url}" + (f": {error}" if error else "")


class Terminated(BaseException):
    """SIGTERM arrived where the CLI turns it into an exception (``sigterm_interrupts``
    in orin/cli/errors.py). A BaseException, as KeyboardInterrupt is, so that what
    cleans up after a Ctrl-C cleans up after it too and no ``except Exception``
    swallows it."""


def interruption(exc: BaseException) -> str:
    """How a user stopped the program, for messages: ``SIGTERM`` or ``Ctrl-C``."""
    return "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
