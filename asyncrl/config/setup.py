"""``[run]``, ``[model]``, ``[cluster]`` and ``[environment]``: what runs, where, on what.

Each section's checks sit with it (``problems()``); :func:`asyncrl.config.problems` gathers
every section's.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any, Literal

from asyncrl.config.section import Section, at_least_one, fail
from asyncrl.errors import ConfigError

__all__ = ["ClusterConfig", "EnvironmentConfig", "ModelConfig", "RunConfig"]


class RunConfig(Section):
    name: str = "asyncrl"
    """A label for logs and the metrics file. Set it to tell runs apart in the logs and the
    metrics sinks."""
    output_dir: str = "runs/asyncrl"
    """Where metrics (``metrics.jsonl``), worker logs and the trained samples
    (``save_samples``) go. Relative paths are resolved against the directory of the config
    file. Give each run its own (a live run holds its directory: a second one is refused)."""
    seed: int = 0
    """Seed for the dataloader order, sampling seeds and trainer initialisation. Change it for
    another draw of the same run (a seed sweep)."""
    num_steps: int = 10
    """Number of optimizer steps (= weight versions) to train. Set it to the training length;
    raise it to train on from a finished run's checkpoint (``--resume``)."""
    max_num_epochs: int = 0
    """Also end the run after this many passes over the train split (each pass its size //
    ``grpo.prompts_per_step`` steps; the run stops at whichever bound comes first). 0: no
    bound. Set it to stop after a number of passes over a small train split."""
    log_format: Literal["auto", "console", "json"] = "auto"
    """Log rendering when asyncrl configures logging itself (CLI and workers): ``auto`` is
    ``console`` on a terminal, else ``json``. Set ``json`` for a log collector, ``console``
    to read the logs of a run that is not on a terminal."""
    save_samples: bool = False
    """Write every sequence each step trains to ``<output_dir>/samples-NNNNN.jsonl``, one JSON
    line each: its ids, loss mask, behaviour logprobs, per-token weight versions, reward,
    advantage, group and episode id (a gateway session's ``episode``, as ``POST
    /rl/sessions`` answers it) (docs/observability.md, "Trained
    samples"). Written off the event loop; a resume removes the lines of steps after its
    checkpoint, so each step is there once. Turn it on to inspect or reuse what was trained
    (files of up to 256 MiB each: ``asyncrl.obs.sample_export.SAMPLES_FILE_MB``)."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[run]``."""
        out = at_least_one({"run.num_steps": self.num_steps})
        if self.max_num_epochs < 0:
            out.append(fail("run.max_num_epochs", f"must be >= 0, got {self.max_num_epochs}",
                            "use 0 (no bound) or a number of passes over the train split"))  # fmt: skip
        return out


