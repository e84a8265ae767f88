"""Memory and time of every operation: the plan's peak against the measured one, forced budgets, and the cost table.

    python benchmarks/bench_memory.py --models smollm2,gemma3 --dtypes float32          # plan vs measured
    python benchmarks/bench_memory.py --models smollm2 --memory 256MiB                    # a forced budget
    python benchmarks/bench_memory.py --models demo,smollm2,gemma3,shape:qwen2.5-0.5b,shape:llama-3.2-1b \
        --dtypes float32,bfloat16 --floor --n 8 --json cost.json                          # the cost table

Each (model, dtype, case) runs in its own process (memory_cases.measure: one thread; the peak is VmHWM above
the resident set once the model is loaded and the plan made). Models: demo, smollm2, gemma3 (the real test
models' folders), a folder, or shape:NAME (shapes.py: random weights in a real model's shape). Columns: the
plan's peak above the model, the measured peak, their ratio, the batch sizes, the plan's prompt forwards and
backwards, CPU seconds; with --floor the floor (the plan's passes as plain model calls, CPU seconds) and the
run's time over it; with --calibrate the time the plan estimates after one calibration forward.
A refused run prints its code and the smallest budget it names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_cases import CASES, measure  # noqa: E402


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def row(r: dict) -> str:
    head = f"{r['model']:<22} {r['dtype']:<9} {r['case']:<22}"
    if "error" in r:
        return head + " ERROR " + " | ".join(r["error"].strip().splitlines()[-3:])
    if "refused" in r and "measured" not in r:
        return head + f" refused [{r['refused']}] " + r["message"][:150]
    ratio = r["plan_peak"] / max(1, r["measured"])
    sizes = sorted(set(r["batch_sizes"]))
    text = (f"{mib(r['plan_peak']):>8} {mib(r['measured']):>8} {ratio:>6.2f} {','.join(map(str, sizes))[:14]:>14} "
            f"{r['forward']:>6} {r['backward']:>5} {r['cpu_s']:>8.1f}")
    if "floor_s" in r:
        text += f" {r['floor_s']:>8.1f} {r['cpu_s'] / max(1e-9, r['floor_s']):>6.2f}"
    if "estimate_s" in r:
        text += f" {r['estimate_s']:>8.1f} {r['estimate_s'] / max(1e-9, r['cpu_s']):>6.2f}"
    return head + " " + text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--cases", default="", help=f"comma-separated (default all): {', '.join(CASES)}")
    ap.add_argument("--n", type=int, default=16, help="prompts")
    ap.add_argument("--memory", default="auto", help="the budget given to every run")
    ap.add_argument("--floor", action="store_true", help="time the plan's passes as plain model calls")
    ap.add_argument("--calibrate", action="store_true", help="the plan's time estimate after a calibration forward")
    ap.add_argument("--json", default="", help="append each result as a JSON line to this file")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c] or list(CASES)
    print(f"{'model':<22} {'dtype':<9} {'case':<22} {'plan MiB':>8} {'meas MiB':>8} {'ratio':>6} {'batches':>14} "
          f"{'fwd':>6} {'bwd':>5} {'cpu s':>8}" + (f" {'floor s':>8} {'x floor':>6}" if args.floor else "")
          + (f" {'est s':>8} {'est/cpu':>6}" if args.calibrate else ""), flush=True)
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for case in cases:
                r = measure(model, dtype, case, n=args.n, memory=args.memory, floor=args.floor,
                            calibrate=args.calibrate)
                print(row(r), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
