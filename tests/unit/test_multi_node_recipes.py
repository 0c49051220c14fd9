"""The multi-node recipes of ``examples/multi_node/``, checked without a cluster.

The sbatch script and the pod's script run for real, against stand-ins for ``scontrol``,
``srun``, ``getent``, ``ip``, ``asyncrl check-config`` and ``torchrun`` (each node's torchrun
records what it was given); what they hand ``asyncrl.launch`` then goes through asyncrl's own
config loader, and the manifests are read for what their comments promise. None of this shows
that the recipes work on a real Slurm or Kubernetes cluster (docs/multi-node.md, "Recipes").
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import Config, load_config, parse_overrides, to_dict
from asyncrl.data.dataset import make_environment
from asyncrl.errors import ConfigError
from asyncrl.wire.curve import KeysError, RunKeys

# model_dir: the fixture in conftest.py

ROOT = Path(__file__).parents[2]
HERE = ROOT / "examples" / "multi_node"
RUN_TOML = HERE / "run.toml"
SBATCH = HERE / "slurm.sbatch"
JOB_YAML = HERE / "k8s-job.yaml"
PVC_YAML = HERE / "k8s-pvc.yaml"

# Each node's torchrun: what it was given, the variables asyncrl and NCCL read, and whether
# asyncrl accepts the key file it names (read while the run would be going).
_TORCHRUN = """\
import json, os, stat, sys
from asyncrl.wire.curve import RunKeys
argv = sys.argv[1:]
keys = next((a.split("=", 1)[1] for a in argv if a.startswith("cluster.keys_file=")), "")
found = {"argv": argv, "cwd": os.getcwd(),
         "env": {k: os.environ.get(k) for k in (
             "ASYNCRL_NCCL_HOST", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}}
if os.path.exists(keys):
    found["keys_mode"] = stat.S_IMODE(os.stat(keys).st_mode)
    try:
        RunKeys.read(keys)
        found["keys_read"] = "ok"
    except Exception as exc:
        found["keys_read"] = str(exc)
node = os.environ.get("SLURM_NODEID") or os.environ["JOB_COMPLETION_INDEX"]
with open(os.path.join(os.environ["RECORD"], f"torchrun-{node}.json"), "w") as f:
    json.dump(found, f)
"""

# srun: the command once per node, in turn, each told its node id.
_SRUN = """\
#!/bin/bash
printf '%s\\n' "$@" > "$RECORD/srun"
while [ "$1" != bash ]; do shift; done
rc=0
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node "$@" || rc=$?
done
exit $rc
"""


def _stubs(tmp_path: Path) -> tuple[Path, Path]:
    """A directory of stand-in commands (first on PATH) and the directory they record in."""
    bindir, record = tmp_path / "bin", tmp_path / "record"
    bindir.mkdir()
    record.mkdir()
    scripts = {
        "python": f'#!/bin/sh\nexec "{sys.executable}" "$@"\n',
        "torchrun": f"#!{sys.executable}\n{_TORCHRUN}",
        "srun": _SRUN,
        "scontrol": "#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n",
        "asyncrl": '#!/bin/sh\nprintf \'%s\\n\' "$@" > "$RECORD/check-config"\n',
        # each node's address: $STUB_NET.<its node id> (getent ahostsv4 HOST; ip ... dev IF)
        "getent": '#!/bin/sh\necho "$STUB_NET.${SLURM_NODEID:-0}   STREAM $2"\n',
        "ip": '#!/bin/sh\necho "3: $6    inet $STUB_NET.$SLURM_NODEID/16 scope global $6"\n',
    }
    for name, text in scripts.items():
        path = bindir / name
        path.write_text(text)
        path.chmod(0o755)
    return bindir, record


def _environ(bindir: Path, record: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NCCL_", "GLOO_", "ASYNCRL_"))}  # fmt: skip
    for knob in ("RUN_CONFIG", "NET_IFNAME", "KEYS_DIR", "RDZV_PORT", "GPUS_PER_NODE"):
        env.pop(knob, None)
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", RECORD=str(record), **extra)
    return env


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def _load(path: Path, sets: list[str], model_dir: Path) -> Config:
    """``path`` with the recipe's ``--set`` overrides, through the loader ``asyncrl.launch``
    uses (an unknown key is a ``ConfigError``), on a stand-in model directory."""
    overrides = parse_overrides(sets)
    overrides["model.path"] = str(model_dir)
    return load_config(path, overrides)


# --------------------------------------------------------------------------- run.toml


def test_run_toml_is_the_gsm8k_recipe_on_two_nodes_over_tcp(model_dir: Path) -> None:
    config = _load(RUN_TOML, [], model_dir)
    c = config.cluster
    assert c.network == "tcp" and config.refit.transport == "nccl"
    assert (c.trainer_ranks, c.rollout_ranks) == (8, 8)
    assert c.trainer_gpus == c.rollout_gpus == list(range(8))  # rank r on its node's GPU r
    assert config.rollout_restarts == 0
    f = config.failures
    assert f.heartbeat_timeout_s >= 60 and f.collective_timeout() >= f.heartbeat_timeout_s
    # relative to the repository, which every node mounts at the same path
    assert Path(config.checkpoint.dir).is_relative_to(config.run.output_dir)
    assert Path(config.run.output_dir).is_relative_to(ROOT)
    # the one-node recipe's values, where the two do not differ on purpose
    one_node = to_dict(_load(ROOT / "examples/gsm8k_qwen/run.toml", [], model_dir))
    mine = to_dict(config)
    for section in ("grpo", "loss", "pipeline", "trainer", "generator", "eval", "episode"):
        assert mine[section] == one_node[section], section
    options = dict(mine["environment"]["options"])
    theirs = dict(one_node["environment"]["options"])
    assert [r["function"].split(":")[1] for r in options.pop("rewards")] == [
        r["function"].split(":")[1] for r in theirs.pop("rewards")
    ]
    assert options == theirs


def test_run_toml_reward_functions_import(tmp_path: Path, model_dir: Path) -> None:
    """The rewards are the GSM8K recipe's file, named by a path relative to run.toml."""
    config = _load(RUN_TOML, [], model_dir)
    rows = [{"question": "1 + 1?", "answer": "2"}, {"question": "2 + 2?", "answer": "4"}]
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = dict(config.environment.options)
    options.update(train=str(tmp_path / "train.jsonl"), eval=str(tmp_path / "test.jsonl"))
    make_environment(options, 0, base_dir=config.environment.base_dir)
    options["rewards"] = [{"function": "../gsm8k_qwen/no_such_file.py:correct"}]
    with pytest.raises(ConfigError, match="no_such_file"):
        make_environment(options, 0, base_dir=config.environment.base_dir)


def test_the_loader_refuses_an_unknown_set_key(model_dir: Path) -> None:
    """What the recipes' ``--set`` checks below rely on."""
    with pytest.raises(ConfigError, match="hots"):
        _load(RUN_TOML, ["cluster.hots=10.0.0.1"], model_dir)


# --------------------------------------------------------------------------- Slurm


def test_sbatch_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sbatch_directives_fit_the_config(model_dir: Path) -> None:
    directives: list[str] = []
    commands = 0
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            assert not commands, f"{line!r} comes after a command: sbatch would not read it"
            directives += line.split()[1:]
        elif line.strip() and not line.startswith("#"):
            commands += 1
    for wanted in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive"):
        assert wanted in directives
    nodes = int(next(d for d in directives if d.startswith("--nodes=")).split("=")[1])
    gpus = int(next(d for d in directives if d.startswith("--gpus-per-node=")).split("=")[1])
    c = _load(RUN_TOML, [], model_dir).cluster
    assert nodes * gpus == c.trainer_ranks + c.rollout_ranks


def _sbatch(tmp_path: Path, *args: str, **extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    bindir, record = _stubs(tmp_path)
    env = _environ(
        bindir, record, SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_CPUS_ON_NODE="4",
        KEYS_DIR=str(tmp_path / "keys"), **extra,
    )  # fmt: skip
    done = subprocess.run(
        ["bash", str(SBATCH), *args],
        check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, record


@pytest.mark.parametrize("ifname", ["", "ib0"])
def test_sbatch_script_starts_one_torchrun_per_node(
    tmp_path: Path, model_dir: Path, ifname: str
) -> None:
    done, record = _sbatch(tmp_path, "--resume", STUB_NET="10.0.0", NET_IFNAME=ifname)
    assert done.returncode == 0, done.stdout + done.stderr
    keys = tmp_path / "keys" / "4242.json"
    assert (record / "check-config").read_text().split() == [
        "check-config", str(RUN_TOML), "--set", f"cluster.keys_file={keys}",
    ]  # fmt: skip
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert not keys.exists()  # removed when the script ended
    srun = (record / "srun").read_text().split("\n")
    assert "--ntasks-per-node=1" in srun and "--cpus-per-task=4" in srun
    endpoints = set()
    for node in (0, 1):
        found = json.loads((record / f"torchrun-{node}.json").read_text())
        argv, addr = found["argv"], f"10.0.0.{node}"
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--nproc-per-node") == "8"
        assert _flag(argv, "--rdzv-backend") == "c10d" and _flag(argv, "--rdzv-id") == "4242"
        endpoints.add(_flag(argv, "--rdzv-endpoint"))
        assert f"is_host={1 if node == 0 else 0}" in _flag(argv, "--rdzv-conf").split(",")
        assert _flag(argv, "--local-addr") == addr and _flag(argv, "--max-restarts") == "0"
        assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == [
            "asyncrl.launch",
            str(RUN_TOML),
        ]
        assert argv[-1] == "--resume"  # the script's own arguments, passed on
        assert found["env"]["ASYNCRL_NCCL_HOST"] == addr
        assert (
            found["env"]["NCCL_SOCKET_IFNAME"]
            == found["env"]["GLOO_SOCKET_IFNAME"]
            == (ifname or None)
        )
        assert (found["keys_mode"], found["keys_read"]) == (0o600, "ok")
        config = _load(RUN_TOML, _sets(argv), model_dir)
        assert config.cluster.host == addr and config.cluster.keys_file == str(keys)
        assert config.cluster.network == "tcp"
    [endpoint] = endpoints  # the same on every node: the first node's, a port on it
    host, port = endpoint.rsplit(":", 1)
    assert host == "node-a" and 0 < int(port) < 65536


def test_sbatch_script_refuses_a_loopback_address(tmp_path: Path) -> None:
    done, record = _sbatch(tmp_path, STUB_NET="127.0.1")
    assert done.returncode != 0
    assert "NET_IFNAME" in done.stderr
    assert not list(record.glob("torchrun-*"))


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture
def manifests() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    docs = [*yaml.safe_load_all(JOB_YAML.read_text()), *yaml.safe_load_all(PVC_YAML.read_text())]
    return {d["kind"]: d for d in docs}


def _expand(value: str, env: dict[str, str]) -> str:
    """``$(NAME)`` replaced as Kubernetes does in a container's ``env`` values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], value)


def _container(manifests: dict[str, Any]) -> dict[str, Any]:
    [container] = manifests["Job"]["spec"]["template"]["spec"]["containers"]
    return container


def _mount(container: dict[str, Any], volume: str) -> str:
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)


def test_manifests_shape(manifests: dict[str, Any]) -> None:
    service, job, claim = manifests["Service"], manifests["Job"], manifests["PersistentVolumeClaim"]
    pod = job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert pod["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert pod["restartPolicy"] == "Never"
    container = _container(manifests)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["ASYNCRL_NCCL_HOST"]["value"] == "$(POD_IP)"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert _mount(container, "dshm") == "/dev/shm"
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volumes["keys"]["secret"]["secretName"] == "asyncrl-keys"
    header = JOB_YAML.read_text().split("apiVersion")[0]
    assert "python -m asyncrl.wire.curve keys.json" in header
    assert "kubectl create secret generic asyncrl-keys --from-file=keys.json" in header


def test_secret_mode_is_one_asyncrl_accepts(tmp_path: Path, manifests: dict[str, Any]) -> None:
    """The Secret's files have ``defaultMode`` and belong to root: the container runs as root,
    without an fsGroup (which would add the group's read bit: refused)."""
    pod = manifests["Job"]["spec"]["template"]["spec"]
    mode = next(v for v in pod["volumes"] if v["name"] == "keys")["secret"]["defaultMode"]
    assert mode == 0o400
    assert _container(manifests)["securityContext"]["runAsUser"] == 0
    assert "fsGroup" not in pod.get("securityContext", {})
    path = tmp_path / "keys.json"
    RunKeys.generate().write(str(path))
    path.chmod(mode)
    RunKeys.read(str(path))
    path.chmod(mode | 0o040)
    with pytest.raises(KeysError, match="chmod 600"):
        RunKeys.read(str(path))


def test_pod_script_starts_torchrun_for_its_index(
    tmp_path: Path, model_dir: Path, manifests: dict[str, Any]
) -> None:
    service, job = manifests["Service"], manifests["Job"]
    container = _container(manifests)
    assert container["command"] == ["bash", "-c"]
    [script] = container["args"]
    workdir = re.search(r"^cd (\S+)$", script, re.MULTILINE)
    assert workdir and workdir[1].startswith(_mount(container, "shared") + "/")
    # the repository in place of the shared volume's copy of it
    script = script.replace(f"cd {workdir[1]}", f"cd {ROOT}")
    bindir, record = _stubs(tmp_path)
    keys_dir = _mount(container, "keys")
    pod_ips = {0: "10.1.0.20", 1: "10.1.0.3"}  # the second pod's address sorts first
    local_addrs = {}
    for index, pod_ip in pod_ips.items():
        env = _environ(bindir, record, JOB_COMPLETION_INDEX=str(index), STUB_NET="10.1.0")
        for item in container["env"]:
            if "valueFrom" in item:
                env[item["name"]] = pod_ip  # status.podIP, checked above
            else:  # Kubernetes expands $(NAME) of the variables listed before it
                env[item["name"]] = _expand(item["value"], env)
        done = subprocess.run(
            ["bash", "-c", script], check=False, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        found = json.loads((record / f"torchrun-{index}.json").read_text())
        argv = found["argv"]
        assert _flag(argv, "--nnodes") == str(job["spec"]["parallelism"])
        assert _flag(argv, "--nproc-per-node") == str(
            container["resources"]["limits"]["nvidia.com/gpu"]
        )
        assert _flag(argv, "--rdzv-backend") == "c10d" and _flag(argv, "--max-restarts") == "0"
        name, domain = job["metadata"]["name"], service["metadata"]["name"]
        host, port = _flag(argv, "--rdzv-endpoint").rsplit(":", 1)
        assert host == f"{name}-0.{domain}"  # pod 0's DNS name
        assert int(port) in [p["port"] for p in service["spec"]["ports"]]
        assert f"is_host={1 if index == 0 else 0}" in _flag(argv, "--rdzv-conf").split(",")
        local_addrs[index] = _flag(argv, "--local-addr")
        assert local_addrs[index] == f"{name}-{index}.{domain}"
        assert found["env"]["ASYNCRL_NCCL_HOST"] == pod_ip
        assert found["env"]["NCCL_SOCKET_IFNAME"] == "eth0"
        assert argv[argv.index("-m") + 1] == "asyncrl.launch"
        config_path = Path(found["cwd"]) / argv[argv.index("-m") + 2]
        assert config_path.resolve() == RUN_TOML.resolve()
        config = _load(config_path, _sets(argv), model_dir)
        assert config.cluster.host == pod_ip and config.cluster.network == "tcp"
        assert config.cluster.keys_file == f"{keys_dir}/keys.json"  # the Secret's key
    # torch orders the nodes by --local-addr: pod 0 gets global rank 0, whatever the pod IPs
    assert min(local_addrs.values()) == local_addrs[0]
