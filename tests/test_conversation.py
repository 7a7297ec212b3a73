"""kvcandle.Conversation: turns over one cache; undo, fork and save/load give exactly what
a fresh conversation gives."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcandle

SYSTEM = "You are a terse assistant."
GREEDY = dict(max_tokens=12)


def test_turns_reuse_the_cache(default_model: kvcandle.Model) -> None:
    chat = kvcandle.Conversation(default_model, system=SYSTEM)
    first = chat.send("What is the capital of France?", **GREEDY)
    assert "Paris" in first.text
    said = len(chat.tokens)
    second = chat.send("And of Italy?", **GREEDY)
    # only the new turn's tokens ran: the first exchange came from the cache (all of it
    # but its end-of-turn token, and the last reply token when cut by max_tokens)
    assert second.stats.reused_tokens >= said - 2
    assert second.stats.reused_tokens + second.stats.prefill_tokens == second.stats.prompt_tokens
    assert chat.turns == 2 and [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.cache.tokens == chat.tokens[: len(chat.cache)]


def test_undo_gives_what_a_fresh_conversation_gives(default_model: kvcandle.Model) -> None:
    chat = kvcandle.Conversation(default_model, system=SYSTEM)
    chat.send("What is the capital of France?", **GREEDY)
    after_one = (chat.tokens, chat.messages, chat.cache.tokens)
    chat.send("And of Spain?", **GREEDY)
    assert chat.undo()
    # exactly the state before the exchange, cache included: what follows computes the same
    assert (chat.tokens, chat.messages, chat.cache.tokens) == after_one
    again = chat.send("And of Italy?", **GREEDY)
    fresh = kvcandle.Conversation(default_model, system=SYSTEM)
    fresh.send("What is the capital of France?", **GREEDY)
    want = fresh.send("And of Italy?", **GREEDY)
    assert again.tokens == want.tokens and chat.tokens == fresh.tokens
    chat.undo(), chat.undo()
    assert not chat.undo() and chat.tokens == [] and len(chat.cache) == 0


def test_fork_shares_the_past_and_nothing_after(default_model: kvcandle.Model) -> None:
    chat = kvcandle.Conversation(default_model)
    chat.send("Name a colour.", **GREEDY)
    branch = chat.fork()
    a = chat.send("Name a fruit.", **GREEDY)
    b = branch.send("Name an animal.", **GREEDY)
    fresh = kvcandle.Conversation(default_model)
    fresh.send("Name a colour.", **GREEDY)
    assert b.tokens == fresh.send("Name an animal.", **GREEDY).tokens
    assert chat.messages[-2]["content"] == "Name a fruit." and branch.messages[-2]["content"] == "Name an animal."
    assert a.text and chat.tokens != branch.tokens


def test_save_and_load_continue_exactly(default_model: kvcandle.Model, tmp_path: Path) -> None:
    chat = kvcandle.Conversation(default_model, system=SYSTEM)
    chat.send("What is the capital of France?", **GREEDY)
    chat.save(tmp_path / "chat")
    back = kvcandle.Conversation.load(tmp_path / "chat", default_model)
    assert (back.tokens, back.messages, back.system, back.turns) == (chat.tokens, chat.messages, chat.system, chat.turns)
    assert back.cache.tokens == chat.cache.tokens
    assert back.send("And of Italy?", **GREEDY).tokens == chat.send("And of Italy?", **GREEDY).tokens
    # a plain cache file holds no conversation
    chat.cache.save(tmp_path / "plain")
    with pytest.raises(kvcandle.CacheFileError, match="no conversation"):
        kvcandle.Conversation.load(tmp_path / "plain", default_model)


def test_stopping_early_records_the_reply_so_far(default_model: kvcandle.Model) -> None:
    chat = kvcandle.Conversation(default_model)
    stream = chat.stream("Count from one to twenty.", max_tokens=40)
    next(stream)
    stream.close()
    assert chat.turns == 1 and chat.messages[-1]["role"] == "assistant"
    assert chat.cache.tokens == chat.tokens[: len(chat.cache)]


def test_the_reply_is_recorded_as_the_caller_got_it(default_model: kvcandle.Model) -> None:
    """A reply cut by a stop string (or inside a character by max_tokens) was recorded
    with what the caller never got (the stop string), and later turns built on it. The
    assistant message is the text returned; the next turn runs what the template renders
    of the messages, as a fresh generation from that rendering does."""
    tok = default_model.tokenizer
    for first_turn in (dict(max_tokens=20, stop=["Paris"]), dict(max_tokens=1)):
        chat = kvcandle.Conversation(default_model, system=SYSTEM)
        first = chat.send("What is the capital of France? Answer with the city's name in Japanese.", **first_turn)
        assert chat.messages[-1] == {"role": "assistant", "content": first.text}
        if "stop" in first_turn:
            assert first.finish_reason == "stop" and "Paris" not in first.text and "Paris" in tok.decode(first.tokens)
        second = chat.send("And of Italy?", **GREEDY)
        rendered = tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)
        want = kvcandle.generate(default_model, tok.encode(rendered, add_special_tokens=False), **GREEDY)
        assert second.tokens == want.tokens and second.stats.prompt_tokens == want.stats.prompt_tokens
        assert chat.cache.tokens == chat.tokens[: len(chat.cache)]


def test_bad_input(default_model: kvcandle.Model, tiny: kvcandle.Model) -> None:
    chat = kvcandle.Conversation(default_model)
    with pytest.raises(kvcandle.InputError):
        chat.send("   ")
    with pytest.raises(TypeError):
        chat.send(42)  # type: ignore[arg-type]
    with pytest.raises(kvcandle.InputError, match="temperature"):
        chat.send("hi", temperature=-1)
    assert chat.turns == 0 and chat.tokens == []
    with pytest.raises(kvcandle.InputError, match="chat template"):
        kvcandle.Conversation(tiny)
