"""One choice of a request in the frontend: its text, stop strings, tokens and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.detokenizer import OutputText
from frontend.engine_outputs import EngineDelta, TokenLogprob
from frontend.tokenizer import Tokenizer
from proto.messages import FinishReason


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice adds to the response in one step; `finish_reason` is set on its last one.

    `logprobs` (when the request asked for them) align with `token_ids`, the tokens this step
    consumed, whose text may still be held back (a partial character or stop string).
    """

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    finish_reason: FinishReason = FinishReason.NONE
    error_message: str = ""


class ChoiceOutput:
    """One choice's own detokenizer and stop-string state.

    Invariant: once `finish_reason` is set the choice is final and later engine tokens for it are
    ignored; `engine_finished` says whether the scheduler ended it too (else it still runs there).
    A stop token that ends the choice (`stop_token_ids`: the request's, and EOS unless ignore_eos)
    counts as an output token (usage, logprobs) but its text is not part of the output, as in vLLM.
    """

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str], min_tokens: int, wants_logprobs: bool,
                 stop_token_ids: frozenset[int] = frozenset(), include_stop_str: bool = False,
                 skip_special_tokens: bool = True, asked_stop_token_ids: frozenset[int] = frozenset()) -> None:
        """`stop_token_ids`: those whose text is left out when they end the choice;
        `include_stop_str`: a matched stop string stays in the text; `skip_special_tokens`
        False: special tokens' text is part of it; `asked_stop_token_ids`: the request's own
        stop_token_ids (not EOS), whose id becomes the stop_reason of a choice they end."""
        self.index = index
        self._stop_token_ids = stop_token_ids
        self.output = OutputText(tokenizer, prompt_token_ids, stop, min_tokens, include_stop_str,
                                 skip_special_tokens)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.wants_logprobs = wants_logprobs
        self.num_tokens = 0  # output tokens consumed (usage, metrics)
        # Kept only when logprobs are wanted: the final logprobs block is their only reader.
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob | None] = []  # aligned with token_ids
        self.num_cached_tokens = 0
        self.finish_reason = FinishReason.NONE
        self.error_message = ""
        self.error_code = ""  # the engine's name for the kind of an "error" finish, e.g. "queue_full"
        self.engine_finished = False
        self._asked_stop_token_ids = asked_stop_token_ids
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it

    @property
    def text(self) -> str:
        return self.output.text

    def push(self, delta: EngineDelta) -> ChoiceDelta | None:
        """Consume one engine delta for this choice; None when there is nothing to tell."""
        if delta.finish_reason:
            self.engine_finished = True
        if self.finish_reason:
            return None
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        text_ids = delta.token_ids
        if delta.finish_reason == FinishReason.STOP and text_ids and text_ids[-1] in self._stop_token_ids:
            text_ids = text_ids[:-1]
        text = self.output.push(text_ids, final=bool(delta.finish_reason))
        logprobs: tuple[TokenLogprob | None, ...] = ()
        if self.wants_logprobs:
            logprobs = self._align_logprobs(delta)
            self.token_ids.extend(delta.token_ids)
            self.logprobs.extend(logprobs)
        self.num_tokens += len(delta.token_ids)
        if self.output.stopped:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = self.output.matched_stop
        elif delta.finish_reason:
            if (delta.finish_reason == FinishReason.STOP and delta.token_ids
                    and delta.token_ids[-1] in self._asked_stop_token_ids):
                self.stop_reason = delta.token_ids[-1]
            self.finish_reason = delta.finish_reason
            self.error_message = delta.error_message
            self.error_code = delta.error_code
        if not (text or delta.token_ids or self.finish_reason):
            return None
        return ChoiceDelta(self.index, text, tuple(delta.token_ids), logprobs, self.finish_reason,
                           self.error_message)

    def end(self, finish_reason: FinishReason, error_message: str = "") -> ChoiceDelta:
        """Finish now (abort before the engine heard of it, or the stream was cut)."""
        self.finish_reason = finish_reason
        self.error_message = error_message
        return ChoiceDelta(self.index, "", finish_reason=finish_reason, error_message=error_message)

    def _align_logprobs(self, delta: EngineDelta) -> tuple[TokenLogprob | None, ...]:
        """The entry of each new token, by its sequence position (None where the engine sent none)."""
        by_position = {entry.position: entry for entry in delta.logprobs}
        first_position = self.num_prompt_tokens + self.num_tokens
        return tuple(by_position.get(first_position + offset) for offset in range(len(delta.token_ids)))
