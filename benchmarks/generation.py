"""Generation through asyncrl against vLLM alone: the same prompts, sampling and engine, side by
side in one invocation.

    python benchmarks/generation.py                       # GPU: the issue-28 workload
    python benchmarks/generation.py --size tiny --prompts 16 --samples 4 --max-tokens 16 \\
        --in-flight 64,4 --parts side                     # CPU (vLLM CPU build), CI-sized

The model is random (bf16): Qwen2.5-0.5B-shaped by default (``--size 0.5b``), or the 2-layer,
128-wide ``tiny`` for the CPU. Its tokenizer maps the word ``t<i>`` to token ``i``, so that a
prompt's text and its token ids are the same thing both ways. ``--prompts`` prompts of
``--prompt-len`` random tokens, ``--samples`` samples each, ``--max-tokens`` new tokens (EOS is
token 2, which a random model almost never samples).

**side** (for each ``--in-flight`` K): rounds of the workload, a warm-up round first
(``--warm-rounds``) and the measured ones after it (K >= prompts x samples: one round of them
all; below: two rounds of 4 K samples in groups of min(samples, K), at least 2, GRPO's
smallest group, so K = 1 runs as 2), run

- *vLLM alone*: one ``AsyncLLM`` in this process, the engine arguments asyncrl's vLLM backend
  gives it, one request per sample shaped as the backend shapes it (seed per sample,
  ``logprobs=0``, no detokenizing, final output only), at most K at once, each round run to
  its end before the next; once with vLLM's own scheduler (stock vLLM) and once with the
  scheduler the backend gives vLLM by default (``logprobs_at_end``: the same engine as
  asyncrl's, so that ratio is asyncrl's own cost); ``--alone`` picks (``ALONE``);
- *through asyncrl*: ``asyncrl.Controller`` with its processes (controller, one rollout worker
  with the same engine, one trainer rank of the ``frozen`` backend, which serves the
  checkpoint and makes no update), the ``dataset`` environment scoring every sample, sync
  steps (one round each) and ``pipeline.max_inflight_samples = K``.

Figures: generated tokens/s each way (asyncrl: the measured steps' tokens over their
generation spans, first dispatch to last sample back; training and refits between steps are
reported apart), asyncrl's ratio to each vLLM-alone column, the GPU's busy fraction
(``nvidia-smi``, sampled every 100 ms over the spans), and asyncrl's time: the engine
generating (the worker's own account), the rest of the spans (dispatch, the return path,
gaps), scoring (the controller's threads) and the time between steps.

**options**: vLLM alone at ``--options-in-flight`` requests (default all), one row per request
shape or engine option (``OPTIONS``; ``--rows`` picks some), against the shape asyncrl sends:
tokens/s (the median of ``--option-repeats`` runs, interleaved on each engine), the ratio to
that shape, GPU busy over all the row's runs. ``--profile DIR`` records each engine's rows
with py-spy after its warm-up (``benchmarks/gpu/profile_generation.sh``).

``--share-engines`` keeps the options part's last engine for the *side* part's vLLM-alone
column on vLLM's scheduler where their engine arguments are the same (no engine row last),
its prefix cache reset in between: one engine start less, for a smoke run (CI); by default
each builds its own, as the figures in ``benchmarks/results/`` were measured.

``--tuned KEY=VALUE,...`` adds a third column to *side*: asyncrl with those
``generator.options`` (e.g. ``max_num_seqs=512``). Results print as markdown and go to
``--out`` (default ``runs/benchmarks/generation.json``; figures kept per machine are in
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import anyio
import numpy as np
from asyncrl_vllm.backend import SCHEDULER
from random_workload import (
    EOS, SHAPES, cuda, engine_options, make_prompts, run_sections, write_dataset, write_model,
)  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
OPTIONS: dict[str, dict[str, Any]] = {
    "as asyncrl sends (seed per sample, logprobs=0, n=1, final only)": {},
    "no per-sample seed": {"seed": None},
    "no logprobs": {"logprobs": None},
    "n per prompt (one request, n samples, seeded)": {"n_per_prompt": True},
    "n per prompt, no seed": {"n_per_prompt": True, "seed": None},
    "output kind DELTA (streamed)": {"output_kind": "DELTA"},
    "logprobs at the end (asyncrl's scheduler, its default)": {
        "engine": {"scheduler_cls": SCHEDULER}
    },
    "async scheduling off": {"engine": {"async_scheduling": False}},
    "max_num_seqs 256, 8,192 batched tokens": {
        "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
    },
    "max_num_seqs 512, 8,192 batched tokens": {
        "engine": {"max_num_seqs": 512, "max_num_batched_tokens": 8192}
    },
    "max_num_seqs 512, no per-sample seed": {
        "seed": None, "engine": {"max_num_seqs": 512, "max_num_batched_tokens": 8192}
    },
}
"""Each row's change to the request (``seed``, ``logprobs``, ``output_kind``, ``n_per_prompt``)
or to the engine (``engine``: more engine arguments; a new engine is built for it)."""

ALONE: dict[str, tuple[str, dict[str, Any]]] = {
    "vllm": ("alone", {}),
    "asyncrl": ("alone_held", {"scheduler_cls": SCHEDULER}),
}
"""The *side* part's vLLM-alone columns (``--alone``): the result key and the engine
arguments added to the backend's. ``vllm``: vLLM's own scheduler (stock vLLM, the issue's
baseline); ``asyncrl``: the scheduler asyncrl's backend gives vLLM by default
(``logprobs_at_end``), so that the engine is the same both sides and the ratio is asyncrl's
own cost."""


# ---------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class Plan:
    """One in-flight level's rounds: ``warm`` + ``measured`` rounds (asyncrl: sync steps) of
    ``prompts`` x ``samples``, at most ``in_flight`` samples generating at once."""

    in_flight: int
    prompts: int
    samples: int
    warm: int
    measured: int

    @property
    def per_round(self) -> int:
        return self.prompts * self.samples

    @classmethod
    def of(cls, k: int, args: argparse.Namespace) -> Plan:
        if k >= args.prompts * args.samples:
            return cls(k, args.prompts, args.samples, args.warm_rounds, 1)
        n = max(2, min(args.samples, k))  # GRPO's smallest group; asyncrl needs K >= n
        return cls(max(k, n), max(1, 4 * k // n), n, args.warm_rounds, 2)


def standalone_engine_args(model: Path, options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's engine arguments as asyncrl's vLLM backend builds them from ``options``
    (asyncrl_vllm.backend.VLLMBackend._engine_args), without its worker extension and with
    vLLM's own scheduler (an :data:`OPTIONS` row measures asyncrl's)."""
    args: dict[str, Any] = dict(
        model=str(model), dtype="bfloat16", seed=0, enforce_eager=False,
        enable_prefix_caching=True, logprobs_mode="processed_logprobs",
        skip_tokenizer_init=True, max_logprobs=-1, disable_log_stats=True,
    )  # fmt: skip
    if not cuda():
        args["enable_chunked_prefill"] = False  # as the backend does on the CPU build
    for key, value in options.items():
        if key == "extra_engine_args":
            args.update(value)
        elif key == "cpu_kvcache_space_gib":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(value)
        elif key == "cpu_omp_threads_bind":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(value)
        else:
            args[key] = value
    return args


