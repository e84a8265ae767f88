"""One prepared device script: every entoscope operation on a device in float32 and bfloat16, each table
compared with the same run on the CPU in float32, and timings against the floor on SmolLM2.

    python benchmarks/gpu/run.py --out gpu.json                        # on a GPU machine (--device cuda)
    python benchmarks/gpu/run.py --device cpu --size small --models demo --out cpu.json   # CI's path

What it does, for each model (the demo model; SmolLM2 from --smollm2, skipped with a line where absent):
1. loads the model on the CPU in float32 (the reference) and runs every operation of cases.py on it;
2. for each dtype (--dtypes, default float32,bfloat16) loads it on --device in that dtype, runs the same
   operations and compares each table with the reference, joined by its rows' keys: the largest
   difference relative to the column's scale must be within the (operation, dtype) tolerance of
   cases.py (docs/scale.md lists them). On --device cpu, float32 is the reference itself (not rerun).
   A difference past its tolerance, a row on one side only, or an operation that raises is a FAIL
   printed with its numbers (relative and absolute difference, the column and row), and the script
   exits 1;
3. times EAP-IG over N IOI prompts and an exact layer x position sweep over N pairs on SmolLM2 (the
   demo model where SmolLM2 is absent) next to their floors (timing.py), with peak memory.
It prints one table and writes it as JSON (--out). Tolerances can be overridden for a check of the
checker: --tolerance dla=0 (or ENTOSCOPE_GPU_TOLERANCE="dla=0,lens.logit=0") must make the script fail.

Sizes (--size): "full" (the GPU default) compares on 32 demo prompts and 8 SmolLM2 prompts (on SmolLM2
the logit lens and the exact patching read 2 positions, S2 and END: the CPU reference pays for them)
and times 1,000 prompts / pairs, cut to whole batches that fit the remaining time (--budget-s, 450 s
for the whole script by default on a GPU: under 8 minutes with start-up), with the cut printed and
kept in the JSON; "small" (CI) compares on 8 prompts and times 16. Comparisons still to run once 60% of
--budget-s has passed are skipped, each with a line, so that the timings keep their share.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # cases.py, timing.py; benchmarks/common.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ENTOSCOPE_QUIET", "1")

SMOLLM2 = "/root/.cache/entoscope/real-models/smollm2-135m"
SIZES = {"small": {"demo": 8, "smollm2": 8, "timing": 16, "lens_steps": 5},
         "full": {"demo": 32, "smollm2": 8, "timing": 1000, "lens_steps": 20}}


class Ctx:
    """What a case builds its config and data from."""

    def __init__(self, model: Any, model_name: str, n: int, translators: str) -> None:
        from entoscope.models.adapter import adapt

        a = adapt(model)
        self.model_name, self.n, self.translators = model_name, n, translators
        self.tokenizer = None if model_name == "demo" else a.tokenizer  # the demo's task vocabulary is built in
        self.vocab_size = a.structure.d_vocab
        self.bos = a.bos_token_id


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: full on a GPU, small on the CPU")
    p.add_argument("--models", default="demo,smollm2")
    p.add_argument("--smollm2", default=SMOLLM2, help="SmolLM2-135M folder (skipped with a line when absent)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--only", default="", help="comma-separated operation names (default: all)")
    p.add_argument("--tolerance", action="append", default=[], metavar="OP=VALUE",
                   help="override an operation's tolerance (every dtype); for checking that the checks fail")
    p.add_argument("--timings", choices=["on", "off"], default="on")
    p.add_argument("--timing-dtype", default="float32")
    p.add_argument("--timing-n", type=int, default=None, help="prompts / pairs timed (default by --size)")
    p.add_argument("--steps", type=int, default=5, help="EAP-IG steps of the timing")
    p.add_argument("--budget-s", type=float, default=None, help="whole-script time the timings must fit in "
                   "(default 450 on a GPU, none on the CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1; every core with a GPU, "
                   "for the CPU reference)")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    gpu = not args.device.startswith("cpu")
    args.size = args.size or ("full" if gpu else "small")
    args.threads = args.threads or ((os.cpu_count() or 1) if gpu else 1)
    if args.budget_s is None:
        args.budget_s = 450.0 if gpu else float("inf")
    return args


def overrides(args: argparse.Namespace) -> dict[str, float]:
    items = [t for t in os.environ.get("ENTOSCOPE_GPU_TOLERANCE", "").split(",") if t.strip()] + args.tolerance
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name.strip()] = float(value)
    return out


def load(path: str, device: str, dtype: str) -> Any:
    import entoscope as es

    return es.load_model(path, device=device, dtype=dtype)


def free(*models: Any) -> None:
    import torch

    del models
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(case: Any, model: Any, ctx: Ctx) -> tuple[Any, float]:
    op, data = case.build(ctx)
    t = time.perf_counter()
    result = op.run(model, data, quiet=True)
    return result, time.perf_counter() - t


COMPARE_SHARE = 0.6  # of --budget-s: past it, the remaining comparisons are skipped (each with a line)


def compare_model(name: str, path: str, args: argparse.Namespace, tol_over: dict[str, float],
                  rows: list[dict[str, Any]], start: float) -> None:
    import tempfile

    import entoscope as es
    from cases import SkipCase, cases, compare_results

    n = SIZES[args.size][name]
    only = {s for s in args.only.split(",") if s}
    todo = [c for c in cases() if not only or c.name in only]
    print(f"\n== {name}: CPU float32 reference ({n} prompts)", flush=True)
    ref_model = load(path, "cpu", "float32")
    lens_dir = tempfile.mkdtemp(prefix="entoscope-gpu-lens-")
    lens = es.TunedLens.for_model(ref_model)
    lens.fit(ref_model, es.tasks.ioi(n=8, seed=5, tokenizer=Ctx(ref_model, name, n, "").tokenizer),
             steps=SIZES[args.size]["lens_steps"], batch_size=4, quiet=True)  # logits of every layer: 4 prompts
    lens.save(lens_dir)
    ctx = Ctx(ref_model, name, n, lens_dir)
    refs: dict[str, Any] = {}
    late = lambda: time.perf_counter() - start > COMPARE_SHARE * args.budget_s  # noqa: E731
    for case in todo:
        base = {"model": name, "operation": case.name}
        if late():
            print(f"  {case.name}: skipped: past {COMPARE_SHARE:.0%} of --budget-s", flush=True)
            rows.append({**base, "dtype": "-", "status": "skipped", "note": "past the comparisons' time budget"})
            continue
        if name not in case.models:
            rows.append({**base, "dtype": "-", "status": "skipped", "note": f"not run on {name}"})
            continue
        try:
            refs[case.name] = run_case(case, ref_model, ctx)
            print(f"  {case.name:<30} ref   {refs[case.name][1]:.2f} s", flush=True)
        except SkipCase as skip:
            print(f"  {case.name}: skipped: {skip}", flush=True)
            rows.append({**base, "dtype": "-", "status": "skipped", "note": str(skip)})
        except Exception as err:  # noqa: BLE001 - a failing operation is a row of the table, not a crash
            traceback.print_exc()
            rows.append({**base, "dtype": "float32", "device": "cpu", "status": "FAIL",
                         "note": f"reference run raised {type(err).__name__}: {err}"})
    for dtype in args.dtypes.split(","):
        on_cpu = args.device.startswith("cpu")
        if on_cpu and dtype == "float32":
            for case in todo:
                if case.name in refs:
                    rows.append({"model": name, "operation": case.name, "dtype": dtype, "device": "cpu",
                                 "status": "reference", "seconds": refs[case.name][1], "tol": 0.0})
            continue
        print(f"== {name}: {args.device} {dtype}", flush=True)
        model = load(path, args.device, dtype)
        for case in todo:
            if case.name not in refs:
                continue
            if late():
                print(f"  {case.name}: skipped: past {COMPARE_SHARE:.0%} of --budget-s", flush=True)
                rows.append({"model": name, "operation": case.name, "dtype": dtype, "device": args.device,
                             "status": "skipped", "note": "past the comparisons' time budget"})
                continue
            tol = tol_over.get(case.name, case.tol[dtype])
            row: dict[str, Any] = {"model": name, "operation": case.name, "dtype": dtype, "device": args.device,
                                   "tol": tol, "ref_seconds": refs[case.name][1]}
            try:
                result, seconds = run_case(case, model, Ctx(model, name, n, lens_dir))
                diff = compare_results(case, refs[case.name][0], result)
                bad = diff.err > tol or diff.problems
                row.update(status="FAIL" if bad else "ok", err=diff.err, abs_diff=diff.abs_diff, scale=diff.scale,
                           where=diff.where, seconds=seconds, note="; ".join(diff.problems + diff.notes))
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                row.update(status="FAIL", note=f"raised {type(err).__name__}: {err}")
            rows.append(row)
            print(f"  {case.name:<30} {row['status']:<5} err {row.get('err', float('nan')):.2e} "
                  f"(tol {tol:.2g}) {row.get('where', '')} {row.get('note', '')}", flush=True)
        free(model)
    free(ref_model)


def timings(args: argparse.Namespace, models: dict[str, str], start: float) -> list[dict[str, Any]]:
    import entoscope as es
    from entoscope.models.adapter import adapt
    from timing import time_one

    name = "smollm2" if "smollm2" in models else "demo"
    if name == "demo":
        print("\n== timings on the demo model (SmolLM2 absent or not asked for)", flush=True)
    else:
        print(f"\n== timings on SmolLM2 ({args.device}, {args.timing_dtype})", flush=True)
    model = load(models[name], args.device, args.timing_dtype)
    tok = None if name == "demo" else adapt(model).tokenizer
    n = args.timing_n or SIZES[args.size]["timing"]
    data, warm = es.tasks.ioi(n=n, seed=11, tokenizer=tok), es.tasks.ioi(n=8, seed=12, tokenizer=tok)
    out = []
    for i, which in enumerate(("eap_ig", "exact_sweep")):
        left = args.budget_s - (time.perf_counter() - start)
        share = max(left, 0.0) / (2 - i)  # what is left, shared by the timings still to run
        t = time_one(which, model, name, args.timing_dtype, args.device, data, warm, args.steps, share, n)
        out.append(t.as_dict())
        print(f"  {which}: {t.seconds:.1f} s over {t.n} (floor {t.floor_seconds:.1f} s, {t.ratio:.2f}x), "
              f"peak {t.peak_mib:.0f} MiB", flush=True)
    free(model)
    return out


def show(rows: list[dict[str, Any]], times: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<8} {'operation':<30} {'dtype':<9} {'status':<9} {'rel.err':>9} {'tol':>7} {'abs diff':>9} "
          f"{'s':>7} {'ref s':>7}  where / note")
    for r in rows:
        def num(k: str, f: str) -> str:
            v = r.get(k)
            return f"{v:{f}}" if isinstance(v, (int, float)) else "-"
        print(f"{r['model']:<8} {r['operation']:<30} {r.get('dtype', '-'):<9} {r['status']:<9} {num('err', '9.2e')} "
              f"{num('tol', '7.2g')} {num('abs_diff', '9.2e')} {num('seconds', '7.2f')} {num('ref_seconds', '7.2f')}"
              f"  {r.get('where', '')} {r.get('note', '')}".rstrip())
    if times:
        print(f"\n{'timing':<12} {'model':<8} {'dtype':<9} {'n':>5} {'s':>8} {'floor s':>8} {'x floor':>8} "
              f"{'s/1000':>8} {'target':>7} {'peak MiB':>9} {'floor MiB':>9} {'fwd':>8} {'bwd':>7} meets")
        for t in times:
            print(f"{t['name']:<12} {t['model']:<8} {t['dtype']:<9} {t['n']:>5} {t['seconds']:>8.2f} "
                  f"{t['floor_seconds']:>8.2f} {t['ratio']:>8.2f} {t['per_1000_s']:>8.1f} {t['target_s']:>7.0f} "
                  f"{t['peak_mib']:>9.0f} {t['floor_peak_mib']:>9.0f} {t['forward_passes']:>8} "
                  f"{t['backward_passes']:>7} {t['meets']} {t['note']}")


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse(argv)
    import torch

    import entoscope as es  # noqa: F401

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (TF32 keeps 10 bits of mantissa)
    torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore")  # entoscope's warnings (few resamples, mixed roles) are about the small sizes
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: torch sees no CUDA device here (use --device cpu)")
        return 2
    tol_over = overrides(args)
    models = {}
    for name in args.models.split(","):
        path = "demo" if name == "demo" else args.smollm2
        if name != "demo" and not (Path(path) / "config.json").exists():
            print(f"{name}: skipped: no model at {path} (--smollm2 PATH)")
            continue
        models[name] = path
    rows: list[dict[str, Any]] = []
    for name, path in models.items():
        compare_model(name, path, args, tol_over, rows, start)
    times = timings(args, models, start) if args.timings == "on" and models else []
    show(rows, times)
    failed = [r for r in rows if r["status"] == "FAIL"]
    seconds = time.perf_counter() - start
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": args.device,
              "device_name": device, "torch": torch.__version__, "size": args.size, "threads": args.threads,
              "models": models, "dtypes": args.dtypes.split(","), "tolerance_overrides": tol_over,
              "comparisons": rows, "timings": times, "failures": len(failed), "seconds": seconds}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{len(failed)} failure(s) of {sum(r['status'] in ('ok', 'FAIL') for r in rows)} comparisons; "
          f"{seconds:.0f} s in all" + (f"; JSON: {args.out}" if args.out else ""))
    for r in failed:
        print(f"FAIL {r['model']} {r['operation']} {r.get('dtype')}: err {r.get('err', float('nan')):.3e} > tol "
              f"{r.get('tol', float('nan')):.2g} (abs {r.get('abs_diff', float('nan')):.3e}) {r.get('where', '')} "
              f"{r.get('note', '')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
