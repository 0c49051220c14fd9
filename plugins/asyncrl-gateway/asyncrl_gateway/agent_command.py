"""The managed agent's command: what ``gateway.agent`` runs, from where, and the check that it
can run, made once before the run starts (``asyncrl run``'s preflight and ``asyncrl
check-config``), so a broken command is one config error rather than every session failing.

The rule (:func:`agent_command`): the agent runs in ``gateway.agent_dir`` (the config file's
directory by default); a first word ``python`` or ``python3`` is the run's own interpreter
(``sys.executable``); a first word with a ``/`` in it is a path from that directory; any
other first word is looked up on ``PATH``. Other arguments pass as written (relative paths
among them are found from the agent's directory, where it runs).

The check (:func:`check_agent`), within :data:`CHECK_S`:

* the program is found (and is an executable file);
* a Python agent (the interpreter is ``python`` or a file named ``python*``): its script, or
  its ``-m`` module, is found, it parses, and the modules it imports at its top level resolve
  in that interpreter (``importlib.util.find_spec`` in a ``python -c`` run in the agent's
  directory and environment; no code of the agent runs, but a ``-m`` module's packages'
  ``__init__``). Imports inside ``try`` or ``if`` are taken as optional and not checked;
* any other program: ``COMMAND --help`` exits 0 (``gateway.check_agent = false`` skips it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

import anyio
import anyio.to_thread

from asyncrl.plugin.common import config_error
from asyncrl_gateway.config import GatewayConfig

__all__ = ["CHECK_S", "agent_command", "agent_environment", "check_agent"]

CHECK_S = 30.0
"""Bound on the check's process (an interpreter start and a few module look-ups take ~0.1 s;
a loaded machine, or a program's ``--help``, longer)."""
TAIL_CHARS = 800
"""The end of a failed check's output, in the error."""

_PYTHON = re.compile(r"python[0-9.]*")
_PYTHON_FLAGS_WITH_VALUE = frozenset("WX")
"""Interpreter options whose value may be the next word (``-W error``, ``-X dev``)."""

# Runs in the agent's interpreter: sys.argv[1:] = kind ("script", "module", "code"), target.
_PROBE = r"""
import ast, importlib.util, os, sys
kind, target = sys.argv[1], sys.argv[2]
def fail(message):
    print(message)
    sys.exit(1)
try:
    if kind == "module":
        spec = importlib.util.find_spec(target)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(target + ".__main__")  # what -m runs
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            fail(f"No module named {target!r} (from {os.getcwd()})")
        target = spec.origin
    if kind == "code":
        source = target
    else:
        if kind == "script":  # as `python script` has it (-m and -c keep the directory)
            sys.path[0] = os.path.dirname(os.path.abspath(target))
        with open(target, "rb") as f:
            source = f.read()
    tree = ast.parse(source, "<string>" if kind == "code" else target)
except SyntaxError as exc:
    fail(f"SyntaxError: {exc}")
except Exception as exc:
    fail(f"{type(exc).__name__}: {exc}")
missing = []
for node in tree.body:  # the top level only: an import in a try or an if may be optional
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
        names = [node.module]
    else:
        continue
    for name in names:
        top = name.partition(".")[0]
        try:
            found = top == "__future__" or importlib.util.find_spec(top) is not None
        except Exception:
            found = False
        if not found and top not in missing:
            missing.append(top)
if missing:
    fail("No module named " + ", ".join(repr(m) for m in missing))
"""


def agent_command(command: Sequence[str], directory: str) -> list[str]:
    """``gateway.agent`` as it is run from ``directory`` (the module docstring's rule)."""
    program, *args = command
    if program in ("python", "python3"):
        program = sys.executable
    elif "/" in program:
        program = os.path.join(directory, os.path.expanduser(program))  # absolute: kept
    return [program, *args]


