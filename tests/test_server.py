"""``kvcandle serve``: the real server, started on a free loopback port (127.0.0.1 only)
as ``python -m kvcandle serve --port 0``, driven by the official ``openai`` client and by
plain HTTP, and stopped by the tests themselves. Every wait is bounded in time and every
request loop in count."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

import kvcandle
from kvcandle.server.process import ServerProcess, spawn

HOST = "127.0.0.1"
START_SECONDS = 180
REQUEST_SECONDS = 120


class Server:
    def __init__(self, process: ServerProcess) -> None:
        self.process, self.port, self.url = process, process.port, process.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)

    def http(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=REQUEST_SECONDS)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text
        finally:
            conn.close()

    def health(self) -> dict[str, Any]:
        status, body = self.http("GET", "/health")
        assert status == 200
        return body

    def wait_idle(self, seconds: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            h = self.health()
            if h["requests_running"] == 0 and h["requests_queued"] == 0:
                return h
            time.sleep(0.05)
        raise AssertionError(f"the server did not go idle in {seconds}s: {h}")


@contextlib.contextmanager
def running_server(*options: str) -> Iterator[Server]:
    """The real server (``python -m kvcandle serve``) on a free port of 127.0.0.1,
    stopped (SIGTERM) when the block ends."""
    with spawn(*options, host=HOST, start_seconds=START_SECONDS) as process:
        yield Server(process)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--max-batch", "8", "--max-queue", "16") as s:
        yield s


CHAT = [{"role": "user", "content": "Name three colours."}]


def chat_stream(server: Server, **kw: Any) -> tuple[str, Any, Any]:
    """The streamed text, the finish reason and the usage chunk's usage."""
    text, finish, usage = "", None, None
    for n, chunk in enumerate(server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)):
        assert n < 10_000
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


def test_models_health_and_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    h = server.health()
    assert h["status"] == "ok" and h["max_batch"] == 8
    status, text = server.http("GET", "/metrics")
    assert status == 200 and "kvcandle_requests_total" in text and "kvcandle_tokens_per_second" in text


def test_chat_streamed_equals_not_streamed(server):
    settings = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=24, temperature=0.8, seed=7)
    whole = server.client.chat.completions.create(**settings)
    text, finish, usage = chat_stream(server, **settings)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and text
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_equal_the_library(server, default_model):
    prompt = "Once upon a time, in a quiet village,"
    got = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0.9, seed=21, n=3)
    want = kvcandle.generate(default_model, prompt, max_tokens=12, temperature=0.9, seed=21, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage.prompt_tokens == len(default_model.tokenizer.encode(prompt))
    assert got.usage.completion_tokens == sum(len(w.tokens) for w in want)


def test_a_repetition_penalty_far_from_one_is_served_and_so_is_the_next_request(server, default_model):
    """A penalty far from 1 once made the sampling probabilities NaN, whose ValueError
    killed the worker thread: every later request then waited forever."""
    client = server.client.with_options(timeout=120, max_retries=0)
    prompt = "1, 2, 3,"
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0.7, seed=3, extra_body={"repetition_penalty": 1e-40})
    want = kvcandle.generate(default_model, prompt, max_tokens=6, temperature=0.7, seed=3, repetition_penalty=1e-40)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.tokens) == 6
    after = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in after.choices[0].text


def test_stop_strings_are_never_sent(server):
    got = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=20, temperature=0, stop=["."])
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and "." not in choice.text and "Paris" in choice.text
    streamed = "".join(
        c.choices[0].text for c in server.client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=20, temperature=0, stop=["."], stream=True)
        if c.choices
    )
    assert streamed == choice.text