@contextlib.asynccontextmanager
async def standalone(model: Path, options: dict[str, Any]) -> AsyncIterator[Any]:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm.engine.arg_utils import AsyncEngineArgs

    from asyncrl_vllm.backend import make_engine

    # the backend's process layout (one engine process on the CPU build too): the two sides
    # differ in asyncrl's own path alone
    llm = make_engine(AsyncEngineArgs(**standalone_engine_args(model, options)), cuda=cuda())
    try:
        yield llm
    finally:
        llm.shutdown()
        del llm


SHARED = "  (on the engine kept from before, its prefix cache reset)"
"""What ``--share-engines`` prints where an engine is used again."""


class Engines:
    """The standalone engines of one invocation, built on first use: a fresh one for each use,
    or with ``share`` (``--share-engines``) the last one kept for the next use with the same
    options, its prefix cache reset in between (the options part's prompts are the side part's
    too: a cached prefix would skip their prefill). At most one engine lives at a time."""

    def __init__(self, model: Path, share: bool) -> None:
        self.model, self.share = model, share
        self._kept: tuple[str, Any, contextlib.AsyncExitStack] | None = None

    async def __aenter__(self) -> Engines:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def use(self, options: dict[str, Any]) -> AsyncIterator[Any]:
        """An engine for ``options`` over the block: shut down after it, or with ``share``
        kept until an engine of other options is asked for, :meth:`close` or the end."""
        if not self.share:
            async with standalone(self.model, options) as llm:
                yield llm
            return
        key = json.dumps(options, sort_keys=True)
        if self._kept is not None and self._kept[0] == key:
            llm = self._kept[1]
            if not await llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset the shared engine's prefix cache")
            print(SHARED, flush=True)
        else:
            await self.close()
            stack = contextlib.AsyncExitStack()
            llm = await stack.enter_async_context(standalone(self.model, options))
            self._kept = (key, llm, stack)
        yield llm

    async def close(self) -> None:
        """Shuts the kept engine down (none is kept without ``share``)."""
        if self._kept is not None:
            stack, self._kept = self._kept[2], None
            await stack.aclose()


def sampling_params(max_tokens: int, change: dict[str, Any], seed: int | None, n: int = 1) -> Any:
    """The request asyncrl's backend sends for one sample (asyncrl_vllm.engine_io.sampling_params),
    with ``change`` applied."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    logprobs = change.get("logprobs", 0)
    return SamplingParams(
        n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens,
        logprobs=logprobs, seed=seed if change.get("seed", 0) is not None else None,
        detokenize=False, stop_token_ids=[EOS], flat_logprobs=logprobs is not None,
        output_kind=getattr(RequestOutputKind, change.get("output_kind", "FINAL_ONLY")),
    )  # fmt: skip


async def warm_up(llm: Any, args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """A short round at the options' batch size (allocator, kernels for its shapes)."""
    count = args.options_prompts or args.prompts
    await run_alone(llm, prompts[:count], args.samples, 16, count * args.samples, tag="warm-")


async def run_alone(
    llm: Any, prompts: list[list[int]], samples: int, max_tokens: int, in_flight: int,
    change: dict[str, Any] | None = None, tag: str = "",
) -> tuple[int, float]:  # fmt: skip
    """Every prompt ``samples`` times, at most ``in_flight`` requests at once; generated
    tokens and seconds from the first request to the last output."""
    change = change or {}
    per_prompt = change.get("n_per_prompt", False)
    limit = anyio.Semaphore(max(1, in_flight // samples) if per_prompt else in_flight)
    tokens = 0

    async def one(rid: str, ids: list[int], seed: int, n: int) -> None:
        nonlocal tokens
        params = sampling_params(max_tokens, change, seed, n)
        prompt = {"type": "token", "prompt_token_ids": ids}
        async with limit:
            final = None
            async for out in llm.generate(prompt, params, request_id=rid):
                final = out
                if params.output_kind.name == "DELTA":
                    tokens += sum(len(c.token_ids) for c in out.outputs)
            if params.output_kind.name != "DELTA":
                tokens += sum(len(c.token_ids) for c in final.outputs)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p, ids in enumerate(prompts):
            if per_prompt:
                tg.start_soon(one, f"{tag}{p}", ids, 1000 * p, samples)
            else:
                for i in range(samples):
                    tg.start_soon(one, f"{tag}{p}/{i}", ids, 1000 * p + i, 1)
    return tokens, time.perf_counter() - start


@contextlib.contextmanager
def profiled(out: Path) -> Iterator[None]:
    """py-spy on this process and its children (vLLM's engine core) while the block runs,
    py-spy's raw output in ``out``: the steady state only, where a profile of the whole
    command would mix in engine start-up (``benchmarks/profile_top.py`` reads it)."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
    out.parent.mkdir(parents=True, exist_ok=True)
    err_file = out.with_suffix(".stderr").open("w")  # a pipe nobody reads would stall py-spy
    proc = subprocess.Popen(
        [spy, "record", "--pid", str(os.getpid()), "--subprocesses", "--nonblocking",
         "--format", "raw", "--rate", "100", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=err_file, text=True,
    )  # fmt: skip
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err_file.close()
        if not out.is_file():
            err = out.with_suffix(".stderr").read_text().strip()[-300:]
            print(f"py-spy wrote no profile ({err})", flush=True)


# ---------------------------------------------------------------------------- GPU busy
class GpuBusy:
    """``nvidia-smi``'s utilization every 100 ms, timestamped; :meth:`mean_over` over spans."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuBusy:
        if cuda():
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-i", "0", "-lms", "100"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                self.samples.append((time.perf_counter(), float(line.strip()) / 100))

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def mean_over(self, spans: list[tuple[float, float]]) -> float | None:
        inside = [u for t, u in self.samples if any(a <= t <= b for a, b in spans)]
        return float(np.mean(inside)) if inside else None


# ---------------------------------------------------------------------------- asyncrl
def asyncrl_config(
    args: argparse.Namespace, plan: Plan, work: Path, data: Path, rewards: Path,
    options: dict[str, Any], name: str,
) -> dict[str, Any]:  # fmt: skip
    return run_sections(work / "model", data, rewards) | {
        "run": {"num_steps": plan.warm + plan.measured, "seed": 0,
                "output_dir": str(work / "runs" / name), "log_format": "json"},  # fmt: skip
        "grpo": {"prompts_per_step": plan.prompts, "samples_per_prompt": plan.samples,
                 "max_new_tokens": args.max_tokens, "temperature": 1.0},  # fmt: skip
        "pipeline": {
            # sync: a step's generation is one round, as the standalone side's
            "sampler": {"name": "in_order", "max_lookahead_versions": 0},
            "max_inflight_samples": plan.in_flight,
            "min_groups_for_streaming_train": plan.prompts,
        },
        "trainer": {"backend": "frozen", "micro_batch_size": 64},
        "generator": {"backend": "vllm", "options": options},
    }


async def run_asyncrl(config_data: dict[str, Any], warm: int, busy: GpuBusy) -> dict[str, Any]:
    """One run; figures over its steps after the ``warm`` first ones."""
    import asyncrl
    from asyncrl.config import from_dict

    config = from_dict(config_data)
    async with asyncrl.Controller(config) as ctl:
        t0 = ctl.status().clock_origin
        steps = (await ctl.train()).steps[warm:]
    spans = [(t0 + r["gen_start"], t0 + r["gen_end"]) for r in steps]
    seconds = sum(b - a for a, b in spans)
    tokens = sum(r["response_tokens"] for r in steps)
    engine = sum(r["engine_busy_s"] for r in steps)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "gpu_busy": busy.mean_over(spans),
        "engine_s": engine,
        "score_s": sum(r["score_s"] for r in steps),
        "other_s": max(0.0, seconds - engine),
        "between_steps_s": sum(r["time"] - r["gen_end"] for r in steps),  # train + refit
        "refit_s": sum(r["refit_s"] for r in steps),
        "steps": len(steps),
    }


# ---------------------------------------------------------------------------- parts
async def alone_rounds(
    llm: Any, plan: Plan, prompts: list[list[int]], max_tokens: int, busy: GpuBusy
) -> dict[str, Any]:
    """``plan``'s rounds on an engine of our own: each round's prompts run to their end before
    the next starts (as a sync step); figures over the measured rounds."""
    tokens, spans = 0, []
    for r in range(plan.warm + plan.measured):
        batch = prompts[r * plan.prompts : (r + 1) * plan.prompts]
        start = time.perf_counter()
        got, seconds = await run_alone(llm, batch, plan.samples, max_tokens, plan.in_flight,
                                       tag=f"k{plan.in_flight}-r{r}-")  # fmt: skip
        if r >= plan.warm:
            tokens += got
            spans.append((start, start + seconds))
    seconds = sum(b - a for a, b in spans)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "gpu_busy": busy.mean_over(spans)}  # fmt: skip


