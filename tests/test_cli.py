"""The kvcandle command: generate, chat (piped), info, and its errors."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import kvcandle
from kvcandle import cli


@pytest.fixture(autouse=True)
def loaded_once(monkeypatch, request):
    """The command loads the default model through kvcandle.load; here the session's
    models stand in for it, so each is loaded once (loading and its progress reports are
    tested in test_loading.py; test_console_script_* runs the real command)."""
    real = cli.load

    def load(path=None, *, quantized=False, progress=None):
        if path is None:
            return request.getfixturevalue("default_quantized" if quantized else "default_model")
        return real(path, quantized=quantized, progress=progress)

    monkeypatch.setattr(cli, "load", load)


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def run(argv, stdin: str = ""):
    out, err = Pipe(), Pipe()
    code = cli.main(argv, stdin=Pipe(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_generate_equals_the_api(default_model):
    code, out, err = run(["generate", "The capital of France is", "--max-tokens", "20"])
    assert code == 0
    assert out == kvcandle.generate(default_model, "The capital of France is", max_tokens=20).text + "\n"
    assert "[prompt 5 tok (5 run) | generated 20 tok |" in err
    assert "cache 24/8192 pos" in err and "keys (1, 3, 24, 64)" in err and "finish=length" in err


def test_console_script_entry_point_runs_as_module():
    r = subprocess.run(
        [sys.executable, "-m", "kvcandle", "generate", "The capital of France is", "--max-tokens", "5"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris")


def test_generate_stop_and_seed(default_model):
    code, out, _ = run(["generate", "The capital of France is", "--max-tokens", "20", "--stop", "answer"])
    assert code == 0 and out == " Paris.\n\nThe \n"
    a = run(["generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0.8", "--seed", "3"])[1]
    b = run(["generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0.8", "--seed", "3"])[1]
    assert a == b


def test_chat_undo_gives_the_same_answer_twice():
    q = "What is the capital of France?"
    code, out, err = run(["chat", "--max-tokens", "40"], stdin=f"{q}\n/undo\n{q}\n/stats\n")
    assert code == 0, err
    first, rest = out.split("(undone: cache back to 0 positions)\n")
    second, stats = rest.split("(cache ")
    assert first == second and "Paris" in first
    assert "turns start at: 0)" in stats


def test_chat_second_turn_runs_only_new_tokens(default_model, monkeypatch):
    import kvcandle.generation as g

    seen = []
    real = g._steps  # where every generation's tokens come from

    def spy(model, prompt_ids, cache, *args):
        seen.append((len(prompt_ids), len(cache)))
        return real(model, prompt_ids, cache, *args)

    monkeypatch.setattr(g, "_steps", spy)
    code, out, err = run(["chat", "--max-tokens", "30"], stdin="Hi!\nWhat is 2+2?\n")
    assert code == 0, err
    (p1, c1), (p2, c2) = seen
    assert c1 == 0 and c2 > p1  # the second turn started from the first turn's cache
    assert p2 - c2 < 20  # only the new turn's few tokens were left to run


def test_info(default_model):
    code, out, _ = run(["info"])
    assert code == 0
    assert "key/value heads" in out and " 3\n" in out
    assert f"{default_model.new_cache().bytes_per_token:,}" in out
    assert "context length               8192" in out


def test_missing_model_is_a_one_line_error(tmp_path):
    for argv in (["generate", "hi"], ["chat"], ["info"]):
        code, out, err = run([*argv, "--model", str(tmp_path / "nope.gguf")])
        assert code == 1 and err.startswith("kvcandle: error: model not found:") and err.count("\n") == 1


def test_an_option_without_the_one_it_works_with_is_refused(tmp_path):
    """``--num-draft 3`` without ``--draft`` decoded without guesses, and
    ``--prompt-cache-bytes`` without ``--prompt-cache`` kept nothing: options that would be
    ignored are one-line errors naming both, before the model loads."""
    for argv, words in [
        (["generate", "hi", "--num-draft", "3"], "--num-draft works with --draft"),
        (["chat", "--num-draft", "3"], "--num-draft works with --draft"),
        (["generate", "hi", "--prompt-cache-bytes", "1000"], "--prompt-cache-bytes works with --prompt-cache"),
        (["generate", "hi", "--prompt-cache", str(tmp_path), "--prompt-cache-bytes", "-5"], "--prompt-cache-bytes must be at least 0, got -5"),
    ]:
        code, out, err = run([*argv, "--model", str(tmp_path / "nope.gguf")])  # refused before the load
        assert (code, out) == (1, "") and err == f"kvcandle: error: {words}" + (", which is not given" if "works" in words else "") + "\n", argv
    assert not list(tmp_path.iterdir())


def test_chat_needs_a_template(tiny_dirs):
    code, _, err = run(["chat", "--model", str(tiny_dirs["gqa"])], stdin="hi\n")
    assert code == 1 and "chat template" in err


class InterruptingPipe(Pipe):
    """An output that raises KeyboardInterrupt (as Ctrl-C would) at its n-th write."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def write(self, s: str) -> int:
        self.after -= 1
        if self.after == 0:
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_in_generate_prints_stats_and_exits_130():
    out, err = InterruptingPipe(4), Pipe()
    code = cli.main(["generate", "The capital of France is", "--max-tokens", "50"], stdin=Pipe(), stdout=out, stderr=err)
    assert code == 130 and "finish=interrupted" in err.getvalue()