class ModelConfig(Section):
    path: str
    """A Hugging Face causal-LM directory (``config.json``, weights, ``tokenizer.json``), or
    its Hugging Face Hub id (``"Qwen/Qwen2.5-1.5B-Instruct"``), found in the local Hugging Face
    cache (``HF_HOME``; fetch it first with ``hf download ID``; docs/models.md). Relative paths
    are resolved against the directory of the config file; a relative path that is no directory
    there and reads as an id is taken for one. Always set: the model to train."""
    revision: str = ""
    """With a Hub id in ``path``: the branch, tag or commit to use (``""``: ``main``). Loading
    replaces the id by its snapshot directory, which names the commit, so a resumed run uses
    the same files. Set it to pin a model's version."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The generators' weight and compute dtype. The trainer keeps float32 master weights and
    computes in float32 (FSDP2's ``mixed_precision = "bf16"`` option computes in bf16), so by
    default the two sides differ by bf16 rounding: measured mean |logprob difference| 0.006-0.015
    on the demo, which the loss's importance weights correct and refit verification bounds.
    ``float32`` makes the generator match the trainer at a cost in speed and memory. Set
    ``float32`` when that mismatch matters more than speed (a small model, a debugging run)."""
    chat_template: str = "auto"
    """How prompts given as chat messages are rendered (in the controller, once, to the exact
    token ids the engine gets): ``"auto"`` uses the model directory's template
    (``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``'s
    ``chat_template``: a string, or the one named ``default``); a path to a
    ``.jinja`` file (relative to the config file) uses that one. Plain-text prompts are encoded
    as they are. Point it at a ``.jinja`` file when the model directory has no template or not
    the one to train with."""
    allow_moe_mismatch: bool = False
    """Train a mixture-of-experts model although its generator and trainer may route a token
    to different experts (docs/losses.md, "Mixture-of-experts models"): asyncrl does not
    replay the generator's routes in the trainer, so a MoE model is refused unless this is
    true. Set it to train a MoE model anyway, watching the steps' ``mismatch_k3``."""

    @property
    def itemsize(self) -> int:
        """Bytes of one weight in ``dtype``: what the memory estimates count a parameter as."""
        return 2 if self.dtype == "bfloat16" else 4

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
    """Training ranks (one torch.distributed group). Raise it to train on several GPUs (the
    backend shards the model over them)."""
    rollout_ranks: int = 1
    """Generation ranks, one engine each. Raise it for more generation throughput."""
    startup_timeout_s: float = 600.0
    """How long workers may take to connect and report ready (engine start included). Raise it
    for a large model or a slow disk whose engine takes longer to load."""
    call_timeout_s: float = 900.0
    """Upper bound on any single RPC (a train chunk, a refit). Raise it when one train chunk or
    refit of a large model legitimately takes longer."""
    shutdown_grace_s: float = 20.0
    """After asking workers to stop, wait this long before SIGTERM, and again before SIGKILL.
    A vLLM engine takes 5-10 s to close on a small CPU host; a worker that is leaving in order
    ignores the SIGTERM (it cannot turn a clean exit into a failure), so only a hung one is
    killed, after twice this. Raise it for engines that take longer to close in order."""
    trainer_gpus: list[int] = []
    """GPU of each trainer rank, as indexes of the GPUs its node shows (``[0]``). Empty: rank
    r uses the GPU of its local rank. Set it to place the trainer on particular GPUs (a node
    shared with other jobs)."""
    rollout_gpus: list[int] = []
    """GPU of each rollout rank's engine (``[1]``: the engine on GPU 1, e.g. next to a trainer
    on GPU 0; ``[0]`` with ``trainer_gpus = [0]``: both share GPU 0). The engine still sees
    the node's other GPUs, after its own, so that it can map a trainer's CUDA IPC buffers.
    Empty: vLLM's default, the first visible GPU. Set it to place each engine on a GPU of your
    choice."""
    placement: Literal["resident", "take_turns"] = "resident"
    """How a trainer rank and an engine on the same GPU share it. ``resident``: both stay
    loaded side by side, the memory split between them (``generator.options.
    gpu_memory_utilization``), generation and training overlapping as the mode allows.
    ``take_turns``: the engine sleeps (its KV cache and weights released) while the trainer
    steps, and the refit wakes it with the new weights; while the engine generates, the
    trainer's optimizer state waits in host memory (``trainer_offload``). Set ``take_turns``
    on one GPU when trainer and engine do not both fit, or to give each the whole GPU in its
    turn (docs/one-gpu.md)."""
    trainer_offload: Literal["auto", "always", "never"] = "auto"
    """With ``placement = "take_turns"``: whether the trainer's optimizer state goes to host
    memory (and its gradients are freed) while the engine generates. ``auto``: when the memory
    plan says the trainer's whole state and the engine's share do not fit on the GPU together
    (never without a plan: no GPU to plan for). Set ``always`` or ``never`` to decide
    yourself."""
    network: Literal["ipc", "tcp"] = "ipc"
    """How workers reach the controller's sockets (control, data) and trainer rank 0's
    weights socket. ``ipc``: Unix sockets in the run's 0700 directory (one host). ``tcp``:
    TCP on ``host``, ephemeral ports, every connection ZeroMQ CURVE with the run's keys
    (docs/multi-node.md); what ranks on other hosts need. Set ``tcp`` when ranks run on more
    than one host."""
    host: str = "127.0.0.1"
    """With ``network = "tcp"``: the address of the controller's node that the sockets bind
    to and the workers dial (its address on the cluster network for several nodes). Set it to
    that address when ranks run on other hosts."""
    keys_file: str = ""
    """With ``network = "tcp"``: the run's CURVE keys, a JSON file of mode 0600 every node
    can read (``python -m asyncrl.wire.curve FILE`` writes one). Empty: keys made for the run
    and handed to the workers in their environment (a launch: through torchrun's store). Set it
    when others can reach torchrun's rendezvous port (its store has no authentication;
    docs/multi-node.md)."""

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
        if self.placement == "take_turns":
            out += self._turn_problems()
        elif self.trainer_offload != "auto":
            out.append(fail("cluster.trainer_offload", f"is {self.trainer_offload!r}, but only "
                            "placement = \"take_turns\" offloads the trainer's state",
                            "set cluster.placement = \"take_turns\", or remove it"))  # fmt: skip
        if self.network == "tcp" and not self.host.strip():
            out.append(fail("cluster.host", "is empty", "give the controller node's address, "
                            "e.g. 127.0.0.1 on one host"))  # fmt: skip
        if self.keys_file and self.network != "tcp":
            out.append(fail("cluster.keys_file", "is set but cluster.network is 'ipc' (no "
                            "socket would use it)", "set cluster.network = \"tcp\", or leave "
                            "keys_file empty"))  # fmt: skip
        return out


    def _turn_problems(self) -> list[ConfigError]:
        """``placement = "take_turns"``: every engine shares a GPU with a trainer rank, on one
        host."""
        out = []
        if self.network == "tcp":
            out.append(fail("cluster.placement", "take_turns runs on one host, and "
                            "cluster.network = \"tcp\" is for ranks on several",
                            "use placement = \"resident\" across hosts"))  # fmt: skip
        trainer_gpus = self.trainer_gpus or list(range(self.trainer_ranks))
        rollout_gpus = self.rollout_gpus or [0] * self.rollout_ranks
        alone = sorted({g for g in rollout_gpus if g not in trainer_gpus})
        if alone:
            out.append(fail(
                "cluster.placement", f"take_turns, but the engines on GPU(s) {alone} share "
                "them with no trainer rank: there is nobody to take turns with",
                "put each engine on a trainer rank's GPU (cluster.rollout_gpus), or use "
                "placement = \"resident\"",
            ))  # fmt: skip
        return out


class EnvironmentConfig(Section):
    name: str
    """Environment plugin (entry point group ``asyncrl.environments``). Always set: the task to
    train on."""
    options: dict[str, Any] = {}
    """Environment-specific options, validated by the environment. Set what the environment
    documents (data files, reward functions...)."""
    base_dir: str = ""
    """The directory relative paths in ``options`` are taken from (``""``: the config file's
    directory); given to a factory that takes a ``base_dir`` keyword. Set it only when those
    paths are relative to another directory (an embedding program's data)."""

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
