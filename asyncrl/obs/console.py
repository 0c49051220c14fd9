"""A terminal people can read: a one-line progress bar and sampled completions.

* :class:`Terminal` is the controller's stderr when asyncrl configured logging itself
  (:func:`asyncrl.obs.log.configure`): a log line written through it first clears the progress bar
  and redraws it after, so bar and log lines never garble each other.
* :func:`progress_line` formats the bar from a step's ``train`` record (pure).
* :class:`Console` follows the run's steps: it draws the bar (only on an interactive
  terminal, so non-interactive logs stay free of carriage returns) and, every
  ``metrics.completions_every`` steps, picks :data:`COMPLETIONS_SHOWN` completions with their
  rewards
  (:func:`pick_completions`), prints them (a block on a console, one structured log event in
  JSON logs) and writes them as a ``completions`` record for the metrics sinks' tables.

Other processes (workers) may still write to the same terminal; the bar is redrawn on the
next step or log line.
"""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

import structlog

from asyncrl.obs.startup import describe

__all__ = [
    "COMPLETIONS_SHOWN",
    "TERMINAL",
    "Console",
    "Terminal",
    "claim_terminal",
    "owns_terminal",
    "pick_completions",
    "progress_line",
]

log = structlog.get_logger("asyncrl.obs.console")

COMPLETIONS_SHOWN = 3
"""Completions shown every ``metrics.completions_every`` steps (one per group, the first groups
of the step): enough to see what the model writes, few enough for a terminal screen. Once the
config key ``metrics.completions_count`` (issue 50), as ``metrics.progress`` was the bar's
``auto`` (drawn on an interactive terminal only, the only setting that made sense)."""

_CLEAR = "\r\x1b[K"


class Terminal:
    """A text stream over stderr (looked up on each write, so a redirected ``sys.stderr``
    is honoured) that keeps one status line at the bottom."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._bar = ""
        self._shown = False  # the bar is on screen (the cursor is at its end)
        self._lock = threading.RLock()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):  # a closed or exotic stream
            return False

    def write(self, text: str) -> int:
        with self._lock:
            if self._shown:
                self.stream.write(_CLEAR)
                self._shown = False
            self.stream.write(text)
            if self._bar and text.endswith("\n"):
                self._draw()
            return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def show(self, bar: str) -> None:
        """Draw ``bar`` as the status line (replacing the last one)."""
        with self._lock:
            self._bar = bar
            if self._shown:
                self.stream.write(_CLEAR)
            self._draw()

    def close_bar(self) -> None:
        """End the status line: the last bar stays on screen as an ordinary line."""
        with self._lock:
            if self._shown:
                self.stream.write("\n")
                self.stream.flush()
            self._bar, self._shown = "", False

    def _draw(self) -> None:
        self.stream.write(self._bar[: max(20, columns() - 1)])
        self.stream.flush()
        self._shown = True


def columns() -> int:
    """The terminal's width (``COLUMNS``, else stderr's terminal, else 100)."""
    return shutil.get_terminal_size((100, 20)).columns


TERMINAL = Terminal()
"""The controller process's stderr, shared by the log renderer and the progress bar."""

_rendering: str | None = None  # the log renderer asyncrl configured ("console"/"json")


def claim_terminal(rendering: str) -> Terminal:
    """Called by :func:`asyncrl.obs.log.configure` when asyncrl sets up logging itself (not in a
    host application that configured structlog): log lines in ``rendering`` go through
    :data:`TERMINAL`, so the progress bar may be shown."""
    global _rendering
    _rendering = rendering
    return TERMINAL


def owns_terminal() -> bool:
    """Whether asyncrl configured this process's log output (see :func:`claim_terminal`)."""
    return _rendering is not None


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(
    record: dict[str, Any],
    *,
    total_steps: int,
    first_step: int,
    elapsed_s: float,
    tokens_per_s: float | None,
    width: int = 20,
    columns: int = 200,
) -> str:
    """The progress bar after ``record`` (a ``train`` record): steps done of ``total_steps``,
    reward, accuracy, staleness, generated tokens per second and the time left, estimated
    from the ``elapsed_s`` seconds the steps after ``first_step`` took (a resumed run counts
    only its own steps). Fields that do not fit in ``columns`` are left out from the end."""
    step = int(record["step"])
    done = min(1.0, step / total_steps) if total_steps else 1.0
    filled = int(done * width)
    bar = "█" * filled + "░" * (width - filled)
    parts = [
        f"step {step}/{total_steps} {bar}",
        f"reward {record['reward']:.3f}",
        f"acc {record['accuracy']:.3f}",
        f"stale {record['staleness_mean']:.1f}/{record['staleness_max']}",
    ]
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    run_steps = step - first_step
    if run_steps > 0 and step < total_steps:
        parts.append(f"ETA {_clock(elapsed_s / run_steps * (total_steps - step))}")
    parts.append(f"elapsed {_clock(elapsed_s)}")
    while len(parts) > 1 and len(" | ".join(parts)) > columns - 1:
        parts.pop()  # a narrow terminal: whole fields go from the end, none is cut
    return " | ".join(parts)


