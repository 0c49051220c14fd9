"""The terminal beside the logs (asyncrl.obs.console): the progress bar's line and how it shares
stderr with log lines, and the sampled completions, against hand-written expectations."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest

import asyncrl.obs.console as console_mod

from asyncrl.obs.console import Console, Terminal, pick_completions, progress_line


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: ``\\r\\x1b[K`` erases the current line."""
    lines = [""]
    i = 0
    while i < len(raw):
        if raw.startswith("\r\x1b[K", i):
            lines[-1] = ""
            i += 4
        elif raw[i] == "\n":
            lines.append("")
            i += 1
        else:
            lines[-1] += raw[i]
            i += 1
    return lines


RECORD = {
    "step": 5, "reward": 0.4251, "accuracy": 0.375, "staleness_mean": 0.5, "staleness_max": 1,
    "response_len": 10.0, "groups": 4, "time": 50.0, "gen_s": 2.0,
}  # fmt: skip


def test_progress_line_by_hand() -> None:
    # 5 of 20 steps, 40 s for this life's 5 steps: 8 s a step, 15 left -> 120 s
    line = progress_line(RECORD, total_steps=20, first_step=0, elapsed_s=40.0,
                         tokens_per_s=1234.4)  # fmt: skip
    assert line == (
        "step 5/20 █████░░░░░░░░░░░░░░░ | reward 0.425 | acc 0.375 | stale 0.5/1 "
        "| 1,234 tok/s | ETA 2:00 | elapsed 0:40"
    )
    # a resumed run that started at step 3: its 2 steps took 40 s -> 20 s a step
    resumed = progress_line(RECORD, total_steps=20, first_step=3, elapsed_s=40.0,
                            tokens_per_s=None)  # fmt: skip
    assert "ETA 5:00" in resumed and "tok/s" not in resumed
    last = progress_line({**RECORD, "step": 20}, total_steps=20, first_step=0,
                         elapsed_s=3725.0, tokens_per_s=None)  # fmt: skip
    assert "ETA" not in last and "elapsed 1:02:05" in last and "░" not in last
    # an 80-column terminal: the last whole fields give way
    narrow = progress_line(RECORD, total_steps=20, first_step=0, elapsed_s=40.0,
                           tokens_per_s=1234.4, columns=80)  # fmt: skip
    assert narrow == "step 5/20 █████░░░░░░░░░░░░░░░ | reward 0.425 | acc 0.375 | stale 0.5/1"


def test_a_log_line_clears_the_bar_and_the_bar_comes_back_under_it() -> None:
    out = _Tty()
    term = Terminal(out)
    term.show("step 1/3")
    print("a log line", file=term, flush=True)  # what structlog's PrintLogger does
    assert _screen(out.getvalue()) == ["a log line", "step 1/3"]
    term.show("step 2/3")
    assert _screen(out.getvalue()) == ["a log line", "step 2/3"]
    term.close_bar()
    print("after the run", file=term)
    assert _screen(out.getvalue()) == ["a log line", "step 2/3", "after the run", ""]
    # without a bar a log line is written as it is: no escape codes in plain logs
    plain = io.StringIO()
    print("x", file=Terminal(plain))
    assert plain.getvalue() == "x\n"


def _group(prompt: str, tokens: list[int], reward: float, correct: bool) -> SimpleNamespace:
    sample = SimpleNamespace(token_ids=np.array(tokens), reward=reward, correct=correct)
    return SimpleNamespace(prompt_text=prompt, prompt_ids=[9, 9], samples=[sample, sample])


def _decode(ids: object) -> str:
    return "".join(chr(ord("a") + int(i)) for i in ids)  # type: ignore[attr-defined]


def test_pick_completions_takes_the_first_sample_of_the_first_groups() -> None:
    groups = [_group("1+1=", [0, 1], 1.0, True), _group("", [2], 0.0, False),
              _group("x", [3], 0.5, False)]  # fmt: skip
    assert pick_completions(groups, 2, _decode) == [
        {"prompt": "1+1=", "completion": "ab", "reward": 1.0, "correct": True},
        # a group restored from a checkpoint has no prompt text: its prompt ids are decoded
        {"prompt": "jj", "completion": "c", "reward": 0.0, "correct": False},
    ]
    assert pick_completions(groups, 1, _decode, limit=1)[0]["prompt"] == "1"


def _console(progress: str, out: io.StringIO, records: list[dict]) -> Console:
    return Console(total_steps=4, samples_per_prompt=2, progress=progress, completions_every=2,
                   completions_count=1, decode=_decode, write_record=records.append,
                   terminal=Terminal(out), blocks=True)  # fmt: skip


def test_console_shows_completions_every_n_steps_and_the_bar_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(console_mod, "_rendering", None)  # as in a host application
    monkeypatch.setenv("COLUMNS", "200")  # the bar's fields fit whatever terminal runs pytest
    records: list[dict] = []
    out = _Tty()
    console = _console("on", out, records)
    groups = [_group("1+1=", [0, 1], 1.0, True)]
    for step in range(1, 5):
        console.step({**RECORD, "step": step, "time": 10.0 * step}, groups)
    assert [r["step"] for r in records] == [2, 4]
    assert records[0] == {"kind": "completions", "step": 2, "rows": [
        {"prompt": "1+1=", "completion": "ab", "reward": 1.0, "correct": True}]}  # fmt: skip
    screen = _screen(out.getvalue())
    assert "── step 4: 1 sampled completion ──" in screen
    assert "    completion: ab" in screen
    # 10 tokens x 4 groups x 2 samples in the 10 s since the previous step
    assert screen[-1].startswith("step 4/4 ") and "8 tok/s" in screen[-1]
    console.close()
    assert _screen(out.getvalue())[-1] == ""  # the last bar stays as an ordinary line
    # "auto" on a terminal asyncrl does not own (a host application's logging), or "off"
    for progress, stream in (("auto", _Tty()), ("off", _Tty())):
        quiet = _console(progress, stream, [])
        quiet.step({**RECORD, "step": 1}, groups)
        assert "\r" not in stream.getvalue() and "step 1/4" not in stream.getvalue()
