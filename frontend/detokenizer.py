"""Incremental detokenization and stop strings: the text a request may show the client so far."""

from __future__ import annotations

from frontend.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so that tokenizers which drop a leading space on
# the first decoded token (SentencePiece) still produce the space between prompt and output.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's token ids into text, a step at a time, never splitting a character.

    Invariant: the text of `_token_ids[_read_offset:]` has not been returned yet; the tokens
    before `_read_offset` are decoded again as context, so that the new text is the difference of
    two decodes. `_prefix_text` caches the context's decode while it stays the same.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._token_ids)
        self._prefix_text: str | None = None

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Text that became readable with these tokens; held back while it ends mid-character,
        unless `final` (the request has ended): then everything, replacement characters included."""
        self._token_ids.extend(token_ids)
        if self._prefix_text is None:
            self._prefix_text = self._tokenizer.decode(self._token_ids[:self._read_offset], self._skip_special_tokens)
        prefix_len = len(self._prefix_text)
        full_text = self._tokenizer.decode(self._token_ids, self._skip_special_tokens)
        # A byte-level token can end inside a multi-byte character; decode shows U+FFFD there.
        if not final and (len(full_text) <= prefix_len or full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        # Tokens before the read offset are never decoded again: keep the list short.
        del self._token_ids[:self._read_offset]
        self._read_offset = len(self._token_ids)
        self._prefix_text = None
        return full_text[prefix_len:]


class OutputText:
    """One request's output text with stop strings applied.

    Invariant: `text[:num_emitted_chars]` has been sent to the client and is final; it is kept as
    a list of pieces and only the unsent rest (`_unsent`) is searched, so a token costs the same
    however long the output is. While streaming, a suffix that could still grow into a stop
    string is held back, so no part of a stop string is ever emitted. A stop string counts only
    when it ends after `min_tokens` tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str] | None = None, min_tokens: int = 0, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = [s for s in (stop or []) if s]
        self._min_tokens = min_tokens
        self._include_stop = include_stop  # a matched stop string ends the text rather than being cut
        self._sent_pieces: list[str] = []  # text[:num_emitted_chars], as released
        self._unsent = ""  # text[num_emitted_chars:]: shorter than the longest stop string between pushes
        self.num_emitted_chars = 0
        self.num_tokens = 0
        self.stopped = False  # a stop string matched: the text is final, the engine must abort
        self.matched_stop: str | None = None  # the stop string that matched (vLLM's stop_reason)

    @property
    def text(self) -> str:
        if len(self._sent_pieces) > 1:
            self._sent_pieces = ["".join(self._sent_pieces)]
        return "".join(self._sent_pieces) + self._unsent

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add one step's tokens; return the text that is now safe to send.

        `final` means the engine finished the request: nothing more is held back.
        """
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        new_text = self._detokenizer.push(token_ids, final)
        old_unsent_len = len(self._unsent)
        self._unsent += new_text
        checking_stops = bool(self._stop) and self.num_tokens >= self._min_tokens
        if checking_stops and new_text:
            # Only a match that ends in the new text is new; all of it lies in the unsent text.
            stop_at = self._find_stop(old_unsent_len)
            if stop_at is not None:
                matched_len = self._matched_len(stop_at)
                self.matched_stop = self._unsent[stop_at:stop_at + matched_len]
                stop_at += matched_len if self._include_stop else 0
                self._unsent = self._unsent[:stop_at]
                self.stopped = True
                return self._release(stop_at)
        if final or not self._stop:
            return self._release(len(self._unsent))
        # Before min_tokens too: a stop string that begins now may end after it.
        return self._release(len(self._unsent) - self._partial_stop_len())

    def _find_stop(self, new_from: int) -> int | None:
        """The earliest stop string that ends in `_unsent[new_from:]` (the new text), as an index
        into `_unsent`; one that ended before (held back before min_tokens) does not count."""
        found = (self._unsent.find(s, max(new_from - len(s) + 1, 0)) for s in self._stop)
        return min((p for p in found if p >= 0), default=None)

    def _matched_len(self, at: int) -> int:
        """Length of the longest stop string that begins at `_unsent[at]`."""
        return max(len(s) for s in self._stop if self._unsent.startswith(s, at))

    def _partial_stop_len(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        room = len(self._unsent)
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, room), longest, -1):
                if self._unsent.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, end: int) -> str:
        """Send `_unsent[:end]`."""
        released, self._unsent = self._unsent[:end], self._unsent[end:]
        if released:
            self._sent_pieces.append(released)
            self.num_emitted_chars += len(released)
        return released
