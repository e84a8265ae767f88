"""The memory budget on a GPU (issue 46, item 6): written to run when a device is lent; it has not run on one yet.

    python benchmarks/gpu/memory.py --device cuda --out memory_gpu.json                 # 1B and 2B shapes, bfloat16
    python benchmarks/gpu/memory.py --device cpu --shapes demo --out /tmp/m.json        # the CPU path (a dry run)

What it checks, on `--device`:
1. `memory: auto` reads the device's free memory: the budget `Operation.plan` reports equals AUTO_SHARE x
   `torch.cuda.mem_get_info()[0]` read just before (within 64 MiB: what the plan itself allocates);
2. each shape (Llama 3.2 1B, Gemma 2 2B by default; benchmarks/shapes.py) is built on the device from its
   configuration (random weights drawn there: no file travels), in `--dtype`;
3. each operation of benchmarks/memory_cases.py runs with the budget "auto", and with a forced budget of half the
   peak it took: the peak above the loaded model (torch.cuda.max_memory_allocated less the allocation once the
   model is loaded and the plan made) against the plan's `peak_memory_bytes` and against the budget; a run refused
   (`memory_budget`) records the smallest budget it names;
4. a budget of 1 KiB is refused before any forward, for every operation.
One JSON (--out) with a row per (shape, case, budget); the exit status is 1 when a forced budget is exceeded, or
auto does not read the free memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _peak_and_reset(device: str) -> tuple[int, int]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    from memory_cases import _status

    return _status("VmHWM"), _status("VmRSS")


def _reset(device: str) -> int:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    from memory_cases import _reset_peak, _status

    _reset_peak()
    return _status("VmRSS")


def run_case(model: Any, name: str, case: str, memory: Any, n: int, device: str) -> dict[str, Any]:
    from memory_cases import CASES, Ctx

    from entoscope.errors import EntoscopeError
    from entoscope.models.adapter import adapt

    op, data = CASES[case](Ctx(adapt(model), n, memory, "shape"))
    row: dict[str, Any] = {"shape": name, "case": case, "memory": memory}
    try:
        plan = op.plan(model, data)
    except EntoscopeError as err:
        return {**row, "refused": err.code, "smallest": getattr(err, "smallest", None), "message": err.one_line()}
    row.update(plan_peak=plan.peak_memory_bytes, budget=plan.memory_budget_bytes, batch_sizes=plan.batch_sizes)
    base = _reset(device)
    t0 = time.perf_counter()
    try:
        op.run(model, data, quiet=True)
    except EntoscopeError as err:
        return {**row, "refused": err.code, "message": err.one_line()}
    peak, _ = _peak_and_reset(device)
    return {**row, "measured": peak - base, "seconds": time.perf_counter() - t0}


def check_auto(model: Any, device: str) -> dict[str, Any]:
    """The budget "auto" gives against the device's free memory read here."""
    import torch

    import entoscope as es
    from entoscope.memory import AUTO_SHARE

    free = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else None
    plan = es.Lens(sites=es.Sites(activation="resid_post", over=["layer"])).plan(model, {"task": "ioi", "n": 4})
    if free is None:
        from entoscope.memory import free_bytes

        free = free_bytes("cpu")
    expected = int(AUTO_SHARE * free)
    return {"free": free, "budget": plan.memory_budget_bytes, "expected": expected,
            "ok": abs(plan.memory_budget_bytes - expected) <= 64 * 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="llama-3.2-1b,gemma-2-2b", help="shapes.py names, or demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", default="", help="memory_cases.py names (default all)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--out", default="memory_gpu.json")
    args = ap.parse_args()
    import torch

    from memory_cases import CASES
    from shapes import build

    import entoscope as es

    torch.manual_seed(0)
    cases = [c for c in args.cases.split(",") if c] or list(CASES)
    report: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "rows": [], "auto": {}}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    failed = False
    for name in args.shapes.split(","):
        t0 = time.perf_counter()
        model = es.load_model("demo", device=args.device, dtype=args.dtype) if name == "demo" \
            else build(name, args.dtype, device=args.device)
        report.setdefault("built_s", {})[name] = time.perf_counter() - t0
        report["auto"][name] = auto = check_auto(model, args.device)
        failed |= not auto["ok"]
        for case in cases:
            free = run_case(model, name, case, "auto", args.n, args.device)
            report["rows"].append(free)
            if "measured" in free:
                forced = run_case(model, name, case, max(2**20, free["measured"] // 2), args.n, args.device)
                forced["within"] = "measured" not in forced or forced["measured"] <= forced["budget"]
                failed |= not forced["within"]
                report["rows"].append(forced)
            tiny = run_case(model, name, case, 1024, args.n, args.device)
            tiny["refused_ok"] = tiny.get("refused") == "memory_budget"
            failed |= not tiny["refused_ok"]
            report["rows"].append(tiny)
            print(json.dumps({k: v for k, v in free.items() if k != "batch_sizes"}), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=1))
        del model
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
