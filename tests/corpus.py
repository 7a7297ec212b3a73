"""Texts for tokenizer tests: a seeded generator of strings that find where tokenizers
differ (a helper module, not a test; the llama.cpp fixture script in bench/ uses it too).

Each text joins a few random parts: words in Latin scripts with precomposed and combining
diacritics, Vietnamese, CJK, Arabic, Cyrillic, emoji with skin-tone modifiers, joiners and
flags, digits and numbers, contractions, code, runs of whitespace (spaces, tabs, newlines,
carriage returns, no-break and ideographic spaces), special tokens as chat templates
write them, and characters from random code points; whitespace runs are put at the
start, in the middle and at the end.
"""

from __future__ import annotations

import random

WORDS = [
    "the", "The", "hello", "Hello", "world", "World", "capital", "France", "Paris", "tokenizer", "llama", "LLaMA",
    "café", "naïve", "über", "Ärger", "façade", "mañana", "coöperate", "résumé", "Ångström", "œuvre", "Straße",
    "cafe\u0301", "nai\u0308ve", "A\u030angstro\u0308m", "n\u0303",  # combining marks
    "Cửa", "Việt", "Tiếng", "người", "Nguyễn", "Hà Nội", "phở", "điện",
    "你好", "世界", "中文", "東京", "こんにちは", "カタカナ", "한국어", "안녕하세요",
    "مرحبا", "العربية", "السلام", "Привет", "мир", "Ελληνικά", "עברית", "हिन्दी", "ไทย",
    "😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🇫🇷", "🦙", "❤\ufe0f", "1\ufe0f\u20e3",
    "it's", "IT'S", "they'll", "we've", "I'm", "you'd", "don't", "she's",
    "12345", "3.14159", "1,000,000", "2024-01-22", "0x1F", "42", "7", "½", "²", "٣٤", "१२३",
]
CODE = [
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}", '{"key": [1, 2, 3], "ok": true}',
    "SELECT * FROM t WHERE id = 7;", "x += 1  # comment", "if a != b && c <= d:", "<div class=\"x\">&amp;</div>",
    "fn main() { println!(\"{}\", 1); }", "$ ls -la | grep .py", "a_b__c___d", "...!!!???", "---", "~~~~", "@#%^&*()[]{}",
]
SPECIAL = [
    "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<<SYS>>\n", "\n<</SYS>>\n\n", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\n", "<|user|>", "<|end|>",
]
SPACES = [" ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t", "\u00a0", "\u3000", " \t", "\n\n\n", "        "]
# ranges random characters are drawn from: Latin-1 and Latin Extended, combining marks,
# Greek, Cyrillic, Arabic, Devanagari, Thai, CJK, Hangul, symbols, emoji, a private use
# area, and beyond the Basic Multilingual Plane
RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F),
          (0xE00, 0xE7F), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x2000, 0x2BFF), (0x1F300, 0x1FAFF), (0xE000, 0xE0FF),
          (0x20000, 0x2A6DF)]


def _random_chars(rng: random.Random) -> str:
    lo, hi = rng.choice(RANGES)
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))


def _part(rng: random.Random, special: bool, rare: bool) -> str:
    kind = rng.random() if rare else 0.85 * rng.random()
    if kind < 0.55:
        return rng.choice(WORDS)
    if kind < 0.65:
        return rng.choice(CODE)
    if kind < 0.75 and special:
        return rng.choice(SPECIAL)
    if kind < 0.85:
        return rng.choice(SPACES)
    return _random_chars(rng)


def text(rng: random.Random, special: bool = True, rare: bool = True) -> str:
    """One text: parts joined by single spaces or by whitespace runs, with whitespace
    runs at the start or the end some of the time; ``rare``: with characters from
    random code points."""
    parts = [_part(rng, special, rare) for _ in range(rng.randint(1, 8))]
    out = parts[0]
    for p in parts[1:]:
        out += (" " if rng.random() < 0.7 else rng.choice(SPACES + [""])) + p
    if rng.random() < 0.25:
        out = rng.choice(SPACES) + out
    if rng.random() < 0.25:
        out += rng.choice(SPACES)
    return out


def texts(n: int, seed: int, special: bool = True) -> list[str]:
    """``n`` texts from ``seed``; the first few are the edge cases every run covers."""
    rng = random.Random(seed)
    fixed = ["", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "Hello world", " Hello world", "  Hello", "Hello  ",
             " this is 🦙.cpp", "Cửa Việt", " Cửa Việt", "   leading and trailing   ", "\ttab\tand\nnewline\n"]
    if special:
        fixed += ["<s>[INST] hi [/INST]", "<s> <s>x</s>", "</s>", "<unk>", "<|im_start|>user\nhi<|im_end|>\n"]
    return (fixed + [text(rng, special) for _ in range(n)])[:max(n, len(fixed))]


def training_texts(n: int, seed: int) -> list[str]:
    """Texts to train a vocabulary on: as :func:`texts`, without random code points and
    special tokens (so that most characters become pieces, and the rest need bytes)."""
    rng = random.Random(seed)
    return [text(rng, special=False, rare=False) for _ in range(n)]
