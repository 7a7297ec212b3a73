"""Parity with transformers on the default model: every experiment of the reference
document (../shared/seeds/000_e6cd328552d60d03.txt), judged against transformers'
LlamaForCausalLM in float64 on the same weights, never one float32 result against
another. The functions and the bounds (TOLERANCE, KV_TOLERANCE, CLEAR_GAP) live in
kvcandle.parity, which also prints them as tables (`python -m kvcandle.parity`)."""

from __future__ import annotations

import pytest

import kvcandle
from kvcandle import parity

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref():
    return parity.Reference()


@pytest.fixture(scope="module", params=parity.SEQUENCE_PROMPTS)
def seq(request, default_model, ref):
    s = ref.sequence(default_model, request.param)
    assert len(s.ids) == 24
    return s


def test_reference_computes_in_float64(ref, seq):
    assert ref.f64.dtype == "float64" and ref.f32.dtype == "float32"
    # with and without its cache, float64 agrees with itself to float64 rounding; float32
    # arithmetic anywhere inside would show as ~1e-5
    assert ref.self_check(seq) <= 1e-9


def test_reference_sequence(default_model, ref):
    s = ref.sequence(default_model, parity.PROMPT)
    assert s.ids[:6] == [504, 3575, 282, 4649, 314, 7042]  # " Paris"
    assert default_model.tokenizer.decode(s.ids[5:]) == " Paris.\n\nThe answer is: 2018-01-22"


def test_1_cache_object(default_model, ref):
    r = parity.cache_object(default_model, ref)
    print(r)
    assert r["kvcandle"] == r["transformers"] == {"len": 24, "layers": 30, "keys": (1, 3, 24, 64), "dtype": "float32"}
    assert r["greedy"]["ok"], r["greedy"]
    assert r["kvcandle_key_err"] <= parity.KV_TOLERANCE and r["kvcandle_value_err"] <= parity.KV_TOLERANCE


def test_2_3_every_float32_path_within_the_bound(default_model, ref, seq):
    """Teacher forcing and chunked prefill: kvcandle with its cache, without it, fed in
    uneven chunks, candle's own Llama, and transformers float32, each against float64."""
    acc = parity.accuracy(default_model, ref, seq)
    print(parity.TABLE_HEADER)
    for r in acc.rows:
        print(r.line())
    paths = {r.path for r in acc.rows}
    assert len(paths) == len(acc.rows) == 13
    for r in acc.rows:
        assert r.max_err <= parity.TOLERANCE, r
        assert r.top1 == r.clear and r.clear >= r.positions - 2, r
    # kvcandle's decode attention is its own kernel, so it is not candle's arithmetic:
    # both engines are held to the float64 reference above, never to each other's noise
    print("kvcandle vs candle upstream:", acc.kvcandle_vs_upstream)


def test_one_pass_prefill_of_other_prompts_within_the_bound(default_model, ref):
    """Prompts longer than SMALL_CHUNK (the matrix-product prefill): every logit within the
    bound of float64 and the clear argmaxes equal; transformers float32 beside it is printed
    (one noise is never asserted against another)."""
    for name, theirs, ours in parity.prefill_accuracy(default_model, ref):
        print(f"{name}: {ours.positions} tokens, transformers float32 {theirs.max_err:.2e}, kvcandle {ours.max_err:.2e}")
        assert ours.positions > kvcandle.SMALL_CHUNK, name
        assert ours.max_err <= parity.TOLERANCE, (name, ours)
        assert ours.top1 == ours.clear, (name, ours)


def test_4_greedy_generation(default_model, ref):
    results = parity.greedy_generation(default_model, ref)
    assert len(results) == len(parity.GREEDY_PROMPTS)
    for g in results:
        print(repr(g["prompt"]), "->", repr(g["text"]), g["kvcandle"], "min gap", g["min_gap"])
        assert g["kvcandle"]["ok"], g
    # the prompts with no near tie in their 20 steps are followed all the way
    assert sum(g["kvcandle"]["same_steps"] == 20 for g in results) >= 3


def test_5_fork_branches(default_model):
    branches = parity.fork_branches(default_model)
    assert [b["branch"] for b in branches] == ["France", "Germany"]
    for b in branches:
        print(b)
        assert b["equal"] and b["cache_tokens_ok"] and b["base_unchanged"]
        assert b["max_diff"] == 0.0  # the same arithmetic on the same inputs
    assert branches[0]["text"].startswith(" Paris") and branches[1]["text"].startswith(" Berlin")


def test_6_misuse(default_model, ref):
    m = parity.misuse(default_model, ref)
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


def test_7_tokenizer(default_model, ref):
    results = parity.tokenizer_parity(default_model, ref)
    for t in results:
        assert t["encode_equal"], (t["text"], t["ours"], t["theirs"])
        assert t["decode_equal"], t["text"]
    # the special tokens stay whole
    chat = next(t for t in results if t["text"].startswith("<|im_start|>system"))
    assert chat["ours"][0] == 1 and chat["ours"].count(2) == 2


def test_chat_template_equals_transformers(default_model, ref):
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
            theirs = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
            assert default_model.tokenizer.encode(ours) == ref.tokenizer.encode(theirs)


@pytest.mark.parametrize("dtype", sorted(parity.CACHE_TOLERANCE))
def test_stored_caches_within_their_bound(default_model, seq, dtype):
    """A float16 cache rounds keys and values to 11 significant bits, an 8-bit one
    (``q8_0``) to 255 steps per block of 32: their logits are held to their own bound
    against float64 (parity.CACHE_TOLERANCE, with the reason and the measured figures
    beside it), and the greedy token agrees wherever the reference is clear of it."""
    rows = parity.stored_cache(default_model, seq, dtype)
    print(parity.TABLE_HEADER)
    for r in rows:
        print(r.line())
    assert len(rows) == 3
    for r in rows:
        assert r.max_err <= parity.CACHE_TOLERANCE[dtype], r
        # float16's bound leaves almost every position clear; q8_0's about half of them
        assert r.top1 == r.clear and r.clear >= (r.positions - 4 if dtype == "float16" else r.positions // 3), r