def test_ctrl_c_in_chat_keeps_the_cache_consistent(default_model):
    q = "What is the capital of France?"
    out, err = InterruptingPipe(3), Pipe()
    code = cli.main(["chat", "--max-tokens", "40"], stdin=Pipe(f"{q}\n/undo\n{q}\n"), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    text = out.getvalue()
    assert "(interrupted)" in text and "(undone: cache back to 0 positions)" in text
    # after the interrupted reply was undone, the same question gets the full, uninterrupted answer
    answer = text.split("(undone: cache back to 0 positions)\n")[1]
    _, clean, _ = run(["chat", "--max-tokens", "40"], stdin=f"{q}\n")
    assert answer == clean


def test_generate_quantized():
    code, out, err = run(["generate", "The capital of France is", "--max-tokens", "5", "--quantized"])
    assert code == 0 and out.startswith(" Paris"), err
    code, out, _ = run(["info", "--quantized"])
    assert code == 0 and "linear layers quantized" in out


def test_chat_greets_helps_and_quits():
    code, out, err = run(["chat"], stdin="/help\n/quit\nthis line is never read\n")
    assert code == 0
    assert "SmolLM2" in err and "float32" in err and "cpu" in err and "/help" in err
    assert "/save NAME" in out and "/quit" in out and "/undo" in out
    assert "never" not in out
    _, out, _ = run(["chat"], stdin="/frobnicate\n")
    assert "unknown command '/frobnicate'" in out and "/help" in out


def test_chat_goes_on_after_a_turn_it_refuses():
    """A turn that does not fit the context, or text no tokenizer takes, is refused with
    a line saying why; the conversation and the session go on."""
    code, out, _ = run(["chat", "--max-tokens", "3"], stdin="word " * 9000 + "\nA lone \udc80 surrogate\nHi!\n/stats\n")
    assert code == 0
    assert "(not sent: " in out and "context length" in out and "/undo or /reset make room" in out
    assert "unpaired surrogate" in out
    assert "turns start at: 0)" in out  # the one turn that ran is the conversation


def test_chat_stats_in_human_units():
    code, out, _ = run(["chat", "--max-tokens", "5"], stdin="Hi!\n/stats\n")
    assert code == 0
    stats = out.split("(cache ")[1]
    assert " KiB," in stats or " MiB," in stats
    assert cli.human_bytes(512) == "512 B" and cli.human_bytes(3 * 2**20) == "3.0 MiB"


def test_chat_save_and_load(tmp_path):
    path = tmp_path / "chat.kvcache"
    q = "What is the capital of France?"
    code, out, _ = run(["chat", "--max-tokens", "30"], stdin=f"{q}\n/save {path}\n")
    assert code == 0 and "(saved 1 turns" in out and path.exists()
    code, resumed, _ = run(["chat", "--max-tokens", "30"], stdin=f"/load {path}\nAnd of Italy?\n")
    assert code == 0 and "(loaded 1 turns" in resumed
    _, straight, _ = run(["chat", "--max-tokens", "30"], stdin=f"{q}\nAnd of Italy?\n")
    assert resumed.split("\n", 1)[1] == straight.split("\n", 1)[1]
    _, out, _ = run(["chat"], stdin=f"/load {tmp_path / 'missing'}\n/save\n")
    assert "(not loaded: cache file" in out and "/save needs a file name" in out


def test_generate_prompt_cache_reuses_across_runs(tmp_path):
    doc = "Notes: the meeting is on Tuesday at noon in room 4. " * 5
    first = run(["generate", doc + "When?", "--max-tokens", "4", "--prompt-cache", str(tmp_path)])
    second = run(["generate", doc + "Where?", "--max-tokens", "4", "--prompt-cache", str(tmp_path)])
    assert first[0] == second[0] == 0
    assert "reused" not in first[2]
    reused = int(second[2].split(" reused")[0].rsplit(", ", 1)[1])
    assert reused > 50
    assert list(tmp_path.glob("*.kvcache.safetensors"))
