"""Errors shared by every process: bad user input and malformed wire frames."""


class ValidationError(ValueError):
    """Invalid user input; `param` names the offending field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ProtocolError(Exception):
    """A frame that cannot be decoded into a known, well-formed message."""
