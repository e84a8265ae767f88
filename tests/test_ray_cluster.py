"""Reaching Ray clusters (executors/ray_cluster.py), each run in its own `entoscope` process as a user runs it:

- an --address where no cluster answers (a closed port, a host that accepts and never answers, a server
  that is not gRPC) is one line with ray_unreachable within --connect-timeout-s, before the model loads;
- a cluster started with `ray start` is joined by --address, by RAY_ADDRESS, and found by itself (Ray's
  record of `ray start`), each giving the in-process table bit for bit;
- a driver that started its own local cluster and is killed with SIGKILL leaves no Ray process behind.

Each cluster here lives in its own Ray temp folder (RAY_TMPDIR), so no other cluster on the machine is
found or touched; every process the tests start is ended by its pid. Skipped where ray is missing; CI sets
ENTOSCOPE_REQUIRE_RAY=1 so that a missing ray fails instead."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from extras import require

require("ray")

from entoscope.cli import main  # noqa: E402

LENS = ["lens", "--data", "{task: ioi, n: 8, seed: 3}", "--sites", "{activation: resid_post, over: [layer]}", "--quiet"]
BOUND = 240  # seconds: a command that has not ended by then fails the test instead of hanging it


def _env(ray_tmp: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ENTOSCOPE_QUIET": "1", "OMP_NUM_THREADS": "1", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    return {**env, **extra}


def _entoscope(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entoscope.cli", *args], env=env, capture_output=True, text=True,
                          timeout=BOUND)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("entoscope: error:")]


@pytest.fixture
def ray_tmp():
    folder = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


class _Listener:
    """A port that accepts and then never answers ("silent") or answers HTTP/1.1 400 ("http")."""

    def __init__(self, mode: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))  # Ray dials this machine's address for 127.0.0.1: listen on both
        self.sock.listen(16)
        self.port, self.mode, self.held = self.sock.getsockname()[1], mode, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            if self.mode == "http":
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.mark.parametrize("mode, says", [("closed", "refused"), ("silent", "did not answer within 2 s"),
                                        ("http", "not a Ray cluster")])
def test_an_address_where_no_cluster_answers_is_refused_within_the_timeout(ray_tmp, tmp_path, mode, says):
    listener = None if mode == "closed" else _Listener(mode)
    port = _free_port() if listener is None else listener.port
    try:
        done = _entoscope([*LENS, "--executor", "ray", "--address", f"127.0.0.1:{port}", "--connect-timeout-s", "2",
                           "--out", str(tmp_path / "run")], _env(ray_tmp))
    finally:
        if listener is not None:
            listener.close()
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert "[ray_unreachable]" in errors[0] and says in errors[0] and f"127.0.0.1:{port}" in errors[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()
    assert not list(Path(ray_tmp).rglob("session_*")), "no local cluster may be started instead"


@pytest.fixture(scope="module")
def started_cluster():
    """A cluster started with `ray start --head --block` in its own Ray temp folder (ended with its process group)."""
    folder = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    port = _free_port()
    env = _env(folder)
    ray_cli = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                             "--disable-usage-stats", "--block"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    record = Path(folder) / "ray" / "ray_current_cluster"
    deadline = time.time() + 120
    while time.time() < deadline and not record.exists() and proc.poll() is None:
        time.sleep(0.2)
    assert record.exists(), "ray start did not start a cluster"
    yield {"port": port, "tmp": folder}
    # `ray start --block` ends the processes it started on its own SIGTERM (about 2 s); a SIGTERM to the whole
    # group ends its children first, and it then waits out its 30 s drain before it exits
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def in_process_table(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main([*LENS, "--out", str(out)]) == 0
    return pd.read_parquet(out / "table.parquet")


@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS", "ray start's record"])
def test_a_cluster_started_with_ray_start_is_joined_as_ray_users_expect(started_cluster, in_process_table, tmp_path,
                                                                        how):
    args, extra = [*LENS, "--executor", "ray", "--workers", "1", "--out", str(tmp_path / "run")], {}
    if how == "--address":
        args += ["--address", f"127.0.0.1:{started_cluster['port']}"]
    elif how == "RAY_ADDRESS":
        extra["RAY_ADDRESS"] = f"127.0.0.1:{started_cluster['port']}"
    done = _entoscope(args, _env(started_cluster["tmp"], **extra))
    assert done.returncode == 0, done.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / "table.parquet"), in_process_table,
                                  check_exact=True)
    sessions = list((Path(started_cluster["tmp"]) / "ray").glob("session_2*"))
    assert len(sessions) == 1, "the run joined the started cluster: it started no cluster of its own"


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (start time, command line) of every live descendant of `root` (Linux /proc)."""
    parent, info = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            parent[int(name)], info[int(name)] = int(fields[1]), (fields[19], cmd)
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                out[child] = info[child]
                todo.append(child)
    return out