def test_logprobs(server):
    chat = server.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == chat.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: the most likely
    comp = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # characters split across tokens: each offset where the text stood before the token,
    # the same streamed or not
    settings = dict(model="SmolLM2-135M-Instruct", prompt="日本の首都は東京です。中国の首都は", max_tokens=12, temperature=0, logprobs=2)
    whole = server.client.completions.create(**settings)
    text, offsets = whole.choices[0].text, whole.choices[0].logprobs.text_offset
    streamed_text, streamed = "", []
    for c in server.client.completions.create(**settings, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed_text += c.choices[0].text
            streamed += c.choices[0].logprobs.text_offset
    assert streamed_text == text and streamed == offsets
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    assert any(ord(ch) > 0x3000 for ch in text)  # the case this checks: CJK text, split bytes


def test_a_second_turn_runs_only_the_new_tokens(server):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me about the moon in one long sentence " + "please " * 40}]
    first = server.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And the sun?"}]
    second = server.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the first turn's prompt and reply are reused; only the new message (and the reply's
    # end-of-turn, which never went into the cache) runs
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert second.usage.prompt_tokens - cached <= 16


def test_a_diverging_prompt_reuses_exactly_the_common_prefix(server, default_model):
    ids = default_model.tokenizer.encode("A long document about rivers and their deltas. " * 8)
    first = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    t = 37
    other = ids[:t] + [ids[t] + 1] + ids[t + 1 :]
    again = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt=other, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == t


def requests_alone_and_together(server: Server) -> tuple[list[Any], list[Any]]:
    jobs = [
        dict(messages=[{"role": "user", "content": "Write a haiku about rain."}], max_tokens=20, temperature=0.7, seed=1),
        dict(messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=12, temperature=0),
        dict(messages=[{"role": "user", "content": "List some fruits."}], max_tokens=24, temperature=1.0, top_p=0.9, seed=5),
        dict(messages=[{"role": "user", "content": "Say hello in French."}], max_tokens=16, temperature=0.5, seed=9),
    ]

    def run(job: dict[str, Any], stream: bool) -> str:
        if stream:
            return chat_stream(server, model="SmolLM2-135M-Instruct", **job)[0]
        return server.client.chat.completions.create(model="SmolLM2-135M-Instruct", **job).choices[0].message.content

    alone = [run(j, False) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda ij: run(ij[1], ij[0] % 2 == 0), enumerate(jobs)))
    return alone, together


def test_the_same_seed_gives_the_same_text_alone_and_among_others(server):
    alone, together = requests_alone_and_together(server)
    assert together == alone
    assert all(alone)


def test_a_client_that_leaves_mid_stream_stops_its_work(server):
    before = server.wait_idle()
    other = {}

    def bystander() -> None:
        other["text"] = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt="The three primary colours are", max_tokens=30, temperature=0).choices[0].text

    conn = http.client.HTTPConnection(HOST, server.port, timeout=REQUEST_SECONDS)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 2000, "temperature": 0, "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    thread = threading.Thread(target=bystander)
    thread.start()
    got = b""
    for _ in range(200):  # a few chunks, then go away
        got += resp.read1(4096)
        if got.count(b"data: ") >= 5:
            break
    conn.close()
    thread.join(timeout=REQUEST_SECONDS)
    after = server.wait_idle()
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 1000  # far from its 2000
    alone = server.client.completions.create(model="SmolLM2-135M-Instruct", prompt="The three primary colours are", max_tokens=30, temperature=0).choices[0].text
    assert other["text"] == alone


def test_a_client_that_leaves_mid_prefill_stops_its_work(server, default_model):
    ids = default_model.tokenizer.encode("Rivers carry water to the sea over many miles. " * 300)[:3000]
    before = server.wait_idle()
    conn = http.client.HTTPConnection(HOST, server.port, timeout=REQUEST_SECONDS)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": ids, "max_tokens": 5, "temperature": 0}), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while server.health()["requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    conn.close()
    after = server.wait_idle()
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    ran = after["prompt_tokens_run_total"] - before["prompt_tokens_run_total"]
    assert ran < len(ids) - kvcandle.PREFILL_CHUNK  # stopped at least a chunk before the end
    assert after["generated_tokens_total"] == before["generated_tokens_total"]


