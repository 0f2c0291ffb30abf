"""Incremental detokenization never splits a character; stop strings truncate and never leak."""

from __future__ import annotations

import pytest

from frontend.detokenizer import IncrementalDetokenizer, OutputText

pytestmark = pytest.mark.anyio


def stream_text(output: OutputText, token_ids: list[int]) -> list[str]:
    """Push tokens one step at a time, the last step final; return the emitted pieces."""
    pieces = [output.push([t]) for t in token_ids[:-1]]
    return pieces + [output.push(token_ids[-1:], final=True)]


def test_multibyte_characters_are_never_split_across_deltas(tokenizer):
    text = "你好🙂 wörld"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # The test means something only if some single token is an incomplete character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say hi:"))
    pieces = [detokenizer.push([t]) for t in token_ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.push([], final=True) == text


def test_a_final_push_returns_an_incomplete_character_at_the_end(tokenizer):
    emoji_ids = tokenizer.encode("🙂", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [5])
    assert detokenizer.push(emoji_ids[:1]) == ""
    assert "\ufffd" in detokenizer.push([], final=True)


def test_special_tokens_are_left_out_of_the_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [5])
    eos = tokenizer.eos_token_id
    assert detokenizer.push(tokenizer.encode("Paris", add_special_tokens=False) + [eos]) == "Paris"


def test_stop_string_across_token_boundaries_truncates_and_never_leaks(tokenizer):
    token_ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    output = OutputText(tokenizer, [5], stop=["France is"])
    pieces = stream_text(output, token_ids)
    assert output.stopped
    assert output.text == "The capital of "
    assert "".join(pieces) == "The capital of "
    assert not any("F" in piece for piece in pieces)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    token_ids = tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
    output = OutputText(tokenizer, [5], stop=["fox", "quick"])
    assert "".join(stream_text(output, token_ids)) == "The "
    assert output.stopped


def test_text_held_back_for_a_stop_string_is_released_when_it_cannot_match(tokenizer):
    token_ids = tokenizer.encode("Paris is nice", add_special_tokens=False)
    output = OutputText(tokenizer, [5], stop=["Paris!"])
    pieces = stream_text(output, token_ids)
    assert "".join(pieces) == "Paris is nice"
    assert not output.stopped


def test_stop_strings_wait_for_min_tokens(tokenizer):
    token_ids = tokenizer.encode("The fox and the fox", add_special_tokens=False)
    first_fox_end = len(tokenizer.encode("The fox", add_special_tokens=False))
    output = OutputText(tokenizer, [5], stop=["fox"], min_tokens=first_fox_end + 1)
    assert "".join(stream_text(output, token_ids)) == "The fox and the "


def test_a_stop_string_that_begins_before_min_tokens_and_ends_after_it_stops(tokenizer):
    token_ids = tokenizer.encode("The capital of France", add_special_tokens=False)
    before = len(tokenizer.encode("The capital", add_special_tokens=False))
    assert tokenizer.decode(token_ids[:before]) == "The capital"  # " of" comes with the next token
    output = OutputText(tokenizer, [5], stop=["capital of"], min_tokens=before + 1)
    assert "".join(stream_text(output, token_ids)) == "The " and output.stopped


def test_a_stop_string_that_ends_before_min_tokens_does_not_count_even_when_held_back(tokenizer):
    token_ids = tokenizer.encode("The capital of France", add_special_tokens=False)
    output = OutputText(tokenizer, [5], stop=["The", "The dog"], min_tokens=2)  # "The" could grow
    assert "".join(stream_text(output, token_ids)) == "The capital of France" and not output.stopped


def test_with_include_stop_the_longest_stop_string_matched_ends_the_text(tokenizer):
    token_ids = tokenizer.encode("The capital of France", add_special_tokens=False)
    output = OutputText(tokenizer, [5], stop=["cap", "capital", "Fra"], include_stop=True)
    assert "".join(stream_text(output, token_ids)) == "The capital" and output.stopped


def test_a_long_output_streams_the_same_text_and_stops_at_its_end(tokenizer):
    sentence = "Paris is the capital of France, 你好🙂 wörld. "
    body = sentence * 200
    token_ids = tokenizer.encode(body + "THE END and more", add_special_tokens=False)
    assert len(token_ids) > 2000  # long enough that per-token cost would show if it grew
    plain = OutputText(tokenizer, [5])
    assert "".join(stream_text(plain, token_ids)) == plain.text == tokenizer.decode(token_ids)
    stopped = OutputText(tokenizer, [5], stop=["THE END", "zzz"])
    pieces = stream_text(stopped, token_ids)
    assert stopped.stopped
    assert "".join(pieces) == stopped.text == body
    assert stopped.num_emitted_chars == len(body)
    assert not any("THE" in piece for piece in pieces)


def test_a_final_step_of_several_tokens_releases_everything_at_once(tokenizer):
    token_ids = tokenizer.encode("Paris is nice 🙂", add_special_tokens=False)
    output = OutputText(tokenizer, [5], stop=["nice!"])
    assert output.push(token_ids[:2]) + output.push(token_ids[2:], final=True) == "Paris is nice 🙂"
    assert output.text == "Paris is nice 🙂"


async def test_stop_string_over_http_finishes_with_stop_and_aborts_the_engine(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50,
                                                           "stop": ["of Fr", "zzz"]})
    body = response.json()
    assert body["choices"][0]["text"] == "Paris is the capital "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [engine.added[0].request_id]


async def test_streamed_stop_string_never_reaches_the_client(client, engine, sse):
    engine.tokens_per_step = 2
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stop": "capital of", "stream": True})
    events, done = sse(response.text)
    assert done
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == "Paris is the "
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [engine.added[0].request_id]


async def test_stop_string_in_the_last_step_does_not_abort_a_finished_request(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "x", "stop": "France."})
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == []
