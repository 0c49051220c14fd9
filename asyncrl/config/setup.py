"""``[run]``, ``[model]``, ``[cluster]`` and ``[environment]``: what runs, where, on what.

Each section's checks sit with it (``problems()``); :func:`asyncrl.config.problems` gathers
every section's.
"""

from __future__ import annotations

import importlib.util
import json

from pathlib import Path
from typing import Any, Literal

from asyncrl.config.section import Section, at_least_one, fail
from asyncrl.errors import ConfigError

__all__ = ["ClusterConfig", "EnvironmentConfig", "ModelConfig", "RunConfig"]


class RunConfig(Section):
    name: str = "asyncrl"
    """A label for logs and the metrics file."""
    output_dir: str = "runs/asyncrl"
    """Where metrics (``metrics.jsonl``), worker logs and the trained samples
    (``save_samples``) go. Relative paths are resolved against the directory of the config
    file."""
    seed: int = 0
    """Seed for the dataloader order, sampling seeds and trainer initialisation."""
    num_steps: int = 10
    """Number of optimizer steps (= weight versions) to train."""
    max_num_epochs: int = 0
    """Also end the run after this many passes over the train split (each pass its size //
    ``grpo.prompts_per_step`` steps; the run stops at whichever bound comes first). 0: no
    bound."""
    log_format: Literal["auto", "console", "json"] = "auto"
    """Log rendering when asyncrl configures logging itself (CLI and workers)."""
    stall_warning_s: float = 10.0
    """When the controller's event loop has not turned for this long (a blocking call starves
    both pumps), a watchdog thread logs every thread's stack (also ``logs/stall-*.txt``). 0: off."""
    gc_freeze: bool = True
    """While training, exclude the objects alive at its start from the garbage collector's
    scans (``gc.freeze``; undone at the end): a full collection over the start-up heap stalled
    the controller's event loop 20-30 ms, 5 ms with it."""
    gc_young_interval_s: float = 0.05
    """While training, Python's automatic garbage collector is off and the controller runs
    a young collection this often (a few ms each), and a full one every
    ``gc_full_interval_s`` (asyncrl/obs/collector.py). Left to itself, the collector came
    rarely and then scanned every call and episode in flight: at 1,000 gateway sessions, 92 ms
    pauses, with nothing to collect (benchmarks/gateway.py). ``0``: Python's own collector."""
    gc_full_interval_s: float = 60.0
    """While training (with ``gc_young_interval_s``), a full collection this often: cyclic
    garbage among objects that outlived a young collection waits for it. ``0``: none."""
    save_samples: bool = False
    """Write every sequence each step trains to ``<output_dir>/samples-NNNNN.jsonl``, one JSON
    line each: its ids, loss mask, behaviour logprobs, per-token weight versions, reward,
    advantage, group and episode id (a gateway session's ``episode``, as ``POST
    /rl/sessions`` answers it) (docs/observability.md, "Trained
    samples"). Written off the event loop; a resume removes the lines of steps after its
    checkpoint, so each step is there once."""
    samples_file_mb: float = 256.0
    """With ``save_samples``: a samples file that has reached this many MiB gets no more steps
    (a step's lines stay in one file); the next step starts the next number."""
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """The controller's event loop under ``asyncrl run`` / ``asyncrl.launch`` (an embedding
    program runs its own). ``auto``: uvloop where it is installed (a dependency on Linux and
    macOS), else asyncio's. At 1,000 gateway sessions uvloop took the loop's lag p50 from 2.2
    to 0.8 ms and 10% more calls a second (docs/gateway.md)."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[run]``."""
        out = at_least_one({"run.num_steps": self.num_steps})
        if self.max_num_epochs < 0:
            out.append(fail("run.max_num_epochs", f"must be >= 0, got {self.max_num_epochs}",
                            "use 0 (no bound) or a number of passes over the train split"))  # fmt: skip
        for key in ("gc_young_interval_s", "gc_full_interval_s"):
            value = getattr(self, key)
            if not 0 <= value < float("inf"):
                out.append(fail(f"run.{key}", f"{value} is not a duration",
                                "give seconds >= 0 (0: Python's own collector / no full "
                                "collections)"))  # fmt: skip
        if self.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            out.append(fail("run.event_loop", "uvloop is not installed",
                            "pip install uvloop, or use 'auto' (asyncio's loop without it)"))  # fmt: skip
        if not 0 < self.samples_file_mb < float("inf"):
            out.append(fail("run.samples_file_mb", f"must be > 0, got {self.samples_file_mb}",
                            "give the size in MiB at which a samples file is closed, e.g. "
                            "256"))  # fmt: skip
        young, full = self.gc_young_interval_s, self.gc_full_interval_s
        if young and full and full < young:
            out.append(fail("run.gc_full_interval_s", f"{full} s is below gc_young_interval_s",
                            f"use e.g. 60 (at least {young:g}), or 0 for none"))  # fmt: skip
        return out

    def loop_options(self) -> dict[str, Any]:
        """``anyio.run``'s ``backend_options`` for :attr:`event_loop`."""
        uvloop = self.event_loop == "uvloop" or (
            self.event_loop == "auto" and importlib.util.find_spec("uvloop") is not None
        )
        return {"use_uvloop": uvloop}


class ModelConfig(Section):
    path: str
    """A Hugging Face causal-LM directory (``config.json``, weights, ``tokenizer.json``).
    Relative paths are resolved against the directory of the config file."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The generators' weight and compute dtype. The trainer keeps float32 master weights and
    computes in float32 (FSDP2's ``mixed_precision = "bf16"`` option computes in bf16), so by
    default the two sides differ by bf16 rounding: measured mean |logprob difference| 0.006-0.015
    on the demo, which the loss's importance weights correct and refit verification bounds.
    ``float32`` makes the generator match the trainer at a cost in speed and memory."""
    chat_template: str = "auto"
    """How prompts given as chat messages are rendered (in the controller, once, to the exact
    token ids the engine gets): ``"auto"`` uses the model directory's template
    (``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``'s
    ``chat_template``: a string, or the one named ``default``); a path to a
    ``.jinja`` file (relative to the config file) uses that one. Plain-text prompts are encoded
    as they are."""
    allow_moe_mismatch: bool = False
    """Train a mixture-of-experts model although its generator and trainer may route a token
    to different experts (docs/losses.md, "Mixture-of-experts models"): asyncrl does not
    replay the generator's routes in the trainer, so a MoE model is refused unless this is
    true."""

    def problems(self) -> list[ConfigError]:
        """What is missing from the model directory, and a MoE model not accepted (the
        config's only look at files)."""
        out: list[ConfigError] = []
        model_dir = Path(self.path)
        experts = moe_experts(model_dir / "config.json")
        if experts is not None and not self.allow_moe_mismatch:
            key, n = experts
            out.append(fail(
                "model.path",
                f"{model_dir} is a mixture of experts (config.json: {key} = {n}). Its generator "
                "and its trainer can route the same token to different experts (other kernels, "
                "other precisions, a tie broken otherwise), and asyncrl does not replay the "
                "generator's routes in the trainer, so the trainer would learn from routes the "
                "generator did not take (the trainer/generator mismatch grows; peers report "
                "runs that diverge)",
                "set model.allow_moe_mismatch = true to train it anyway, and watch the steps' "
                "mismatch_k3 and logprob_diff_max; loss.correction = \"token_mask\" with "
                "loss.proximal_policy = \"current\" masks the worst tokens",
            ))  # fmt: skip
        if not (model_dir / "config.json").is_file():
            out.append(
                fail(
                    "model.path",
                    f"{model_dir} is not a Hugging Face model directory (no config.json)",
                    "point model.path at a directory made by save_pretrained (for the tiny demo "
                    "run `python -m asyncrl_arith.make_model DIR` first)",
                )
            )
        if not (model_dir / "tokenizer.json").is_file():
            out.append(
                fail(
                    "model.path",
                    f"{model_dir} has no tokenizer.json (the controller tokenizes prompts with it)",
                    "save a fast tokenizer into the model directory (tokenizer.save_pretrained)",
                )
            )
        return out