async def part_side(
    args: argparse.Namespace, work: Path, engines: Engines, prompts: list[list[int]],
    busy: GpuBusy, rows: list[dict[str, Any]], keep: Any,
) -> None:  # fmt: skip
    """Fills ``rows`` (one per in-flight level) and calls ``keep()`` after every figure."""
    plans = [Plan.of(k, args) for k in args.in_flight]
    rows += [{"in_flight": p.in_flight, "samples": p.per_round * p.measured} for p in plans]
    options = engine_options(args.gpu_memory_utilization, args.cpu_bind)
    for kind in args.alone:
        key, extra = ALONE[kind]
        print(f"side: vLLM alone, {kind}'s scheduler ({json.dumps(options)})", flush=True)
        # as the options part passes them: the same arguments build (or share) the same engine
        engine = options | ({"extra_engine_args": extra} if extra else {})
        async with engines.use(engine) as llm:
            for plan, row in zip(plans, rows):
                row[key] = await alone_rounds(llm, plan, prompts, args.max_tokens, busy)
                keep()
                print(f"  K={plan.in_flight}: {row[key]['tok_s']:,.0f} tok/s {key}, GPU busy "
                      f"{pct(row[key]['gpu_busy'])}", flush=True)  # fmt: skip
    await engines.close()  # asyncrl's worker builds its own
    data, rewards = write_dataset(prompts, work)
    columns = [("asyncrl", options)]
    if args.tuned:
        columns.append(("tuned", options | args.tuned))
    for column, opts in columns:
        for plan, row in zip(plans, rows):
            name = f"{column}-k{plan.in_flight}"
            config = asyncrl_config(args, plan, work, data, rewards, opts, name)
            got = row[column] = await run_asyncrl(config, plan.warm, busy)
            for key, _ in ALONE.values():  # ratio: to vLLM's scheduler; ratio_held: to ours
                if key in row:
                    got[key.replace("alone", "ratio")] = got["tok_s"] / row[key]["tok_s"]
            keep()
            print(f"  K={plan.in_flight}: {got['tok_s']:,.0f} tok/s {column}: "
                  f"{json.dumps(got)}", flush=True)  # fmt: skip


