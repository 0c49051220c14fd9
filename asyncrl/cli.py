"""The ``asyncrl`` command (also ``python -m asyncrl``).

::

    asyncrl run run.toml [--set key=value ...] [--resume [DIR|latest]] [--allow-changed F,...]
    asyncrl check-config run.toml [--set key=value ...]
    asyncrl plugins
    asyncrl export CHECKPOINT OUT [--force]
    asyncrl plot RUN_DIR [--out DIR]
    asyncrl jobs list|add|stop RUN [NAME] [--table FILE] [--set key=value ...]

``run`` starts a run on this node, as ``torchrun -m asyncrl.launch`` would with one process
per trainer and rollout rank: the config is checked first (exit 2 on a mistake, before
anything starts), the exit code is rank 0's (0, 1 for a failed run, 128 + N after signal N).
``kill -USR1`` on its pid saves a checkpoint at the next step boundary (passed on to rank 0).

``check-config`` loads and validates the config without starting anything: it prints the
resolved asynchrony mode in one line, the derived capacities, advice, and every broken
invariant with its fix; then it runs what ``asyncrl run`` checks before it starts a process
(the plugins load, the environment and the tokenizer load, the prompts fit, every plugin
accepts its options, and the memory plan fits the GPUs: ``--gpu-memory-gib G`` plans for GPUs
of G GiB; ``--config-only`` skips this). Exit codes: 0 valid, 2 invalid (as
``asyncrl.launch`` uses for a config mistake).

``plugins`` lists every installed plugin by entry-point group, with its distribution and
version, importing each: one that fails to import is listed with its error (exit 1 then).

``plot`` draws a run from its ``metrics.jsonl`` (:mod:`asyncrl.obs.plot`): reward and accuracy,
staleness, and a timeline of generation / training / refit (PNGs, and a Chrome trace for
Perfetto); it works on a run that is still going. Exit codes: 0 done, 2 nothing to draw.

``jobs`` changes the jobs of a running run of jobs (docs/jobs.md) from another shell: ``RUN``
is its config file or its ``run.output_dir``; ``list`` prints where each job stands, ``add``
starts job ``NAME`` (its table from ``--table FILE``, a TOML file written as under
``[jobs.<name>]``, and ``--set`` fields over it), ``stop`` stops one. Exit codes: 0 done, 1 the
run refused (its reason printed), 2 no run of jobs there or a mistake in the request.

``export`` writes the policy of a checkpoint (a ``step-*`` directory, or a directory of them:
its newest) as a Hugging Face model directory that transformers and vLLM load as they are,
once its copy matched the manifest's checksums file for file.
Exit codes: 0 done, 2 a checkpoint that cannot be exported or an existing OUT.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from asyncrl.errors import ConfigError, PluginError
from asyncrl.launch import add_resume_args

__all__ = ["main"]


def check_config(
    path: str, set_args: list[str], out: TextIO, *, config_only: bool = False,
    gpu_memory_gib: float | None = None,
) -> int:
    from asyncrl import config as cfgmod
    from asyncrl.config import parse_overrides
    from asyncrl.config.modes import describe

    try:
        overrides = parse_overrides(set_args)
        raw = cfgmod.load_unvalidated(path, overrides)
    except (ConfigError, PluginError) as exc:
        print(f"invalid: {exc}", file=out)
        return 2
    found = cfgmod.problems(raw)
    if found:
        print(f"{path}: {len(found)} problem{'s' * (len(found) > 1)}:", file=out)
        for exc in found:
            print(f"  - {exc}", file=out)
        return 2
    config = cfgmod.validate(raw)
    memory = None
    if not config_only:
        import anyio

        from asyncrl.run.preflight import check_before_spawn

        try:  # what `asyncrl run` checks before it starts a process
            checked = anyio.run(check_before_spawn, config)
        except (ConfigError, PluginError) as exc:
            print(f"invalid: {exc}", file=out)
            return 2
        memory = checked.memory
        if gpu_memory_gib is not None:  # the same sequences, on other GPUs
            shape = memory.shape
            memory = _memory_plan(config, gpu_memory_gib, shape.longest_sequence if shape else 0)
    report = describe(config)
    print(f"mode: {report.mode}", file=out)
    print("capacities:", file=out)
    width = max(len(k) for k in report.capacities)
    for key, value in report.capacities.items():
        print(f"  {key:<{width}}  {value}", file=out)
    if config.lora.enabled:
        print(_lora_line(config), file=out)
    for job in config.job_list.values():  # docs/jobs.md
        jc = job.config
        print(f"job {job.name}: {jc.environment.name}, {jc.run.num_steps} steps, seed "
              f"{jc.run.seed}, lr {job.lr:g}, weight {job.weight:g}, {jc.sampler.name} "
              f"(staleness <= {jc.sampler.max_staleness}); output {jc.run.output_dir}",
              file=out)  # fmt: skip
    if memory is not None:
        plan = memory
        for line in plan.lines():
            print(line, file=out)
        found = plan.problems()
        if found:
            print(f"{path}: {len(found)} problem{'s' * (len(found) > 1)}:", file=out)
            for exc in found:
                print(f"  - {exc}", file=out)
            return 2
    for line in report.advice:
        print(f"advice: {line}", file=out)
    print("ok: no invariant is broken" + (
        "" if config_only else "; the plugins, the environment, the tokenizer and every "
        "plugin's options are fine"), file=out)
    return 0


def _memory_plan(config: Any, gpu_memory_gib: float, longest_sequence: int) -> Any:
    """The run's memory plan on GPUs of ``gpu_memory_gib`` each (as many as the config places
    processes on); the preflight's is on this host's."""
    from asyncrl.procs.gpu_memory import GiB
    from asyncrl.run.preflight import memory_plan

    c = config.cluster
    count = 1 + max([*c.trainer_gpus, *c.rollout_gpus, c.trainer_ranks - 1, 0])
    return memory_plan(config, [int(gpu_memory_gib * GiB)] * count,
                       longest_sequence=longest_sequence)  # fmt: skip


def _lora_line(config: Any) -> str:
    """``[lora]``: the trainable parameters and the trainer memory they imply."""
    from asyncrl.config.adapters import MemoryEstimate
    from asyncrl.procs.space import model_size

    lora, model = config.lora, config.model
    try:
        targets = lora.targets(model.path)
    except ConfigError:  # no model_type to read: model.path is not the real model yet
        return f"lora: rank {lora.rank} (no model family in {model.path}/config.json)"
    head = f"lora: rank {lora.rank} on {', '.join(targets)}"
    size = model_size(model.path)
    estimate = MemoryEstimate.of(lora, model, size.elements if size else 0)
    if estimate is None:
        return f"{head} (sizes not readable from {model.path}; the trainer logs them at start)"
    return (
        f"{head}: {estimate.trainable_parameters:,} trainable parameters "
        f"({estimate.trainable_parameters / estimate.model_parameters:.2%} of "
        f"{estimate.model_parameters:,}); trainer weights and optimizer "
        f"{_size(estimate.base_bytes + estimate.adapter_bytes)} (base in {model.dtype} "
        f"{_size(estimate.base_bytes)} + adapter, gradient and AdamW moments "
        f"{_size(estimate.adapter_bytes)}) against {_size(estimate.full_bytes)} for full "
        "fine-tuning (16 bytes a parameter); activations come on top"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def list_plugins(out: TextIO) -> int:
    from asyncrl import registry

    broken = 0
    for group, kind in registry.GROUPS.items():
        print(f"{group} ({kind}s)", file=out)
        try:
            found = registry.available(group)
        except PluginError as exc:  # a name registered twice
            print(f"  BROKEN: {exc}", file=out)
            broken += 1
            continue
        if not found:
            print("  (none)", file=out)
        width = max((len(name) for name in found), default=0)
        for name, info in sorted(found.items()):
            line = f"  {name:<{width}}  {info.distribution} {info.version}  ({info.value})"
            try:
                registry.load(group, name)
            except PluginError as exc:
                line += f"\n  {' ' * width}  BROKEN: {str(exc).split(' failed to import: ')[-1]}"
                broken += 1
            print(line, file=out)
    if broken:
        print(f"{broken} plugin{'s' * (broken > 1)} cannot be used (see BROKEN above)", file=out)
    return 1 if broken else 0


def plot(run_dir: str, out: str | None, stream: TextIO) -> int:
    from asyncrl.obs.plot import plot_run

    try:
        result = plot_run(run_dir, out)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        return 2
    for path in [*result["pngs"], result["trace"]]:
        print(path, file=stream)
    print(
        f"training {result['training_s']:.1f} s; generation ran beside it "
        f"{result['overlap_s']:.1f} s ({result['overlap_frac']:.0%})",
        file=stream,
    )
    return 0


def export(spec: str, out: str, force: bool, stream: TextIO) -> int:
    import shutil
    from pathlib import Path

    from asyncrl.checkpoints import directory as ckpt

    try:
        checkpoint = ckpt.open_checkpoint(ckpt.resolve(spec, spec))
    except ckpt.CheckpointError as exc:
        print(f"asyncrl: error: {exc}", file=stream)
        return 2
    model = checkpoint.model_dir
    if model is None:
        print(
            f"asyncrl: error: checkpoint {checkpoint.path} holds no model (it was saved with "
            "checkpoint.save_model = false). Fix: resume from it with save_model = true and "
            "checkpoint.every_steps = 1 for one step, or export at the end of a run "
            "(export.at_end = true)",
            file=stream,
        )
        return 2
    dest = Path(out).expanduser().resolve()
    if dest.exists() and not force:
        print(f"asyncrl: error: {dest} exists. Fix: pick another OUT or pass --force", file=stream)
        return 2
    tmp = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model, tmp)
    try:  # what is handed out is what the save wrote, byte for byte, and finite
        checkpoint.verify_copy(ckpt.MODEL_DIR, tmp)
        _refuse_nonfinite(checkpoint.path, tmp)
    except ckpt.CheckpointError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"asyncrl: error: {exc}", file=stream)
        return 2
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    print(f"exported step {checkpoint.step} of {checkpoint.path} to {dest}")
    if (dest / "adapter_config.json").is_file():  # a [lora] run's: the adapter alone
        print(f"a LoRA adapter (PEFT); the merged model: python -m asyncrl_torch.merge {dest} "
              "MERGED_DIR")  # fmt: skip
    return 0


def _refuse_nonfinite(checkpoint: Any, model: Any) -> None:
    """A checkpoint whose model holds NaNs or infinities (one written before asyncrl refused to
    save such weights) is not exported."""
    from asyncrl.checkpoints import directory as ckpt
    from asyncrl.worker.export import nonfinite_tensors

    for path in sorted(model.glob("*.safetensors")):
        bad = nonfinite_tensors(path)
        if bad:
            name, count = next(iter(sorted(bad.items())))
            raise ckpt.CheckpointError(
                f"checkpoint {checkpoint} holds non-finite weights: {count} NaN or infinite "
                f"values in {name} ({path.name}; tensors affected: {len(bad)}). Fix: export an "
                "older checkpoint, from before the training diverged"
            )


def main(argv: list[str] | None = None) -> int:
    """Run one ``asyncrl`` command and return its exit code (see the module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plot":
        return plot(args.run_dir, args.out, sys.stdout)
    if args.command == "run":
        from asyncrl.one_node import self_launch

        return self_launch(args.config, args.set, args.resume, args.allow_changed)
    if args.command == "plugins":
        return list_plugins(sys.stdout)
    if args.command == "check-config":
        return check_config(args.config, args.set, sys.stdout, config_only=args.config_only,
                            gpu_memory_gib=args.gpu_memory_gib)  # fmt: skip
    if args.command == "export":
        return export(args.checkpoint, args.out, args.force, sys.stderr)
    if args.command == "jobs":
        return jobs(args.jobs_command, args.run, getattr(args, "name", ""),
                    getattr(args, "table", None), getattr(args, "set", []), sys.stdout)  # fmt: skip
    parser.error(f"unknown command {args.command!r}")
    return 2


def _parser() -> argparse.ArgumentParser:
    """The ``asyncrl`` parser, its commands added in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous GRPO post-training of LLMs. `asyncrl COMMAND --help` "
        "documents each command; docs/ has the rest (docs/troubleshooting.md for errors).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_plugins(sub)
    _add_check_config(sub)
    _add_export(sub)
    _add_plot(sub)
    _add_jobs(sub)
    return parser


def _add_run(sub: Any) -> None:
    """``asyncrl run CONFIG [--set ...] [--resume [DIR|latest]] [--allow-changed ...]``."""
    run = sub.add_parser(
        "run",
        help="start a run on this node (torchrun -m asyncrl.launch, one process per rank)",
        description="Check the config, then run torchrun in this process with "
        "cluster.trainer_ranks + cluster.rollout_ranks processes. Exit code: 0, 2 for a "
        "config or checkpoint mistake, 1 for a failed run, 128 + N after signal N. "
        "SIGUSR1 to this process (it passes it on to global rank 0, the controller) saves a "
        "checkpoint at the next step boundary; the run goes on.",
    )
    run.add_argument("config", help="the run's TOML file")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field, e.g. --set grpo.prompts_per_step=8")
    add_resume_args(run)


def _add_plugins(sub: Any) -> None:
    """``asyncrl plugins``."""
    sub.add_parser(
        "plugins",
        help="list the installed plugins by group, with distribution and version",
        description="Every entry point of the asyncrl.* groups, imported: one that fails to "
        "import is shown with its error, and the exit code is 1.",
    )


def _add_check_config(sub: Any) -> None:
    """``asyncrl check-config CONFIG [--set ...] [--config-only]``."""
    check = sub.add_parser(
        "check-config",
        help="validate a run config and print its mode, capacities and broken invariants",
        description="Validate CONFIG without starting anything: print the asynchrony mode it "
        "resolves to, the derived capacities, advice, and every broken invariant with its "
        "fix; then run what `asyncrl run` checks before it starts a process (the plugins "
        "load, the environment and its data, the tokenizer and chat template, the prompts "
        "fit the context, every plugin accepts its options). Exit code: 0 valid, 2 not.",
    )
    check.add_argument("config", help="the run's TOML file")
    check.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set grpo.prompts_per_step=8",
    )
    check.add_argument(
        "--config-only",
        action="store_true",
        help="check the file alone: skip loading the plugins, the environment's data and the "
        "tokenizer, and the plugins' checks of their options (what `asyncrl run` does before "
        "it starts anything)",
    )
    check.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="G",
        help="plan the run's memory for GPUs of G GiB each instead of this host's (planning "
        "on a machine without them)",
    )


def _add_export(sub: Any) -> None:
    """``asyncrl export CHECKPOINT OUT [--force]``."""
    exp = sub.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model directory",
        description="Copy the Hugging Face model saved in a checkpoint (safetensors, config, "
        "tokenizer) to OUT, ready for transformers' from_pretrained or vLLM.",
    )
    exp.add_argument("checkpoint", help="a step-* checkpoint directory, or the directory of them")
    exp.add_argument("out", help="the model directory to create")
    exp.add_argument("--force", action="store_true", help="replace OUT if it exists")


def _add_plot(sub: Any) -> None:
    """``asyncrl plot RUN_DIR [--out DIR]``."""
    drawing = sub.add_parser(
        "plot",
        help="draw a run: reward, staleness and a generation/training/refit timeline",
        description="Read RUN_DIR/metrics.jsonl and write reward.png, staleness.png, "
        "timeline.png (matplotlib: pip install 'asyncrl[plot]') and timeline.json (a Chrome "
        "trace: open it in https://ui.perfetto.dev).",
    )
    drawing.add_argument("run_dir", help="the run's output directory (run.output_dir)")
    drawing.add_argument("--out", help="where to write (default: RUN_DIR/plots)")


def _add_jobs(sub: Any) -> None:
    """``asyncrl jobs list|add|stop RUN [NAME] [--table FILE] [--set ...]``."""
    jobs_parser = sub.add_parser(
        "jobs",
        help="list, add or stop the jobs of a running run of jobs (docs/jobs.md)",
        description="Hand a request to the run of jobs whose config (or run.output_dir) is RUN "
        "and print its answer: where each job stands. Exit code: 0 done, 1 refused by the "
        "run, 2 no run of jobs there or a mistake in the request.",
    )
    commands = jobs_parser.add_subparsers(dest="jobs_command", required=True)
    ls = commands.add_parser("list", help="where each job stands")
    add = commands.add_parser("add", help="start a job in the running run")
    stop = commands.add_parser("stop", help="stop a job (its last checkpoint stands)")
    for p in (ls, add, stop):
        p.add_argument("run", help="the run's TOML file, or its run.output_dir")
    for p in (add, stop):
        p.add_argument("name", help="the job's name")
    add.add_argument("--table", metavar="FILE",
                     help="the job's table as a TOML file: its sections (environment, run, ...) "
                     "and keys (weight, lr), as under [jobs.<name>]")  # fmt: skip
    add.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a field of the job's table, e.g. --set run.seed=3")  # fmt: skip


def jobs(command: str, run: str, name: str, table_file: str | None, sets: list[str],
         out: TextIO) -> int:  # fmt: skip
    """``asyncrl jobs``: the request to the run in ``run`` (a config file or an output
    directory), its answer printed; the exit code."""
    import os
    import tomllib

    from asyncrl.config import load_config
    from asyncrl.config.jobs import resolve_paths
    from asyncrl.config.loading import apply_overrides, parse_overrides
    from asyncrl.run.jobs_inbox import JobRequest, ask

    try:
        output_dir = run if os.path.isdir(run) else load_config(run).run.output_dir
        table: dict[str, Any] = {}
        base = os.getcwd()
        if table_file:
            base = os.path.dirname(os.path.abspath(table_file))
            with open(table_file, "rb") as f:
                table = tomllib.load(f)
        apply_overrides(table, parse_overrides(sets))
        table = resolve_paths({name: table}, lambda p: os.path.join(base, p))[name]
        request = JobRequest(op=command, job=name, table=table)  # type: ignore[arg-type]
        answer = ask(output_dir, request)
    except (ConfigError, OSError, tomllib.TOMLDecodeError, TimeoutError) as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        return 2
    if not answer.ok:
        print(f"asyncrl: error: {answer.error}", file=sys.stderr)
        return 1
    for job in answer.jobs:
        where = f"step {job['step']} of {job['num_steps']}"
        why = f": {job['error']}" if job["error"] else ""
        print(f"{job['job']:<16} {job['state']:<9} {where:<18} weight {job['weight']:g}{why}",
              file=out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