class ClusterConfig(Section):
    trainer_ranks: int = 1
    """Training ranks (one torch.distributed group)."""
    rollout_ranks: int = 1
    """Generation ranks, one engine each."""
    startup_timeout_s: float = 600.0
    """How long workers may take to connect and report ready (engine start included)."""
    call_timeout_s: float = 900.0
    """Upper bound on any single RPC (a train chunk, a refit)."""
    shutdown_grace_s: float = 20.0
    """After asking workers to stop, wait this long before SIGTERM, and again before SIGKILL.
    A vLLM engine takes 5-10 s to close on a small CPU host; a worker that is leaving in order
    ignores the SIGTERM (it cannot turn a clean exit into a failure), so only a hung one is
    killed, after twice this."""
    torchrun: str = "torchrun"
    """The torchrun executable used when the controller spawns worker groups itself."""
    trainer_gpus: list[int] = []
    """GPU of each trainer rank, as indexes of the GPUs its node shows (``[0]``). Empty: rank
    r uses the GPU of its local rank."""
    rollout_gpus: list[int] = []
    """GPU of each rollout rank's engine (``[1]``: the engine on GPU 1, e.g. next to a trainer
    on GPU 0; ``[0]`` with ``trainer_gpus = [0]``: both share GPU 0). The engine still sees
    the node's other GPUs, after its own, so that it can map a trainer's CUDA IPC buffers.
    Empty: vLLM's default, the first visible GPU."""
    network: Literal["ipc", "tcp"] = "ipc"
    """How workers reach the controller's sockets (control, data) and trainer rank 0's
    weights socket. ``ipc``: Unix sockets in the run's 0700 directory (one host). ``tcp``:
    TCP on ``host``, ephemeral ports, every connection ZeroMQ CURVE with the run's keys
    (docs/multi-node.md); what ranks on other hosts need."""
    host: str = "127.0.0.1"
    """With ``network = "tcp"``: the address of the controller's node that the sockets bind
    to and the workers dial (its address on the cluster network for several nodes)."""
    keys_file: str = ""
    """With ``network = "tcp"``: the run's CURVE keys, a JSON file of mode 0600 every node
    can read (``python -m asyncrl.wire.curve FILE`` writes one). Empty: keys made for the run
    and handed to the workers in their environment (a launch: through torchrun's store)."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[cluster]``."""
        out = at_least_one({
            "cluster.trainer_ranks": self.trainer_ranks,
            "cluster.rollout_ranks": self.rollout_ranks,
        })  # fmt: skip
        for name, gpus, ranks in (
            ("trainer", self.trainer_gpus, self.trainer_ranks),
            ("rollout", self.rollout_gpus, self.rollout_ranks),
        ):
            if gpus and (len(gpus) != ranks or min(gpus) < 0):
                out.append(
                    fail(
                        f"cluster.{name}_gpus",
                        f"{gpus} must list one GPU index (>= 0) per {name} rank ({ranks})",
                        f"give {ranks} indexes, or leave it empty for the default placement",
                    )
                )
        if self.network == "tcp" and not self.host.strip():
            out.append(fail("cluster.host", "is empty", "give the controller node's address, "
                            "e.g. 127.0.0.1 on one host"))  # fmt: skip
        if self.keys_file and self.network != "tcp":
            out.append(fail("cluster.keys_file", "is set but cluster.network is 'ipc' (no "
                            "socket would use it)", "set cluster.network = \"tcp\", or leave "
                            "keys_file empty"))  # fmt: skip
        return out


class EnvironmentConfig(Section):
    name: str
    """Environment plugin (entry point group ``asyncrl.environments``)."""
    options: dict[str, Any] = {}
    """Environment-specific options, validated by the environment."""
    base_dir: str = ""
    """The directory relative paths in ``options`` are taken from (``""``: the config file's
    directory); given to a factory that takes a ``base_dir`` keyword."""

    def problems(self) -> list[ConfigError]:
        """None: the environment checks its own options (``asyncrl run``'s preflight)."""
        return []


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""``config.json`` keys that count a mixture-of-experts model's routed experts (Qwen2/3-MoE
and OLMoE; Mixtral; DeepSeek-V2/V3; others), at the top or in ``text_config``."""


def moe_experts(config_json: Path) -> tuple[str, int] | None:
    """``(key, experts)`` when ``config_json`` describes a mixture of experts (more than one
    routed expert), else ``None`` (also when the file is missing or unreadable: the other
    checks name that)."""
    try:
        data = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    for scope in (data, data.get("text_config") or {}) if isinstance(data, dict) else ():
        for key in MOE_KEYS:
            value = scope.get(key) if isinstance(scope, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return key, value
    return None
