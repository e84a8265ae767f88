"""Reaching a Ray cluster, in bounded time, the way Ray users expect.

Which cluster a run uses (es.Ray(address=...), `--address`):

    address given ("host:port", "auto", "ray://host:10001")    that cluster
    no address, RAY_ADDRESS set (as on Ray's cluster nodes)      the cluster it names
    no address, a cluster started here with `ray start`          that one (Ray's record of it: the file
                                                                 ray_current_cluster in Ray's temp folder)
    none of these                                                a local cluster started by this driver
    "local" (as address or RAY_ADDRESS)                         a new local cluster started by this driver,
                                                                 even where one runs already (as ray.init)

Other "scheme://..." addresses name a Ray client other than ray:// (Ray imports the module the scheme
names): they are passed to ray.init as they are, unprobed; http(s):// addresses are refused, as by Ray.

An existing cluster is joined as it is (no num_cpus: Ray refuses resources for a cluster it did not
start). Before joining, its address is probed within `connect_timeout_s` (default 30 s): a TCP
connection, then the HTTP/2 preface Ray's gRPC servers answer at once. A refused port, a host that
accepts and never answers, and a server that is not gRPC are refused (`ray_unreachable`) within that
time, where `ray.init` alone would retry for minutes. (With RAY_USE_TLS the protocol check is skipped.)

A local cluster started here has no dashboard, and a watchdog process (executors/watchdog.py, Linux)
ties its processes to the driver's pid: when the driver dies, even by SIGKILL, the watchdog kills what
is left (Ray's agents would otherwise linger for a minute or more).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from ..errors import ConfigError

# the HTTP/2 client preface and an empty SETTINGS frame; a gRPC server answers with its SETTINGS frame
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS = 0x04

_WATCHDOG: subprocess.Popen | None = None


def unreachable(address: str, why: str, timeout: float) -> ConfigError:
    return ConfigError(f"cannot reach a Ray cluster at {address!r}: {why}", code="ray_unreachable",
                       remedy=f"start it (ray start --head) and pass its address, raise connect_timeout_s "
                       f"(now {timeout:g} s) for a slow network, or give address local (or RAY_ADDRESS=local) "
                       "to start a local cluster")


def probe(host: str, port: int, timeout: float, check_protocol: bool = True) -> str:
    """'' if a gRPC server answers at host:port within `timeout` seconds, else what happened."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return "the connection was refused (no cluster listens on that port)"
    except TimeoutError:
        return f"no answer to connecting within {timeout:g} s"
    except OSError as err:
        return f"{err.strerror or err}"
    with sock:
        if not check_protocol:
            return ""
        try:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(_PREFACE)
            head = sock.recv(9)
        except TimeoutError:
            return f"it accepted the connection but did not answer within {timeout:g} s (not a Ray cluster?)"
        except OSError as err:
            return f"the connection broke ({err.strerror or err})"
    if len(head) < 9 or head[3] != _SETTINGS:
        return "something answers there, but it is not a Ray cluster (no gRPC)"
    return ""


def _split(address: str) -> tuple[str, int] | None:
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


LOCAL = "local"  # Ray's address for "start a new local cluster"


def existing_cluster(address: str | None) -> str | None:
    """The address of the cluster to join (see the module docstring), or None for a new local one."""
    if address is not None:
        return None if address == LOCAL else address
    if os.environ.get("RAY_ADDRESS"):
        return None if os.environ["RAY_ADDRESS"] == LOCAL else os.environ["RAY_ADDRESS"]
    try:  # what `ray start` recorded on this machine (ray.init() looks there too)
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - a private helper of Ray's: without it, no autodetection
        return None


def dial_address(address: str) -> str:
    """host:port that ray.init will dial for `address` ("auto" resolved, localhost as Ray rewrites it)."""
    if address.startswith("ray://"):
        return address[len("ray://"):]
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(address) or address


