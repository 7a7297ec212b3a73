"""``kvcandle.BatchGenerator`` (continuous batching) and ``stream_generate(..., n=...)``:
sequences join and leave at any step with their own settings, long prompts prefill in
chunks while other sequences keep generating, and every sequence's tokens are exactly
what ``generate`` gives it alone."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import kvcandle


def alone(model, prompt, **settings):
    return kvcandle.generate(model, prompt, **settings)


def same(result, one):
    return (result.text, result.tokens, result.finish_reason) == (one.text, one.tokens, one.finish_reason)


def test_sequences_join_and_leave_at_any_step(default_model):
    model = default_model
    batch = kvcandle.BatchGenerator(model)
    plans = {  # step at which each joins, its prompt and its settings
        0: ("The capital of France is", dict(max_tokens=10)),
        1: ("Once upon a time, a llama", dict(max_tokens=14, temperature=0.9, top_p=0.9, seed=3, stop=[" the"])),
        4: ("def add(a, b):", dict(max_tokens=6, temperature=0.7, top_k=20, seed=8)),
        5: ("1, 2, 3,", dict(max_tokens=9, repetition_penalty=1.3)),
    }
    ids, results, texts = {}, {}, {}
    for step in range(200):
        if step in plans:
            prompt, settings = plans[step]
            ids[batch.add(prompt, **settings)] = step
        if not batch and step > max(plans):
            break
        for piece in batch.step():
            texts[piece.index] = texts.get(piece.index, "") + piece.text
            if piece.finish_reason is not None:
                results[piece.index] = piece.result
    assert not batch and sorted(results) == sorted(ids) == [0, 1, 2, 3]
    for uid, step in ids.items():
        prompt, settings = plans[step]
        r, one = results[uid], alone(model, prompt, **settings)
        assert same(r, one), (prompt, r.text, one.text)
        assert texts[uid] == r.text  # the pieces join to the result
        fed = r.tokens if r.finish_reason == "eos" else r.tokens[:-1]
        assert r.cache.tokens == model.tokenizer.encode(prompt) + fed
        assert r.stats.generated_tokens == len(r.tokens) + (r.finish_reason == "eos")


def test_a_long_prompt_prefills_in_chunks_while_others_generate(default_model):
    model = default_model
    long_prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)
    assert len(long_prompt) > 2 * kvcandle.PREFILL_CHUNK
    batch = kvcandle.BatchGenerator(model)
    short = batch.add("The capital of France is", max_tokens=8)
    batch.step()  # the short one is generating
    long = batch.add(long_prompt, max_tokens=4)
    steps_before_long = 0
    pieces_meanwhile = 0
    results = {}
    while batch:
        out = batch.step()
        if not any(p.index == long for p in out) and long not in results:
            steps_before_long += 1
            pieces_meanwhile += sum(p.index == short for p in out)
        for p in out:
            if p.result is not None:
                results[p.index] = p.result
    # the long prompt took several steps (one chunk each), and the short sequence went on
    assert steps_before_long >= len(long_prompt) // kvcandle.PREFILL_CHUNK
    assert pieces_meanwhile >= 2
    assert same(results[long], alone(model, long_prompt, max_tokens=4))
    assert same(results[short], alone(model, "The capital of France is", max_tokens=8))
    assert results[long].stats.prefill_tokens == len(long_prompt)


def test_remove_hands_back_a_consistent_cache(default_model):
    model = default_model
    batch = kvcandle.BatchGenerator(model)
    prompt = model.tokenizer.encode("Once upon a time")
    keep = batch.add(prompt, max_tokens=20)
    gone = batch.add(prompt, max_tokens=20, temperature=1.0, seed=4)
    for _ in range(5):
        batch.step()
    r = batch.remove(gone)
    assert r.finish_reason == "removed" and len(r.tokens) == 5
    assert r.cache.tokens == prompt + r.tokens[:-1]  # the last sampled token was never run
    assert batch.indices == [keep]
    # its cache goes on where it stopped, as any cache does
    model.forward(r.tokens[-1:], r.cache)
    assert r.cache.tokens == prompt + r.tokens
    with pytest.raises(kvcandle.InputError, match="no sequence 1 in this batch"):
        batch.remove(gone)
    # removed while still prefilling: the cache holds a prefix of the prompt
    long = model.tokenizer.encode("word " * 600)
    early = batch.add(long, max_tokens=3)
    batch.step()
    r = batch.remove(early)
    assert r.tokens == [] and r.text == "" and 0 < len(r.cache) < len(long) and r.cache.tokens == long[: len(r.cache)]
    while batch:
        batch.step()


def test_bad_settings_and_a_cache_given_twice_are_refused_before_anything_runs(default_model):
    model = default_model
    batch = kvcandle.BatchGenerator(model)
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    for bad, name in ((dict(temperature=-1), "temperature"), (dict(top_p=2.0), "top_p"), (dict(max_tokens=0), "max_tokens"), (dict(seed=-3), "seed"), (dict(stop=[""]), "stop")):
        with pytest.raises(kvcandle.InputError, match=name):
            batch.add([1, 2, 9], cache=cache, **bad)
    assert len(batch) == 0 and cache.tokens == [1, 2, 3]
    with pytest.raises(kvcandle.InputError, match="empty"):
        batch.add("")
    batch.add([1, 2, 9], cache=cache)
    with pytest.raises(kvcandle.InputError, match="already generating in this batch"):
        batch.add([1, 2, 7], cache=cache)
    with pytest.raises(kvcandle.PositionError):
        batch.add(list(range(1, model.config.max_position_embeddings + 2)))
    with pytest.raises(TypeError, match="model"):
        kvcandle.BatchGenerator("not a model")
    assert len(batch) == 1


def test_an_interrupted_step_leaves_every_cache_consistent(default_model, monkeypatch):
    model = default_model
    batch = kvcandle.BatchGenerator(model)
    a = batch.add("The capital of France is", max_tokens=6)
    b = batch.add("Once upon a time", max_tokens=6, temperature=0.8, seed=2)
    batch.step()
    batch.step()
    real = model.forward_batch
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward_batch", interrupted)
    seqs = {s.uid: s for s in batch._seqs.values()}
    before = {uid: list(s.cache.tokens) for uid, s in seqs.items()}
    with pytest.raises(KeyboardInterrupt):
        batch.step()
    assert {uid: s.cache.tokens for uid, s in seqs.items()} == before
    results = {}
    while batch:
        for p in batch.step():
            if p.result is not None:
                results[p.index] = p.result
    assert same(results[a], alone(model, "The capital of France is", max_tokens=6))
    assert same(results[b], alone(model, "Once upon a time", max_tokens=6, temperature=0.8, seed=2))


def test_a_real_ctrl_c_during_a_step_leaves_every_cache_consistent(default_model):
    """A SIGINT that arrives while the engine runs is raised by the interpreter as the
    call returns, after the caches were appended to: the step must still leave every
    cache holding exactly its tokens, and the sequences must come out as they do alone."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only; this test runs in another")
    model = default_model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 40000, 300).tolist() for _ in range(6)]
    batch = kvcandle.BatchGenerator(model)
    for p in prompts:
        batch.add(p, max_tokens=3)
    seqs = list(batch._seqs.values())
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    clock = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            batch.step()  # six chunks of 256 prompt tokens in one forward_batch: seconds
    finally:
        timer.cancel()
    assert time.perf_counter() - clock >= 0.3  # raised by the signal, during the step
    assert all(len(s.cache) == 0 and len(s.feed) == 300 for s in seqs)
    results = {}
    while batch:
        for piece in batch.step():
            if piece.result is not None:
                results[piece.index] = piece.result
    for i, p in enumerate(prompts):
        assert same(results[i], alone(model, p, max_tokens=3))
        assert results[i].cache.tokens == p + results[i].tokens[:-1]


