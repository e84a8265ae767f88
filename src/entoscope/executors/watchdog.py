"""The local Ray cluster's watchdog: when the driver that started the cluster dies, end what is left of it.

    python watchdog.py DRIVER_PID RAY_PACKAGE_DIR        (started by ray_cluster.start_watchdog)

Ray ends the processes of a local cluster when its driver exits, and fate-shares its GCS and raylet with
the driver, but its dashboard and runtime-env agents outlive a driver killed with SIGKILL for a minute
or more (they wait on the dead GCS). This process, in its own session so that a signal to the driver's
process group does not end it first, reads /proc every half second: it remembers the driver's
descendants that are Ray's (an executable or script under Ray's package folder, or a `ray::` process
title), each with its start time, and once the driver is gone it kills (SIGKILL) every one still alive
with the same start time (a reused pid is never touched), then exits. It also exits when the driver
shut the cluster down itself (all of them gone while the driver lives on). Linux only (/proc); it
imports nothing beyond the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live, non-zombie process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _is_ray(pid: int, ray_dir: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return False
    return bool(args) and (args[0].startswith("ray::") or any(a.startswith(ray_dir) for a in args))


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def watch(driver: int, ray_dir: str) -> None:
    me = os.getpid()
    first = _stat(driver)
    if first is None:
        return
    born = first[1]
    known: dict[int, int] = {}  # pid -> start time of the cluster's processes seen so far
    while True:
        now = _stat(driver)
        if now is None or now[1] != born:  # the driver is gone
            break
        for pid in _descendants(driver):
            if pid != me and pid not in known and _is_ray(pid, ray_dir):
                st = _stat(pid)
                if st is not None:
                    known[pid] = st[1]
        alive = {pid for pid, start in known.items() if (_stat(pid) or (0, -1))[1] == start}
        if known and not alive:
            return  # the driver shut its cluster down itself
        time.sleep(POLL_S)
    for pid, start in known.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