def _alive(pid: int, start: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and fields[19] == start


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc (Linux)")
def test_a_driver_killed_with_sigkill_leaves_no_ray_process_behind(ray_tmp, tmp_path):
    out = tmp_path / "run"
    args = ["patch", "--data", "{task: ioi, n: 64}", "--sites", "{activation: resid_pre, over: [layer, position]}",
            "--executor", "ray", "--workers", "1", "--out", str(out), "--quiet"]
    driver = subprocess.Popen([sys.executable, "-m", "entoscope.cli", *args], env=_env(ray_tmp),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + BOUND
    while time.time() < deadline and not list((out / "shards").glob("main-*.parquet")) and driver.poll() is None:
        time.sleep(0.05)  # the cluster is up and its worker has finished a shard
    cluster = {pid: v for pid, v in _descendants(driver.pid).items() if "watchdog.py" not in v[1]}
    driver.kill()
    driver.wait()
    try:
        titles = [cmd for _, cmd in cluster.values()]
        assert any("gcs_server" in c for c in titles) and any(c.startswith("ray::") for c in titles), titles
        deadline = time.time() + 20  # the watchdog polls every 0.5 s; Ray's agents alone outlive it by a minute
        while time.time() < deadline and any(_alive(pid, start) for pid, (start, _) in cluster.items()):
            time.sleep(0.25)
        left = [cmd[:60] for pid, (start, cmd) in cluster.items() if _alive(pid, start)]
        assert not left, f"still running after the driver was killed: {left}"
    finally:
        for pid, (start, _) in cluster.items():  # whatever the outcome, nothing this test started lingers
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------- every address Ray accepts (issue 37.3)
@pytest.mark.parametrize("how", ["RAY_ADDRESS", "address"])
def test_local_starts_a_new_local_cluster_as_ray_documents(monkeypatch, how):
    """Ray's `local` means "start a new local cluster, even where one runs": no probe, no ray_unreachable, and
    ray.init is called with "local" (not None, which would join a `ray start` cluster). ray.init is replaced
    here, so no cluster starts."""
    import entoscope as es
    from entoscope.executors import ray_cluster

    calls = []
    monkeypatch.setattr(ray_cluster, "_init", lambda ray, address, timeout, **kw: calls.append((address, kw)))
    monkeypatch.setattr(ray_cluster, "start_watchdog", lambda: None)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("ray._private.services.find_bootstrap_address",
                        lambda *a: pytest.fail("`local` must not look for a running cluster"))
    monkeypatch.setenv("RAY_ADDRESS", "local" if how == "RAY_ADDRESS" else "auto")  # a given address wins
    executor = es.Ray(address="local") if how == "address" else es.Ray()
    assert ray_cluster.check_reachable(executor) is None
    _, started = ray_cluster.connect(executor)
    assert started and len(calls) == 1 and calls[0][0] == "local" and "num_cpus" in calls[0][1]


def test_other_ray_client_schemes_pass_through_and_http_is_refused(monkeypatch):
    """A `module://...` address is another Ray client (Ray imports the module): handed to ray.init unprobed;
    an http(s) address is refused in one line, as Ray refuses it."""
    import entoscope as es
    from entoscope.errors import ConfigError
    from entoscope.executors import ray_cluster

    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr(ray_cluster, "probe", lambda *a, **k: pytest.fail("not probed"))
    assert ray_cluster.check_reachable(es.Ray(address="anyscale://my-cluster")) == "anyscale://my-cluster"
    with pytest.raises(ConfigError) as err:
        ray_cluster.check_reachable(es.Ray(address="http://127.0.0.1:8265"))
    assert err.value.code == "ray_unreachable" and "6379" in str(err.value)


@pytest.mark.slow
def test_a_run_with_ray_address_local_starts_its_own_cluster(ray_tmp, in_process_table, tmp_path):
    """RAY_ADDRESS=local (CI jobs set it to keep runs apart) used to be refused as `not an address`: the run
    starts a local cluster in its own Ray temp folder and gives the in-process table bit for bit."""
    done = _entoscope([*LENS, "--executor", "ray", "--workers", "1", "--out", str(tmp_path / "run")],
                      _env(ray_tmp, RAY_ADDRESS="local"))
    assert done.returncode == 0, done.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / "table.parquet"), in_process_table,
                                  check_exact=True)
    assert list(Path(ray_tmp).rglob("session_2*")), "a local cluster was started in this run's Ray folder"
