"""Incremental detokenization and stop strings: the text a request may show the client so far."""

from __future__ import annotations

from frontend.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so that tokenizers which drop a leading space on
# the first decoded token (SentencePiece) still produce the space between prompt and output.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's token ids into text, a step at a time, never splitting a character.

    Invariant: text before `_read_offset` has been returned; `_prefix_offset` marks the tokens
    decoded again as context so that the new text is the difference of two decodes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def push(self, token_ids: list[int]) -> str:
        """Text that became readable with these tokens; held back while it ends mid-character."""
        self._token_ids.extend(token_ids)
        prefix_text, full_text = self._decode_window()
        # A byte-level token can end inside a multi-byte character; decode shows U+FFFD there.
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._drop_consumed_tokens()
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Everything still held back, replacement characters included (the request has ended)."""
        prefix_text, full_text = self._decode_window()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text):]

    def _decode_window(self) -> tuple[str, str]:
        window = self._token_ids[self._prefix_offset:]
        prefix_text = self._tokenizer.decode(window[:self._read_offset - self._prefix_offset])
        return prefix_text, self._tokenizer.decode(window)

    def _drop_consumed_tokens(self) -> None:
        # Tokens before the prefix window are never decoded again: keep the list short.
        del self._token_ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0


class OutputText:
    """One request's output text with stop strings applied.

    Invariant: `text[:num_emitted_chars]` has been sent to the client and is final. While
    streaming, a suffix that could still grow into a stop string is held back, so no part of a
    stop string is ever emitted. Stop strings are checked only after `min_tokens` tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str] | None = None, min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stop = [s for s in (stop or []) if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self.text = ""
        self.num_emitted_chars = 0
        self.num_tokens = 0
        self.stopped = False  # a stop string matched: the text is final, the engine must abort

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add one step's tokens; return the text that is now safe to send.

        `final` means the engine finished the request: nothing more is held back.
        """
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        new_text = self._detokenizer.push(token_ids)
        if final:
            new_text += self._detokenizer.flush()
        old_len = len(self.text)
        self.text += new_text
        checking_stops = bool(self._stop) and self.num_tokens >= self._min_tokens
        if checking_stops and new_text:
            stop_at = self._find_stop(max(old_len - self._max_stop_len + 1, self.num_emitted_chars))
            if stop_at is not None:
                self.text = self.text[:stop_at]
                self.stopped = True
                return self._release(stop_at)
        if final or not checking_stops:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_stop_len())

    def _find_stop(self, start: int) -> int | None:
        positions = [p for p in (self.text.find(s, start) for s in self._stop) if p >= 0]
        return min(positions, default=None)

    def _partial_stop_len(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        room = len(self.text) - self.num_emitted_chars
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, room), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, end: int) -> str:
        released = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return released