def agent_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment a managed agent starts from (before its session's variables)."""
    return {**os.environ, **extra}


async def check_agent(config: GatewayConfig) -> None:
    """Check the managed agent's command (the module docstring's check); nothing when
    ``gateway.agent`` is empty.

    Cancellation: returns once the check's process (bounded by :data:`CHECK_S`) is over.

    Raises:
        ConfigError: ``gateway.agent`` (or ``gateway.agent_dir``) naming the problem and the
            fix.
    """
    if not config.agent:
        return
    problem = await anyio.to_thread.run_sync(_problem, config)
    if problem is not None:
        field, what, fix = problem
        raise config_error(field, what, fix)


def _problem(config: GatewayConfig) -> tuple[str, str, str] | None:
    """``(field, problem, fix)``, or ``None`` when the command looks runnable (blocking)."""
    directory = config.agent_dir
    if not os.path.isdir(directory):
        return ("gateway.agent_dir", f"{directory} is not a directory",
                "create it, or point gateway.agent_dir at the agent's directory (by default "
                "the config file's)")  # fmt: skip
    argv = agent_command(config.agent, directory)
    env = agent_environment(config.agent_env)
    program = argv[0]
    if "/" in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            return ("gateway.agent", f"the program {program} is not an executable file",
                    "give a path from gateway.agent_dir (by default the config file's "
                    "directory), a program on PATH, or \"python\" for the run's "
                    "interpreter")  # fmt: skip
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        return ("gateway.agent", f"the program {program!r} is not found on PATH",
                "give a program on PATH, a path to one (./ for the config file's "
                "directory), or \"python\" for the run's interpreter")  # fmt: skip
    if not config.check_agent:
        return None
    if _PYTHON.fullmatch(os.path.basename(program)):
        return _python_problem(argv, directory, env)
    code, output = _run([*argv, "--help"], directory, env)
    if code == 0:
        return None
    ran = " ".join([*config.agent, "--help"])
    what = f"did not exit within {CHECK_S:g} s" if code is None else f"exited with code {code}"
    return ("gateway.agent", f"`{ran}` (run in {directory} to check the agent) {what}"
            f"{_tail(output)}", "make the command run from there and answer --help with exit "
            "code 0, or set gateway.check_agent = false to skip this check")  # fmt: skip


def _python_problem(
    argv: list[str], directory: str, env: dict[str, str]
) -> tuple[str, str, str] | None:
    """A Python agent's script (or module, or ``-c`` code) found, parsed and its imports
    resolved in its interpreter."""
    program, options, kind, target = argv[0], [], "", ""
    words = iter(argv[1:])
    for word in words:
        if word in ("-m", "-c") or (word[:2] in ("-m", "-c") and len(word) > 2):
            kind = "module" if word[1] == "m" else "code"
            target = word[2:] or next(words, "")
            break
        if word == "-" or not word.startswith("-"):
            kind, target = ("script", word) if word != "-" else ("", "")
            break
        options.append(word)
        if word[1:] in _PYTHON_FLAGS_WITH_VALUE:
            options.append(next(words, ""))
    if kind == "script":
        path = os.path.join(directory, target)
        if not os.path.isfile(path):
            return ("gateway.agent", f"the agent's script {target!r} is not in {directory} "
                    "(the agent runs there)", "put it there, give its path from there, or "
                    "set gateway.agent_dir to its directory (by default the config "
                    "file's)")  # fmt: skip
        target = path
    if not kind:  # a script on stdin: only the interpreter can be checked
        kind, target = "code", "pass"
    code, output = _run([program, *options, "-c", _PROBE, kind, target], directory, env)
    if code == 0:
        return None
    what = f"did not finish the check within {CHECK_S:g} s" if code is None else (
        "cannot run the agent")
    return ("gateway.agent", f"{program} {what} (checked in {directory}){_tail(output)}",
            f"install what it needs in that interpreter's environment ({program} -m pip "
            "install ...), or name the interpreter that has it (\"python\": the run's own, "
            f"{sys.executable})")  # fmt: skip


def _run(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[int | None, str]:
    """Run ``argv`` (stdin empty, in a session of its own) for at most :data:`CHECK_S`;
    ``(exit code or None past the bound, its output)``. Whatever it started is killed with
    its process group."""
    with tempfile.TemporaryFile() as out:
        try:
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip
        except OSError as exc:
            return 127, f"{type(exc).__name__}: {exc}"
        try:
            code: int | None = process.wait(CHECK_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        out.seek(0)
        return code, out.read().decode("utf-8", "replace")


def _tail(output: str) -> str:
    output = output.strip()
    if not output:
        return ""
    if len(output) > TAIL_CHARS:
        output = "..." + output[-TAIL_CHARS:]
    return f": {output}"