def pick_completions(
    groups: Sequence[Any], count: int, decode: Any, limit: int = 2000
) -> list[dict[str, Any]]:
    """One completion from each of the first ``count`` groups of a step (their first
    sample), with its prompt, reward and correctness; ``decode`` turns token ids into text.
    Texts are cut at ``limit`` characters (a table cell, not a dump)."""
    rows = []
    for group in list(groups)[:count]:
        if not group.samples:
            continue
        sample = group.samples[0]
        prompt = group.prompt_text or decode(group.prompt_ids)
        rows.append({
            "prompt": prompt[:limit],
            "completion": decode(sample.token_ids)[:limit],
            "reward": float(sample.reward),
            "correct": bool(sample.correct),
        })  # fmt: skip
    return rows


def _block(step: int, rows: list[dict[str, Any]]) -> str:
    lines = [f"── step {step}: {len(rows)} sampled completion{'s' * (len(rows) != 1)} ──"]
    for i, row in enumerate(rows, start=1):
        mark = "correct" if row["correct"] else "wrong"
        lines.append(f"[{i}] reward {row['reward']:.3f} ({mark})")
        lines.append(f"    prompt:     {_indent(row['prompt'])}")
        lines.append(f"    completion: {_indent(row['completion'])}")
    return "\n".join(lines) + "\n"


def _indent(text: str) -> str:
    return text.strip().replace("\n", "\n" + " " * 16)


class Console:
    """The run's terminal output beside the logs (one per controller run)."""

    def __init__(
        self,
        *,
        total_steps: int,
        samples_per_prompt: int,
        progress: str,
        completions_every: int,
        completions_count: int,
        decode: Any,
        write_record: Any = None,
        terminal: Terminal = TERMINAL,
        blocks: bool | None = None,
    ) -> None:
        """``progress``: ``auto`` / ``on`` / ``off`` (``auto``: only when ``terminal`` is
        interactive and asyncrl owns the log output). ``write_record``: where
        ``completions`` records go (the metrics writer). ``blocks``: print completions as a
        text block (default: when the log renderer is the console's)."""
        owned = owns_terminal()
        self.terminal = terminal
        self.bar = progress == "on" or (progress == "auto" and owned and terminal.isatty())
        self.blocks = _rendering == "console" if blocks is None else blocks
        self.total_steps = total_steps
        self.samples_per_prompt = samples_per_prompt
        self.every = completions_every
        self.count = completions_count
        self.decode = decode
        self.write_record = write_record
        self._first: tuple[int, float] | None = None  # (step before this life's first, time)
        self._last: tuple[int, float] | None = None

    @classmethod
    def for_run(cls, config: Any, decode: Any, metrics: Any, total_steps: int) -> Console:
        """The console of a run with ``config`` (its ``[metrics]`` section) of
        ``total_steps``, decoding with ``decode`` and writing ``completions`` records to
        ``metrics`` (may be None)."""
        m = config.metrics
        return cls(
            total_steps=total_steps,
            samples_per_prompt=config.grpo.samples_per_prompt,
            progress="auto",
            completions_every=m.completions_every,
            completions_count=COMPLETIONS_SHOWN,
            decode=decode,
            write_record=metrics.write if metrics is not None else None,
        )

    def step(self, record: dict[str, Any], groups: Sequence[Any]) -> None:
        """A step finished: redraw the bar; show completions when the step is due."""
        step, now = int(record["step"]), float(record["time"])
        if self._first is None:  # this life starts with the first step's own generation
            self._first = (step - 1, now - float(record.get("gen_s") or 0.0))
        tokens_per_s = None
        if self._last is not None and now > self._last[1]:
            tokens = record["response_len"] * record["groups"] * self.samples_per_prompt
            tokens_per_s = tokens / (now - self._last[1])
        self._last = (step, now)
        if self.every and step % self.every == 0:
            self._completions(step, groups)
        if self.bar:
            self.terminal.show(
                progress_line(
                    record,
                    total_steps=self.total_steps,
                    first_step=self._first[0],
                    elapsed_s=now - self._first[1],
                    tokens_per_s=tokens_per_s,
                    columns=columns(),
                )
            )

    def startup(self, record: dict[str, Any]) -> None:
        """Step 1 of a fresh run is done: where the time to it went (a ``startup`` record),
        as a line of text on a console, else as the ``startup_measured`` log line."""
        if self.blocks:
            self.terminal.write(f"start-up: {describe(record)}\n")
            self.terminal.flush()
        else:
            log.info("startup_measured", first_step_s=record["first_step_s"],
                     **record["phases"], by_worker=record["workers"])  # fmt: skip

    def close(self) -> None:
        if self.bar:
            self.terminal.close_bar()

    def _completions(self, step: int, groups: Sequence[Any]) -> None:
        rows = pick_completions(groups, self.count, self.decode)
        if not rows:
            return
        if self.write_record is not None:
            self.write_record({"kind": "completions", "step": step, "rows": rows})
        if self.blocks:
            self.terminal.write(_block(step, rows))
            self.terminal.flush()
        else:
            log.info("sampled_completions", step=step, completions=rows)