HOSTILE = [
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 7}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": True}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 10_000}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["x"] * 1000}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -4}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 1.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x\udcff"}, "prompt"),  # an unpaired surrogate (valid JSON): no UTF-8 form
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": True}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5, "max_tokens": "bad"}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", HOSTILE, ids=[f"{p.rsplit('/', 1)[1]}-{param}-{i}" for i, (p, _, param) in enumerate(HOSTILE)])
def test_bad_fields_get_400_naming_the_field(server, path, body, param):
    status, got = server.http("POST", path, body)
    assert status == 400, got
    assert got["error"]["param"] == param and got["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in got["error"]["message"]


def test_hostile_bodies_get_400_and_the_server_keeps_serving(server):
    for raw in [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"messages": NaN}', b"[" * 100_000 + b"]" * 100_000]:
        status, got = server.http("POST", "/v1/chat/completions", raw=raw)
        assert status == 400 and "error" in got, (raw[:20], got)
    status, got = server.http("POST", "/v1/chat/completions", raw=b'{"messages": "' + b"a" * (2 << 20) + b'"}')
    assert status == 400 and got["error"]["code"] == "body_too_large"
    status, got = server.http("GET", "/v1/nothing")
    assert status == 404 and "error" in got
    h = server.wait_idle()
    assert h["requests_failed_total"] == 0
    ok = server.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=3, temperature=0)
    assert ok.choices[0].message.content


def test_a_full_queue_answers_503():
    with running_server("--max-batch", "1", "--max-queue", "1") as s:
        body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "temperature": 0}
        conns = []
        for running, queued in [(1, 0), (1, 1)]:  # one runs, then one waits
            conn = http.client.HTTPConnection(HOST, s.port, timeout=REQUEST_SECONDS)
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            conns.append(conn)
            deadline = time.monotonic() + 60
            while (s.health()["requests_running"], s.health()["requests_queued"]) != (running, queued):
                assert time.monotonic() < deadline, s.health()
                time.sleep(0.02)
        status, got = s.http("POST", "/v1/completions", body)
        assert status == 503 and got["error"]["code"] == "queue_full" and "--max-queue" in got["error"]["message"]
        for conn in conns:
            conn.close()
        h = s.wait_idle()
        assert h["requests_rejected_total"] == 1 and h["requests_cancelled_total"] == 2


def test_requests_the_batch_has_room_for_are_not_queue_full():
    """--max-queue counts requests that wait for room in the batch, not those that join
    it at the worker's next step."""
    with running_server("--max-batch", "8", "--max-queue", "1") as s:
        body = {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            with ThreadPoolExecutor(6) as pool:
                statuses = list(pool.map(lambda _: s.http("POST", "/v1/completions", body)[0], range(6)))
            assert statuses == [200] * 6
        assert s.wait_idle()["requests_rejected_total"] == 0


def test_prompt_caches_are_found_again_after_a_restart(tmp_path: Path, default_model):
    ids = default_model.tokenizer.encode("The rules of chess, explained slowly. " * 10)
    folder = tmp_path / "prompts"
    with running_server("--prompt-cache-dir", str(folder)) as s:
        first = s.client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=3, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert list(folder.glob("*.kvcache.safetensors"))  # saved when it stopped
    with running_server("--prompt-cache-dir", str(folder)) as s:
        assert s.health()["prompt_cache_entries"] >= 1
        again = s.client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids + ids[:5], max_tokens=3, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == len(ids)
        same = s.client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=3, temperature=0)
        assert same.choices[0].text == first.choices[0].text


def test_serve_refuses_bad_options():
    for args, words in [(["--max-batch", "0"], "--max-batch"), (["--port", "70000"], "--port"), (["--prompt-cache-bytes", "-1"], "--prompt-cache-bytes")]:
        proc = subprocess.run([sys.executable, "-m", "kvcandle", "serve", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and words in proc.stderr, proc.stderr
