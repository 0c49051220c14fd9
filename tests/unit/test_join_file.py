"""The join file that an embedded controller writes for workers started elsewhere
(``asyncrl.join``): what a rank reads from it, and each way it is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.errors import ConfigError
from asyncrl.join import read_join_file, write_join_file
from asyncrl.procs.process import host_id
from asyncrl.wire.curve import KeysError, RunKeys


def test_what_the_controller_writes_a_rank_reads(tmp_path: Path) -> None:
    keys = RunKeys.generate()
    path = tmp_path / "sub" / "join.json"
    write_join_file(path, "tcp://10.0.0.5:4000", keys)
    assert path.stat().st_mode & 0o777 == 0o600
    assert os.listdir(path.parent) == ["join.json"]  # written whole: no temporary left
    control, pid, read = read_join_file(path, 1.0)
    assert (control, pid) == ("tcp://10.0.0.5:4000", os.getpid())
    assert read is not None and read.to_json() == keys.to_json()
    # ipc carries the keys too (every socket is CURVE); another key file named by the config
    # wins over the join file's
    write_join_file(path, "ipc:///tmp/x/control.sock", keys)
    assert read_join_file(path, 1.0)[2].to_json() == keys.to_json()
    write_join_file(path, "tcp://10.0.0.5:4000", keys)
    other = RunKeys.generate()
    other.write(str(tmp_path / "keys.json"))
    assert read_join_file(path, 1.0, str(tmp_path / "keys.json"))[2].to_json() == other.to_json()


def test_a_rank_waits_for_a_controller_that_starts_later(tmp_path: Path) -> None:
    path = tmp_path / "join.json"
    writer = threading.Timer(0.5, write_join_file, (path, "ipc:///tmp/x/c.sock",
                                                    RunKeys.generate()))
    writer.start()
    t0 = time.monotonic()
    assert read_join_file(path, 10.0)[0] == "ipc:///tmp/x/c.sock"
    assert 0.4 < time.monotonic() - t0 < 5  # waited for it, polling every 0.2 s
    writer.join()


def _record(path: Path, **changes: object) -> None:
    write_join_file(path, "tcp://10.0.0.5:4000", RunKeys.generate())
    data = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps(data))


def test_each_bad_join_file_is_refused_with_its_fix(tmp_path: Path) -> None:
    path = tmp_path / "join.json"
    with pytest.raises(ConfigError, match=r"no join file within 0.3 s .* Fix: start the contr"):
        read_join_file(path, 0.3)
    _record(path)
    path.chmod(0o644)
    loose = (r"a join file, which holds the run's keys, must be this user's with mode 0600, "
             rf"not 644. Fix: chmod 600 {path}")
    with pytest.raises(ConfigError, match=loose):
        read_join_file(path, 1.0)
    path.chmod(0o600)
    _record(path, version=99)
    with pytest.raises(ConfigError, match="not an asyncrl join file .*version 99"):
        read_join_file(path, 1.0)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not an asyncrl join file"):
        read_join_file(path, 1.0)
    _record(path, keys="{}")
    with pytest.raises(ConfigError, match="not an asyncrl key file"):
        read_join_file(path, 1.0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    _record(path, controller_pid=int(dead.stdout))
    with pytest.raises(ConfigError, match=r"its controller \(pid \d+\) is gone"):
        read_join_file(path, 1.0)


def test_a_controller_on_another_host_is_never_watched_by_pid(tmp_path: Path) -> None:
    path = tmp_path / "join.json"
    _record(path, controller_host="node0/" + host_id().split("/", 1)[1], controller_pid=1)
    assert read_join_file(path, 1.0)[1] == 0


def test_trainer_rank_0_binds_where_the_generators_reach_it() -> None:
    """``toward``: the controller's address when it is this host's (one node, as today), else
    this host's address on the route to it (checked in a network namespace of our own with
    10.98.0.1/24 on a veth pair: the controller at 10.98.0.7 is another node)."""
    from asyncrl.wire.transport import toward

    assert toward("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"
    assert toward("tcp://127.0.0.10:4000") == "tcp://127.0.0.10:*"  # the loopback's own
    script = (
        "ip link add v0 type veth peer name v1 && ip addr add 10.98.0.1/24 dev v0 && "
        "ip link set v0 up && ip link set v1 up && exec " + sys.executable + " -c "
        "'from asyncrl.wire.transport import toward; "
        "print(toward(\"tcp://10.98.0.7:*\"), toward(\"tcp://10.98.0.1:*\"))'"
    )
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "sh", "-c", script],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except OSError:
        pytest.skip("no unshare here")
    if done.returncode != 0 and "ip" in done.stderr:
        pytest.skip(f"no network namespace with a veth pair here: {done.stderr.strip()}")
    assert done.stdout.split() == ["tcp://10.98.0.1:*", "tcp://10.98.0.1:*"], done.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_join_file_or_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    """Mode 0600 is not enough: the file must be this user's (``check_private``), for the
    join file and the key file alike."""
    path, keys = tmp_path / "join.json", tmp_path / "keys.json"
    _record(path)
    RunKeys.generate().write(str(keys))
    for name in (path, keys):
        os.chown(name, 65534, 65534)
    with pytest.raises(ConfigError, match="must be this user's with mode 0600, not 600"):
        read_join_file(path, 1.0)
    with pytest.raises(KeysError, match="must be this user's with mode 0600, not 600"):
        RunKeys.read(str(keys))