def test_a_sampling_that_raises_loses_no_piece_and_no_sequence(default_model):
    """One sequence's sampling raises after another finished in the same step: the
    finished one's last piece (its result) comes from the next step, and the one that
    raised samples its logits again then, neither lost nor stuck."""
    model = default_model
    batch = kvcandle.BatchGenerator(model)
    a = batch.add("The capital of France is", max_tokens=1)
    b = batch.add("Once upon a time", max_tokens=4, temperature=0.8, seed=2)
    sampler = batch._seqs[b].sampler
    calls = {"n": 0}

    def interrupted(logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return type(sampler).__call__(sampler, logits)

    batch._seqs[b].sampler = interrupted
    with pytest.raises(KeyboardInterrupt):
        batch.step()
    assert a not in batch.indices and b in batch.indices  # a finished before b raised
    results, first = {}, None
    for _ in range(10):
        if not batch:
            break
        pieces = batch.step()
        first = pieces if first is None else first
        for piece in pieces:
            if piece.result is not None:
                results[piece.index] = piece.result
    assert first and [p.index for p in first][:2] == [a, a] and first[1].result is not None  # its text, then its end
    assert same(results[a], alone(model, "The capital of France is", max_tokens=1))
    assert same(results[b], alone(model, "Once upon a time", max_tokens=4, temperature=0.8, seed=2))


def test_stream_generate_n_streams_what_generate_n_returns(default_model):
    model = default_model
    settings = dict(max_tokens=10, temperature=0.9, seed=21)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    results = {}
    for piece in kvcandle.stream_generate(model, "Once upon a time, a llama", n=3, **settings):
        texts[piece.index] = texts.get(piece.index, "") + piece.text
        if piece.finish_reason is not None:
            reasons[piece.index] = piece.finish_reason
            results[piece.index] = piece.result
    many = kvcandle.generate(model, "Once upon a time, a llama", n=3, **settings)
    assert sorted(texts) == [0, 1, 2]
    for i, r in enumerate(many):
        assert texts[i] == r.text and reasons[i] == r.finish_reason and results[i].tokens == r.tokens
    with pytest.raises(kvcandle.InputError, match="n"):
        next(kvcandle.stream_generate(model, "a", n=0))


def test_finished_caches_go_into_the_prompt_cache(default_model):
    model = default_model
    pc = kvcandle.PromptCache(model, max_bytes=1 << 30)
    batch = kvcandle.BatchGenerator(model)
    prompt = model.tokenizer.encode("The capital of France is")
    batch.add(prompt, max_tokens=3, prompt_cache=pc)
    while batch:
        batch.step()
    assert len(pc) == 1
    # a second sequence with the same prompt starts from it: only the last position runs
    batch.add(prompt, max_tokens=3, prompt_cache=pc)
    while batch:
        for p in batch.step():
            if p.result is not None:
                assert p.result.stats.reused_tokens == len(prompt) - 1
                assert np.isfinite(p.result.stats.prefill_tps)


def test_add_n_runs_the_prompt_once_and_equals_generate_n(default_model):
    model = default_model
    prompt = "Write a word about the sea:"
    settings = dict(max_tokens=8, temperature=0.9, top_p=0.95, seed=11)
    batch = kvcandle.BatchGenerator(model)
    ids = batch.add(prompt, n=3, **settings)
    assert ids == [0, 1, 2]
    ran = []
    original = model.forward_batch

    def counting(inputs, caches, **kw):
        ran.append([len(x) for x in inputs])
        return original(inputs, caches, **kw)

    model.forward_batch = counting  # type: ignore[method-assign]
    try:
        results = {}
        while batch:
            for piece in batch.step():
                if piece.result is not None:
                    results[piece.index] = piece.result
    finally:
        del model.forward_batch
    prompt_len = len(model.tokenizer.encode(prompt))
    assert sum(sum(step) for step in ran[:1]) == prompt_len  # the first step: the prompt once
    assert all(len(step) == 3 and max(step) == 1 for step in ran[1:])
    expected = kvcandle.generate(model, prompt, n=3, **settings)
    assert [(results[i].text, results[i].tokens) for i in ids] == [(e.text, e.tokens) for e in expected]
    assert len({r.text for r in expected}) > 1  # the seeds differ


def test_removing_a_sequence_of_add_n_leaves_the_others_running(default_model):
    model = default_model
    prompt = "The history of the printing press " * 20  # prefills over several steps
    batch = kvcandle.BatchGenerator(model)
    first, second, third = batch.add(prompt, n=3, max_tokens=5, temperature=0.8, seed=4)
    batch.step()  # part of the prompt ran
    taken = batch.remove(first)  # the first carried the prompt: the second takes it over
    assert taken.finish_reason == "removed" and taken.tokens == []
    held = len(taken.cache)
    assert 0 < held < len(model.tokenizer.encode(prompt))
    assert taken.cache.tokens == model.tokenizer.encode(prompt)[:held]
    waiting = batch.remove(third)  # still waiting: its cache is the prompt so far
    assert waiting.cache.tokens == taken.cache.tokens
    results = {}
    while batch:
        for piece in batch.step():
            if piece.result is not None:
                results[piece.index] = piece.result
    alone = kvcandle.generate(model, prompt, max_tokens=5, temperature=0.8, seed=4 + 1)
    assert (results[second].text, results[second].tokens) == (alone.text, alone.tokens)
    assert taken.cache.tokens == model.tokenizer.encode(prompt)[:held]  # not disturbed by the heir


def test_logprobs_are_the_models_log_softmax(default_model):
    model = default_model
    prompt = "The capital of France is"
    batch = kvcandle.BatchGenerator(model)
    index = batch.add(prompt, max_tokens=6, temperature=0.7, seed=2, logprobs=3)
    tokens, entries = [], []
    while batch:
        for piece in batch.step():
            assert piece.index == index and len(piece.logprobs) == len(piece.tokens)
            tokens += piece.tokens
            entries += piece.logprobs
    ids = model.tokenizer.encode(prompt)
    logits = model.forward(ids + tokens, all_logits=True).astype(np.float64)[len(ids) - 1 : -1]
    logp = logits - logits.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    for row, token, entry in zip(logp, tokens, entries):
        assert entry.token == token
        assert abs(entry.logprob - row[token]) < 1e-4
        assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:3])
        assert all(abs(lp - row[t]) < 1e-4 for t, lp in entry.top)
    with pytest.raises(kvcandle.InputError, match="logprobs"):
        batch.add(prompt, logprobs=-1)
    with pytest.raises(kvcandle.InputError, match="n must be"):
        batch.add(prompt, n=0)
    assert not batch


def test_a_whole_prompt_from_a_cache_gives_the_first_runs_logits(default_model):
    # the last prompt token always runs as a decode row (kvcandle.prompt_chunk), so a
    # prompt-cache hit of a whole prompt repeats the first run bit for bit
    model = default_model
    for words in (12, 90):  # one chunk of more than SMALL_CHUNK tokens; more than PREFILL_CHUNK
        ids = model.tokenizer.encode("a tale of two cities " * words)
        assert len(ids) > kvcandle.SMALL_CHUNK
        cache = model.new_cache()
        first = model.sync(ids, cache).logits
        model.forward([5, 6], cache)  # the cache holds more than the prompt, as a prompt cache's entry does
        again = model.sync(ids, cache).logits
        assert np.array_equal(first, again)
    assert [kvcandle.prompt_chunk(n) for n in (1, 32, 33, 256, 257, 600)] == [1, 32, 32, 255, 256, 256]
