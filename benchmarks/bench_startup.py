"""Benchmark of starting: how long the command line and `import entoscope` take before doing anything,
against `python -c "import torch"` (what every command cost when it imported torch first), in this script.

    python benchmarks/bench_startup.py              # best of 7 runs each
    python benchmarks/bench_startup.py --repeat 3   # quicker

Each command runs in a fresh subprocess; its wall time (best of --repeat) and its CPU time (user +
system of that run, from the children's rusage) are printed, with the ratio of the wall time to
`import torch`'s. Measured: `entoscope --version`, `entoscope --help`, every sub-command's `--help`,
`python -c "import entoscope"`, and `python -c "pass"` (the interpreter alone) for reference.
Target: `entoscope --version` <= 0.1x of `import torch`.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def entoscope_command() -> list[str]:
    """The console script beside this interpreter (as a user types it), else `python -m entoscope.cli`."""
    script = Path(sys.executable).with_name("entoscope")
    if script.exists():
        return [str(script)]
    found = shutil.which("entoscope")
    return [found] if found else [sys.executable, "-m", "entoscope.cli"]


def timed(cmd: list[str], repeat: int, status: int = 0) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of that run) of `cmd` over `repeat` runs, each ending with `status`."""
    best = (float("inf"), 0.0)
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != status:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-500:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best, (wall, cpu))
    return best


def sub_commands() -> list[str]:
    from entoscope.cli_snapshot import load

    top = next(a for a in load()["actions"] if a["kind"] == "subparsers")
    return [c["name"] for c in top["choices"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="runs per command (the best is kept)")
    args = ap.parse_args()
    cli = entoscope_command()
    cases = [("python -c 'import torch'  (baseline)", [sys.executable, "-c", "import torch"]),
             ("python -c 'pass'", [sys.executable, "-c", "pass"]),
             ("python -c 'import entoscope'", [sys.executable, "-c", "import entoscope"]),
             ("entoscope --version", cli + ["--version"]),
             ("entoscope --help", cli + ["--help"])]
    cases += [(f"entoscope {c} --help", cli + [c, "--help"]) for c in sub_commands()]
    cases += [("entoscope lens --bogus 3  (a usage mistake)", cli + ["lens", "--bogus", "3"], 2)]
    print(f"python {sys.version.split()[0]}; command: {' '.join(cli)}; best of {args.repeat} runs each")
    print(f"{'command':<42} {'wall':>8} {'cpu':>8} {'wall / import torch':>20}")
    base = None
    for name, cmd, *status in cases:
        wall, cpu = timed(cmd, args.repeat, *status)
        base = base or wall
        print(f"{name:<42} {wall:7.3f}s {cpu:7.3f}s {wall / base:19.3f}x", flush=True)


if __name__ == "__main__":
    main()
