"""Parity with transformers on the default model: every experiment of the reference
document (../shared/seeds/000_e6cd328552d60d03.txt), run against transformers'
LlamaForCausalLM loaded from the same GGUF file in this process. The functions live in
kvcandle.parity, which also prints them as a table (`python -m kvcandle.parity`)."""

from __future__ import annotations

import pytest

from kvcandle import parity


@pytest.fixture(scope="module")
def tf():
    return parity.Transformers()


@pytest.fixture(scope="module")
def seq(default_model, tf):
    s = parity.reference_sequence(default_model, tf)
    assert len(s) == 24 and s[:6] == [504, 3575, 282, 4649, 314, 7042]
    return s


def test_1_cache_object(default_model, tf):
    r = parity.cache_object(default_model, tf)
    print(r)
    assert r["kvcandle"] == r["transformers"] == {"len": 24, "layers": 30, "keys": (1, 3, 24, 64), "dtype": "float32"}
    assert r["same_tokens"]
    assert r["max_key_diff"] <= 1e-4 and r["max_value_diff"] <= 1e-4


def test_2_teacher_forcing(default_model, tf, seq):
    rows = {r.experiment: r for r in parity.teacher_forcing(default_model, tf, seq)}
    for r in rows.values():
        print(r.line())
    own = rows["transformers cache vs transformers no cache"].max_all
    bar = 1.5 * own
    for name in (
        "kvcandle cache vs transformers no cache",
        "kvcandle no cache (one pass) vs transformers no cache",
        "kvcandle no cache (fresh prefix each step) vs transformers no cache",
    ):
        assert rows[name].max_all <= bar, (name, rows[name].max_all, bar)
    for r in rows.values():
        assert r.steps == 20 and r.top1 == 20, r
    assert rows["candle upstream cache vs transformers no cache"].max_all <= 2e-4
    assert rows["kvcandle cache vs candle upstream cache"].max_all <= 1e-5


def test_3_chunked_prefill(default_model, tf, seq):
    rows = parity.chunked_prefill(default_model, tf, seq)
    for r in rows:
        print(r.line())
        assert r.top1 == r.steps
    assert rows[0].max_all <= 5e-5 and rows[1].max_all <= 5e-5  # 3+2 vs 5, in kvcandle and transformers
    for r in rows[2:]:  # uneven chunkings, against transformers fed the same chunks
        assert r.max_all <= 1.5e-4, r


def test_4_greedy_generation(default_model, tf):
    results = parity.greedy_generation(default_model, tf)
    assert len(results) >= 4
    for g in results:
        print(repr(g["prompt"]), "->", repr(g["text"]))
        assert g["kvcandle"] == g["transformers"], g["prompt"]


def test_5_fork_branches(default_model):
    branches = parity.fork_branches(default_model)
    assert [b["branch"] for b in branches] == ["France", "Germany"]
    for b in branches:
        print(b)
        assert b["equal"] and b["cache_tokens_ok"]
        assert b["max_diff"] <= 1e-5
    assert branches[0]["text"] != branches[1]["text"]
    assert branches[0]["text"].startswith(" Paris") and branches[1]["text"].startswith(" Berlin")


def test_6_misuse(default_model, tf):
    m = parity.misuse(default_model, tf)
    print(m)
    # candle: index_pos 0 at every step changes the text, no error (kvcandle takes no position)
    assert m["index_pos_0"]["differs"]
    reuse = m["reuse"]
    # transformers silently appends the new prompt after the old conversation
    assert reuse["transformers_len"] == 48 and not reuse["transformers_reuse_equals_fresh"]
    # candle: a multi-token prompt fails to broadcast, a one-token prompt silently mixes
    assert "cannot broadcast [5, 5] to [1, 9, 5, 29]" in reuse["upstream_multi_token"]
    assert "\n" not in reuse["upstream_multi_token"]  # candle's message, no backtrace
    assert reuse["upstream_one_token_max_diff_vs_fresh"] > 1.0
    # kvcandle: prefill refuses a cache that is not a prefix, unchanged; after an explicit crop it equals a fresh run
    assert "first difference at position 3" in reuse["kvcandle_prefill"]
    assert reuse["kvcandle_cache_unchanged"] and reuse["kvcandle_after_crop_equals_fresh"]
    far = m["position_8192"]
    assert "narrow invalid args" in far["upstream"]
    assert far["transformers_finite"] and far["transformers_shape"] == (1, 1, 49152)
    assert "context length is 8192" in far["kvcandle"] and far["kvcandle_len_after"] == 5


def test_7_tokenizer(default_model, tf):
    results = parity.tokenizer_parity(default_model, tf)
    for t in results:
        assert t["encode_equal"], (t["text"], t["ours"], t["theirs"])
        assert t["decode_equal"], t["text"]
    # the special tokens stay whole
    chat = next(t for t in results if t["text"].startswith("<|im_start|>system"))
    assert chat["ours"][0] == 1 and chat["ours"].count(2) == 2


def test_chat_template_equals_transformers(default_model, tf):
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Germany? 🇩🇪"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = tf.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
            assert default_model.tokenizer.encode(ours) == tf.tokenizer.encode(theirs)
