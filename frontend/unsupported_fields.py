"""Request fields of OpenAI's and vLLM's APIs that conveyor does not implement: asking for one is a
400 naming the field (and what to use instead), never an answer that silently ignores it. Each
field lists the values that ask nothing of the server (a client library may always send them)."""

from __future__ import annotations

from typing import Any

from frontend.errors import bad_request
from frontend.protocol import SamplingFields

# vLLM request fields conveyor does not implement: the values that ask nothing of the server, and
# what to use instead, if anything. Any other value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), ""),
    "logits_processors": ((None, []), ""),
}

# The same for chat requests: values that ask nothing, and what to use instead.
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "send them as tools"),
    "function_call": ((None, "none"), "use tool_choice"),
    "chat_template": ((None,), "the model's own chat template renders every conversation"),
    "echo": ((None, False), "/v1/completions with echo returns the prompt with the output"),
}


def refuse_unsupported(request: SamplingFields, fields: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """A 400 naming the first of `fields` set to a value that asks something of the server."""
    for name, (harmless, instead) in fields.items():
        value = getattr(request, name)  # of the harmless value's type too: 1 is not True, 0.0 not None
        if not any(type(value) is type(allowed) and value == allowed for allowed in harmless):
            raise bad_request(f"{name} is not supported by this server{f': {instead}' if instead else ''}", name)