def check_reachable(executor: Any) -> str | None:
    """Before any work: the address of the existing cluster the run will join, probed (ray_unreachable if it
    does not answer within connect_timeout_s); None when a local cluster will be started (or this process
    has joined one already)."""
    from .ray_pool import require_ray

    ray = require_ray()
    if ray.is_initialized():
        return None
    timeout = executor.connect_timeout_s
    address = existing_cluster(executor.address)
    if address is None:
        return None
    scheme = address.split("://", 1)[0] if "://" in address else "ray"
    if scheme in ("http", "https"):
        raise unreachable(address, "an HTTP address (the dashboard's?) is not a cluster address: give the GCS "
                          "address, host:6379", timeout)
    if scheme != "ray":
        return address  # another Ray client (the scheme names its module): ray.init dials it
    try:
        target = dial_address(address)
    except (ConnectionError, ValueError) as err:  # "auto" with no cluster running, a malformed address
        raise unreachable(address, " ".join(str(err).split())[:200], timeout) from None
    parts = _split(target)
    if parts is None:
        raise unreachable(address, "not an address (host:port, auto or ray://host:port)", timeout)
    tls = os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")
    problem = probe(*parts, timeout, check_protocol=not tls)
    if problem:
        raise unreachable(address, problem, timeout)
    return address


def connect(executor: Any) -> tuple[Any, bool]:
    """(ray, whether this driver started the cluster): join the cluster the executor names, or start one."""
    from .ray_pool import require_ray

    ray = require_ray()
    if ray.is_initialized():
        return ray, False
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    address = check_reachable(executor)
    if address is None:
        cpus = max(os.cpu_count() or 1, int(executor.workers * executor.cpus()))
        # "local", not None: ray.init(None) would join a cluster `ray start` left running here
        _init(ray, LOCAL, executor.connect_timeout_s, num_cpus=cpus, include_dashboard=False, **kwargs)
        start_watchdog()
        return ray, True
    _use_local_token()
    _init(ray, address, executor.connect_timeout_s, **kwargs)
    return ray, False


def _use_local_token() -> None:
    """Use this machine's Ray token (~/.ray/auth_token, RAY_AUTH_TOKEN) for a cluster named by its address, as
    ray.init() does for one it finds itself (Ray clusters use token authentication by default; a cluster
    without it accepts a client that sends one). RAY_AUTH_MODE, where set, decides instead."""
    with contextlib.suppress(Exception):  # a private helper of Ray's; without it, Ray's own rules apply
        from ray._private.authentication import authentication_token_setup as auth

        quiet = logging.getLogger(auth.__name__)
        level, quiet.level = quiet.level, logging.ERROR
        try:
            auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        finally:
            quiet.level = level


def _init(ray: Any, address: str | None, timeout: float, **kwargs: Any) -> None:
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError, SystemExit) as err:
        why = " ".join(str(err).split())[:200] or type(err).__name__
        if address not in (None, LOCAL):  # it answered the probe: most often a token the cluster does not accept
            why += ("; a cluster with token authentication (Ray's default) needs its token here: ~/.ray/auth_token "
                    "or RAY_AUTH_TOKEN, with RAY_AUTH_MODE=token")
        raise unreachable(str(address), why, timeout) from None


def start_watchdog() -> None:
    """Tie the local cluster's processes to this driver (Linux: /proc); see executors/watchdog.py."""
    global _WATCHDOG
    if not os.path.isdir("/proc/self") or (_WATCHDOG is not None and _WATCHDOG.poll() is None):
        return
    import ray

    ray_dir = os.path.dirname(os.path.abspath(ray.__file__))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")  # run as a file: no imports
    with contextlib.suppress(OSError):
        _WATCHDOG = subprocess.Popen([sys.executable, script, str(os.getpid()), ray_dir],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True)


def stop_watchdog() -> None:
    """The cluster was shut down by the driver itself: the watchdog has nothing left to guard."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        with contextlib.suppress(OSError):
            _WATCHDOG.kill()
            _WATCHDOG.wait(timeout=5)
        _WATCHDOG = None