async def part_options(
    args: argparse.Namespace, engines: Engines, prompts: list[list[int]], busy: GpuBusy,
    rows: list[dict[str, Any]], keep: Any,
) -> None:  # fmt: skip
    """Fills ``rows`` (one per :data:`OPTIONS` entry) and calls ``keep()`` after each."""
    base = engine_options(args.gpu_memory_utilization, args.cpu_bind)
    count = args.options_prompts or args.prompts
    k = args.options_in_flight or count * args.samples
    by_engine: dict[str, list[str]] = {}
    for name, change in selected(args.rows).items():
        by_engine.setdefault(json.dumps(change.get("engine", {}), sort_keys=True), []).append(name)
    for i, (engine_json, names) in enumerate(by_engine.items()):
        extra = json.loads(engine_json)
        options = base | ({"extra_engine_args": extra} if extra else {})
        async with engines.use(options) as llm, contextlib.AsyncExitStack() as on:
            await warm_up(llm, args, prompts)
            if args.profile is not None:  # from here on: the engine's steady state
                on.enter_context(profiled(args.profile / f"profile-engine{i}.txt"))
            mine = {name: {"option": name, "runs": []} for name in names}
            spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
            rows.extend(mine.values())
            for r in range(args.option_repeats):  # interleaved: drift hits every row alike
                for name in names:
                    start = time.perf_counter()
                    tokens, seconds = await run_alone(
                        llm, prompts[:count], args.samples, args.max_tokens, k, OPTIONS[name],
                        tag=f"{len(rows)}-{r}-{name[:8]}-",
                    )  # fmt: skip
                    row = mine[name]
                    row["runs"].append(tokens / seconds)
                    spans[name].append((start, start + seconds))
                    row.update(tokens=tokens, seconds=seconds, tok_s=median(row["runs"]),
                               gpu_busy=busy.mean_over(spans[name]))  # fmt: skip
                    row["vs_asyncrl_shape"] = row["tok_s"] / rows[0]["tok_s"]
                    keep()
                    print(f"  {name} (run {r + 1}): {tokens / seconds:,.0f} tok/s, GPU busy "
                          f"{pct(busy.mean_over(spans[name][-1:]))}", flush=True)  # fmt: skip


