"""Benchmark of `entoscope report` on a real model (SmolLM2-135M): time per section against its floor, and peak memory.

    python benchmarks/bench_report_real.py --quick                 # the --quick report
    python benchmarks/bench_report_real.py                         # the full report
    python benchmarks/bench_report_real.py --sections lens,dla     # some sections only

The report runs in a child process (`entoscope.report.build_report(model, out, quick, sections)`, what
`entoscope report` calls), one thread, with its progress lines (one per section, as the CLI prints them).
Each operation a section runs is recorded with its plan: prompt forwards and prompt backwards (`Plan`:
a batch of B prompts is B forwards; a patched run started part-way counts as one forward).

The floor, measured here on the same model, one thread: the time of one prompt's forward and of one
prompt's forward + backward (batches of --floor-batch IOI prompts), times each section's planned forward
and backward passes. It is what a section costs if it did nothing but the model passes its plan needs
(an overestimate for exact patching, whose part-way runs count as whole forwards).

Peak memory: the child's peak resident set size (its VmHWM, /proc/self/status: model, activations,
everything; not `ru_maxrss`, which Linux carries over an exec from the parent, here the floor's runs), and
after each step the peak so far (the step that raised it is the first whose column shows the new value).

Sections: the report's own list, less those given by --skip (default none). The sizes each section uses
on the model are report/sizes.py's (docs/report.md); exact patching's IOI sweeps are measured on their own
by benchmarks/bench_real_patching.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FOLDER = Path.home() / ".cache" / "entoscope" / "real-models" / "smollm2-135m"

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(int(sys.argv[4]))
import entoscope as es
from entoscope.operation import Operation
from entoscope.report import build_report

def peak_kib():  # this process's own high-water RSS (ru_maxrss would carry the parent's over the exec)
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])

ops = []
run = Operation.run
def recorded(self, *args, **kwargs):
    c0 = time.process_time()
    result = run(self, *args, **kwargs)
    plan = getattr(result, "plan", None)
    ops.append({"op": self.name, "cpu_s": time.process_time() - c0,
                "forward": getattr(plan, "forward_passes", 0), "backward": getattr(plan, "backward_passes", 0)})
    return result
Operation.run = recorded
t0 = time.perf_counter()
model = es.load_model(sys.argv[1])
print(f"BENCH load {time.perf_counter() - t0:.1f} {peak_kib() / 1024:.0f}", flush=True)
sections = sys.argv[3].split(",")
import entoscope.report as report
marks = []
step = report.Progress.step
def step_marked(self, name):
    marks.append((name, len(ops), time.process_time(), peak_kib()))
    return step(self, name)
report.Progress.step = step_marked
c0 = time.process_time()
build_report(model, sys.argv[2], quick=sys.argv[5] == "1", sections=sections, overwrite=True)
marks.append(("end", len(ops), time.process_time(), peak_kib()))
out = []
for (name, i, c, _), (_, j, c2, peak) in zip(marks, marks[1:]):
    out.append({"step": name, "cpu_s": c2 - c, "ops": ops[i:j], "peak_mib": peak / 1024})
print("BENCH " + json.dumps(out), flush=True)
"""


def floor_costs(folder: str, batch: int, threads: int) -> tuple[float, float]:
    """CPU seconds of one prompt's forward, and of one prompt's forward + backward (IOI prompts, batched)."""
    import torch
    import transformers

    import entoscope as es

    torch.set_num_threads(threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    data = es.tasks.ioi(n=batch, tokenizer=tok)
    ids = tok([e.prompt for e in data.examples], return_tensors="pt", padding=True)["input_ids"]
    with torch.no_grad():
        hf(ids)  # warm-up
        c0 = time.process_time()
        for _ in range(3):
            hf(ids)
        fwd = (time.process_time() - c0) / 3 / batch
    c0 = time.process_time()
    for _ in range(2):
        hf.zero_grad()
        hf(ids).logits[:, -1].logsumexp(-1).sum().backward()
    both = (time.process_time() - c0) / 2 / batch
    del hf
    return fwd, both


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=str(FOLDER))
    ap.add_argument("--quick", action="store_true", help="the report's --quick")
    ap.add_argument("--sections", default="", help="comma-separated sections (default: the report's, less --skip)")
    ap.add_argument("--skip", default="", help="comma-separated sections left out")
    ap.add_argument("--floor-batch", type=int, default=16)
    ap.add_argument("--out", default="", help="the report's folder (default: a temporary one)")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        print(f"no model folder at {args.model}: run the real-model fixture script first (or pass --model)")
        return 1
    from entoscope.report import SECTION_ORDER

    skip = [s for s in args.skip.split(",") if s]
    sections = [s for s in (args.sections.split(",") if args.sections else SECTION_ORDER) if s and s not in skip]
    import torch

    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores; report "
          f"{'--quick' if args.quick else '(full)'}; sections: {', '.join(sections)}; left out: {', '.join(skip) or '-'}")
    fwd, both = floor_costs(args.model, args.floor_batch, args.threads)
    print(f"floor: {fwd * 1000:.1f} ms CPU a prompt forward, {both * 1000:.1f} ms a prompt forward + backward "
          f"(batches of {args.floor_batch} IOI prompts)", flush=True)
    out = args.out or tempfile.mkdtemp(prefix="entoscope-report-")
    env = dict(os.environ, ENTOSCOPE_QUIET="0", OMP_NUM_THREADS=str(args.threads))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, args.model, out, ",".join(sections), str(args.threads),
                             "1" if args.quick else "0"], env=env, stdout=subprocess.PIPE, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the report's progress lines, as they come
        lines.append(line.rstrip("\n"))
        if line.startswith("report"):
            print("  " + line.rstrip(), flush=True)
    if proc.wait() != 0:
        print("\n".join(lines[-20:]))
        return proc.returncode
    wall = time.perf_counter() - t0
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    load, load_peak = next(map(float, line.split()[2:4]) for line in lines if line.startswith("BENCH load"))
    steps = json.loads(next(line[6:] for line in lines if line.startswith("BENCH [")))
    peak = max([load_peak] + [s["peak_mib"] for s in steps])
    head = (f"{'step':<28} {'CPU time':>9} {'forwards':>9} {'backwards':>9} {'floor':>8} {'x floor':>8} "
            f"{'peak RSS so far':>16}")
    print()
    print(head)
    print("-" * len(head))
    total = total_floor = 0.0
    for s in steps:
        f = sum(o["forward"] for o in s["ops"])
        b = sum(o["backward"] for o in s["ops"])
        floor = f * fwd + b * (both - fwd)  # a backward's forward is among the plan's forwards
        total += s["cpu_s"]
        total_floor += floor
        ratio = f"{s['cpu_s'] / floor:>7.1f}x" if floor else f"{'-':>8}"
        print(f"{s['step']:<28} {s['cpu_s']:>8.1f}s {f:>9} {b:>9} {floor:>7.1f}s {ratio} {s['peak_mib']:>12.0f} MiB")
    print(f"{'report (every step)':<28} {total:>8.1f}s {'':>9} {'':>9} {total_floor:>7.1f}s "
          f"{total / max(total_floor, 1e-9):>7.1f}x")
    user = cpu.ru_utime + cpu.ru_stime
    print(f"\nchild: model load {load:.0f} s (wall), {load_peak:.0f} MiB; whole child {user:.0f} s CPU, {wall:.0f} s wall; peak resident "
          f"memory {peak:.0f} MiB; report in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