def selected(words: str) -> dict[str, dict[str, Any]]:
    """The :data:`OPTIONS` rows named by ``words`` (comma-separated; all when empty), in
    their order: a word that is a row's whole name selects that row alone, any other word the
    rows whose name contains it; the first row (asyncrl's request shape, the ratios' base)
    always.

    Raises:
        SystemExit: a word that names no row.
    """
    wanted = [w.strip() for w in words.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(w in name for name in OPTIONS)]
    if unknown:
        raise SystemExit(f"--rows: {', '.join(unknown)} names no row of {list(OPTIONS)}")
    first = next(iter(OPTIONS))
    parts = [w for w in wanted if w not in OPTIONS]
    return {n: c for n, c in OPTIONS.items()
            if not wanted or n == first or n in wanted or any(w in n for w in parts)}  # fmt: skip


# ---------------------------------------------------------------------------- report
def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def side_table(rows: list[dict[str, Any]]) -> str:
    names = {"vllm": "vLLM's", "asyncrl": "asyncrl's"}
    alone = [(k, names[kind]) for kind, (k, _) in ALONE.items() if any(k in r for r in rows)]
    columns = [c for c in ("asyncrl", "tuned") if any(c in r for r in rows)]
    head = "| in flight | samples |"
    head += "".join(f" vLLM alone, {name} scheduler tok/s (GPU busy) |" for _, name in alone)
    for c in columns:
        head += f" {c} tok/s (GPU busy) |"
        head += "".join(f" {c} / alone ({name}) |" for _, name in alone)
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in rows:
        line = f"| {r['in_flight']} | {r['samples']} |"
        line += "".join(_figure(r.get(k)) for k, _ in alone)
        for c in columns:
            line += _figure(r.get(c))
            for k, _ in alone:
                ratio = r.get(c, {}).get(k.replace("alone", "ratio"))
                line += " - |" if ratio is None else f" {100 * ratio:.1f}% |"
        lines.append(line)
    lines += ["", "| in flight | asyncrl generating s | engine busy s | dispatch, return, gaps s | "
              "scoring s (threads) | between steps s (train + refit) |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        if (s := r.get("asyncrl")) is not None:
            lines.append(f"| {r['in_flight']} | {s['seconds']:.2f} | {s['engine_s']:.2f} | "
                         f"{s['other_s']:.2f} | {s['score_s']:.2f} | {s['between_steps_s']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def _figure(run: dict[str, Any] | None) -> str:
    return " - |" if run is None else f" {run['tok_s']:,.0f} ({pct(run['gpu_busy'])}) |"


def options_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| request shape or engine option | tok/s | vs asyncrl's shape | GPU busy |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        if not r.get("runs"):
            continue  # not run (the invocation ended first)
        runs = "" if len(r["runs"]) == 1 else f" (median of {len(r['runs'])})"
        lines.append(f"| {r['option']} | {r['tok_s']:,.0f}{runs} | {r['vs_asyncrl_shape']:.2f}x"
                     f" | {pct(r['gpu_busy'])} |")  # fmt: skip
    return "\n".join(lines)


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        import vllm

        facts["vllm"] = vllm.__version__
    if cuda():
        with contextlib.suppress(Exception):
            facts["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
    return facts


async def main(args: argparse.Namespace) -> None:
    import asyncrl.obs.log

    asyncrl.obs.log.configure("console", level="warning")
    results: dict[str, Any] = {"host": host_facts(), "workload": {
        "size": args.size, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "samples": args.samples, "max_tokens": args.max_tokens}}  # fmt: skip
    print(json.dumps(results), flush=True)
    with contextlib.ExitStack() as stack:
        if args.work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncrl-gen-")))
        else:
            work = args.work
        write_model(args.size, work / "model")
        needed = max([args.prompts] + [(p.warm + p.measured) * p.prompts
                                       for p in map(lambda k: Plan.of(k, args), args.in_flight)])  # fmt: skip
        prompts = make_prompts(needed, args.prompt_len, SHAPES[args.size][5])
        busy = stack.enter_context(GpuBusy())
        keep = lambda: save(results, args)  # noqa: E731 - every figure is written as it comes
        async with Engines(work / "model", args.share_engines) as engines:
            if "options" in args.parts:
                print("options:", flush=True)
                await part_options(args, engines, prompts, busy,
                                   results.setdefault("options", []), keep)  # fmt: skip
                print(options_table(results["options"]), flush=True)
            if "side" in args.parts:
                await part_side(args, work, engines, prompts, busy,
                                results.setdefault("side", []), keep)  # fmt: skip
                print(side_table(results["side"]), flush=True)


def save(results: dict[str, Any], args: argparse.Namespace) -> None:
    out = args.out or ROOT / "runs" / "benchmarks" / "generation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def _options(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key] = json.loads(value)
    return out


def _alone(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in ALONE for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: name one or both of {list(ALONE)}")
    return kinds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="options,side", help="options, side, or both")
    parser.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 16, 1])  # fmt: skip
    parser.add_argument("--options-prompts", type=int, default=0,
                        help="prompts per option row (default --prompts)")  # fmt: skip
    parser.add_argument("--options-in-flight", type=int, default=0,
                        help="requests at once per option row (default all)")  # fmt: skip
    parser.add_argument("--option-repeats", type=int, default=1,
                        help="runs of each option row, interleaved on its engine (median)")  # fmt: skip
    parser.add_argument("--rows", default="",
                        help="option rows to run: comma-separated words each row's name must "
                             "contain one of (default all), e.g. 'asyncrl,logprobs'")  # fmt: skip
    parser.add_argument("--alone", type=_alone, default=list(ALONE),
                        help="side: the vLLM-alone columns, 'vllm' (vLLM's scheduler) and/or "
                             "'asyncrl' (the backend's default scheduler); default both")  # fmt: skip
    parser.add_argument("--share-engines", action="store_true",
                        help="side's vLLM-alone column on vLLM's scheduler on the options "
                             "part's last engine where the engine arguments are the same "
                             "(prefix cache reset): one start less, for a smoke run; default: "
                             "a fresh engine each")  # fmt: skip
    parser.add_argument("--tuned", type=_options, default={},
                        help="generator.options of a third 'tuned' column, e.g. max_num_seqs=512")  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None,
                        help="options: py-spy (on PATH) over each engine's rows after its "
                             "warm-up, raw output in DIR/profile-engine<i>.txt")  # fmt: skip
    parser.add_argument("--warm-rounds", type=int, default=1,
                        help="rounds (asyncrl: steps) run before measuring, both sides")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--cpu-bind", default="1", help="CPU build: the engine's OpenMP cores")
    parser.add_argument("--work", type=Path, default=None, help="keep the model and runs here")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse_args())
