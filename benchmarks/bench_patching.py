"""Benchmark of exact activation patching: entoscope's batched engine against what users write.

    python benchmarks/bench_patching.py                     # HookedTransformer (transformer-lens 3.x), 1 thread
    python benchmarks/bench_patching.py --backend bridge    # TransformerBridge (transformer-lens 3.x and 4.x)
    python benchmarks/bench_patching.py --backend bridge --curves   # cost against prompt length and layers
    python benchmarks/bench_patching.py --quick             # 2 layers, 4 pairs, 1 repeat: a smoke run

Model: a random GPT-2-small-sized model (transformers.GPT2Config() defaults: 12 layers, d_model
768, 50257-token vocabulary) built offline, as a HookedTransformer or a TransformerBridge. Prompts:
15 random tokens (BOS first), clean and corrupt differing everywhere after BOS; metric: logit
difference of two fixed tokens at the last position. Sweep: resid_pre at every layer x position
(12 x 15 = 180 sites), exact denoising.

Compared, in this one process, with the thread count set and printed (default 1):
  (a) a plain loop: one run_with_hooks per patch (a hook writing the clean value; the pairs of a
      dataset in one batch);
  (b) hooked: transformer_lens.patching.get_act_patch_resid_pre (also one forward per patch);
      bridge: a batched run_with_hooks sweep, every (pair, layer, position) its own row, 16 patched
      rows per forward (hooks that write each row's clean value at its own layer and position);
  (c) entoscope.patching.Patching(method="exact"), prefix reuse "auto" (layers and positions) and, for
      reference, prefix_reuse "off" (batched full forwards);
  floor (bridge): the same partial forwards unpatched, through models/partial.py: one walk per start
      position p, every (pair, layer L) row joining at block L, computing blocks L.. at positions p..
      only (the prefix's keys/values frozen, recorded from one run) and unembedding the answer row at the
      two metric tokens: the least token work a prefix-reusing sweep can do (a sweep may still beat it
      by grouping start positions into fewer block calls). "vs floor" is the time over the floor's.
on one pair and on a dataset of 32 pairs (on the dataset, (a) runs only with --loop-dataset and "off"
only with --full-off: each costs about as much as (b)). Times are the median of --repeat runs (one
pair) and of --repeat-dataset runs (the dataset); "max |diff|" is the largest difference of the
[layer, pos] metric grid from (b). Peak memory is the largest rise, during a call, of the bytes malloc
has handed out (glibc's mallinfo2, where torch's CPU tensors live; sampled every millisecond), above
what was allocated when the call began (the model's weights are not counted).

--curves: one pair, prompts of 16, 64 and 256 tokens (12 layers) and 6, 12, 24 layers (64 tokens),
resid_pre at every layer x 8 positions spread over the prompt (0 .. T-1): (b) against (c) auto, with
the work model of each: (b) costs cells x a full forward; (c) about sum over cells of
(n_layers - L) x (T - p) block-positions (plus one unembedded row per cell).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ENTOSCOPE_QUIET", "1")

import torch  # noqa: E402

from common import MEMORY_MEASURE, PeakMemory  # noqa: E402

ANSWER, WRONG = 11, 17


def build_model(n_layers: int, backend: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=n_layers))
    hf.config._attn_implementation = "eager"
    return from_hf(hf, tiny_tokenizer(), backend=backend, name="gpt2-small-random", folder=tokenizer_dir())


def make_pairs(n: int, length: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, vocab, (n, length), generator=g)
    corrupt = torch.randint(1, vocab, (n, length), generator=g)
    clean[:, 0] = corrupt[:, 0] = 0
    return clean, corrupt


def metric(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()


def tl_loop(model, clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """(a) one run_with_hooks per (layer, position) patch."""
    L, T = model.cfg.n_layers, clean.shape[1]
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
        out = torch.zeros(L, T)
        for layer in range(L):
            name = f"blocks.{layer}.hook_resid_pre"
            for pos in range(T):
                def hook(x, hook, pos=pos, name=name):
                    x[:, pos] = cache[name][:, pos]
                    return x
                out[layer, pos] = metric(model.run_with_hooks(corrupt, fwd_hooks=[(name, hook)]))
    return out


def tl_patching(model, clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """(b) hooked: transformer_lens.patching.get_act_patch_resid_pre."""
    from transformer_lens import patching

    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        return patching.get_act_patch_resid_pre(model, corrupt, cache, metric).cpu()


def batched_sweep(model, clean: torch.Tensor, corrupt: torch.Tensor, positions: list[int] | None = None,
                  rows: int = 16) -> torch.Tensor:
    """(b) bridge: every (pair, layer, position) one row, `rows` rows per run_with_hooks; the [layer, pos]
    grid of the mean over pairs of the metric."""
    N, T = clean.shape
    L = model.cfg.n_layers
    pos_list = list(range(T)) if positions is None else positions
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
        cells = torch.tensor([(e, layer, p) for layer in range(L) for p in pos_list for e in range(N)])
        out = torch.zeros(N, L, len(pos_list))
        column = {p: j for j, p in enumerate(pos_list)}
        for i in range(0, len(cells), rows):
            pair, layer, pos = cells[i:i + rows].unbind(1)
            hooks = []
            for lay in torch.unique(layer).tolist():
                sel = (layer == lay).nonzero()[:, 0]
                name = f"blocks.{lay}.hook_resid_pre"

                def hook(x, hook, sel=sel, name=name):
                    x[sel, pos[sel]] = cache[name][pair[sel], pos[sel]]
                    return x
                hooks.append((name, hook))
            logits = model.run_with_hooks(corrupt[pair], fwd_hooks=hooks)
            out[pair, layer, torch.tensor([column[int(p)] for p in pos])] = \
                logits[:, -1, ANSWER] - logits[:, -1, WRONG]
    return out.mean(0)


def entoscope_patching(model, clean: torch.Tensor, corrupt: torch.Tensor, reuse: str,
                       positions: list[int] | None = None) -> torch.Tensor:
    """(c) entoscope's batched engine; the [layer, pos] grid of the dataset-mean metric."""
    from entoscope import Sites
    from entoscope.data import Dataset, Example
    from entoscope.patching import Patching

    data = Dataset("bench", tuple(Example(tuple(c.tolist()), tuple(k.tolist()), answers=(ANSWER,),
                                          wrong_answers=(WRONG,)) for c, k in zip(clean, corrupt)))
    op = Patching(sites=Sites(activation="resid_pre", over=["layer", "position"], positions=positions or "all"),
                  comparison="absolute", prefix_reuse=reuse, per_prompt=False, memory_budget_mb=4096)
    table = op.run(model, data, quiet=True).table
    return torch.tensor(table.pivot(index="layer", columns="position", values="value").values, dtype=torch.float32)


def floor_walks(model, clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """floor (bridge): unpatched partial forwards of every (pair, layer, position) cell, batched per start
    position; [layer, pos] grid of the mean over pairs of the (unpatched) metric."""
    from entoscope.models.adapter import adapt
    from entoscope.models.partial import logits_at, prefix_reads, read_run, record_past, slice_start

    a = adapt(model)
    N, T = corrupt.shape
    L = a.structure.n_layers
    columns = torch.tensor([ANSWER, WRONG])
    with torch.no_grad():
        _, acts = read_run(a, corrupt, prefix_reads(a, list(range(L)), positions=True))
        record_past(a, acts, 0)
        rows = torch.arange(N).repeat(L)  # (pair, layer) rows, sorted by layer
        layers = torch.arange(L).repeat_interleave(N)
        out = torch.zeros(N, L, T)
        for p in range(T):
            start = slice_start(acts, rows.to(a.device), layers, p, L)
            logits = logits_at(a, torch.full((len(rows),), T - 1 - p), start=start, columns=columns)
            out[rows, layers, p] = (logits[:, 0] - logits[:, 1]).float().cpu()
    return out.mean(0)


def measure(fn, repeat: int) -> tuple[float, torch.Tensor, int]:
    times, peak = [], 0
    out = None
    for _ in range(repeat):
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        peak = max(peak, mem.rise)
    return statistics.median(times), out, peak


def sweep_table(args, model) -> None:
    vocab = 300  # ids the tiny tokenizer knows; the model's own vocabulary is 50257
    head = (f"{'pairs':>5}  {'method':<44} {'time':>9} {'vs (b)':>8} {'vs (a)':>8} {'vs floor':>9} {'max |diff|':>11} "
            f"{'peak mem':>10}")
    print()
    print(head)
    print("-" * len(head), flush=True)
    baseline = ("(b) transformer_lens.patching", tl_patching) if args.backend == "hooked" else \
        ("(b) batched run_with_hooks, 16 rows/forward", batched_sweep)
    for n in (1, args.pairs):
        clean, corrupt = make_pairs(n, args.length, vocab)
        runs = {baseline[0]: lambda: baseline[1](model, clean, corrupt)}
        if n == 1 or args.loop_dataset:
            runs["(a) plain loop, one run_with_hooks per patch"] = lambda: tl_loop(model, clean, corrupt)
        runs["(c) entoscope exact, prefix reuse auto"] = lambda: entoscope_patching(model, clean, corrupt, "auto")
        if n == 1 or args.full_off:
            runs["(c) entoscope exact, prefix reuse off"] = lambda: entoscope_patching(model, clean, corrupt, "off")
        entoscope_patching(model, clean[:1], corrupt[:1], "auto")  # warm-up (vocabulary strings, kernels, check)
        repeat = args.repeat if n == 1 else args.repeat_dataset
        floor_t = floor_peak = None
        if args.backend == "bridge":
            floor_walks(model, clean[:1], corrupt[:1])  # warm-up
            floor_t, _, floor_peak = measure(lambda: floor_walks(model, clean, corrupt), repeat)
        ref = ref_t = loop_t = None
        for label, fn in runs.items():
            t, out, peak = measure(fn, repeat)
            if ref is None:
                ref, ref_t = out, t
            if label.startswith("(a)"):
                loop_t = t
            vs_loop = f"{loop_t / t:>7.2f}x" if loop_t else f"{'-':>8}"
            vs_floor = f"{t / floor_t:>8.2f}x" if floor_t else f"{'-':>9}"
            print(f"{n:>5}  {label:<44} {t:>8.2f}s {ref_t / t:>7.2f}x {vs_loop} {vs_floor} "
                  f"{float((out - ref).abs().max()):>11.2e} {peak / 2**20:>8.0f}MiB", flush=True)
        if floor_t:
            print(f"{n:>5}  {'floor: unpatched partial forwards':<44} {floor_t:>8.2f}s {ref_t / floor_t:>7.2f}x "
                  f"{(f'{loop_t / floor_t:>7.2f}x' if loop_t else f'{chr(45):>8}')} {1:>8.2f}x {'(unpatched)':>11} "
                  f"{floor_peak / 2**20:>8.0f}MiB", flush=True)


def curves(args) -> None:
    """(b) against (c) for prompt lengths and layer counts, one pair, 8 positions per layer."""
    head = (f"{'layers':>6} {'tokens':>6} {'cells':>5}  {'(b) time':>9} {'(c) time':>9} {'ratio':>7} {'work ratio':>10} "
            f"{'max |diff|':>10} {'(b) peak':>9} {'(c) peak':>9}")
    print()
    print(head)
    print("-" * len(head), flush=True)
    for n_layers, T in [(12, 16), (12, 64), (12, 256), (6, 64), (24, 64)]:
        model = build_model(n_layers, args.backend)
        clean, corrupt = make_pairs(1, T, 300)
        positions = sorted({round(i * (T - 1) / 7) for i in range(8)})
        entoscope_patching(model, clean, corrupt, "auto", positions[-2:])  # warm-up
        tb, ref, pb = measure(lambda: batched_sweep(model, clean, corrupt, positions), 1)
        tc, out, pc = measure(lambda: entoscope_patching(model, clean, corrupt, "auto", positions), 1)
        cells = n_layers * len(positions)
        work = sum((n_layers - L) * (T - p) for L in range(n_layers) for p in positions)
        print(f"{n_layers:>6} {T:>6} {cells:>5}  {tb:>8.2f}s {tc:>8.2f}s {tb / tc:>6.2f}x "
              f"{cells * n_layers * T / work:>9.2f}x {float((out - ref).abs().max()):>10.2e} "
              f"{pb / 2**20:>7.0f}MiB {pc / 2**20:>7.0f}MiB", flush=True)
        del model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--length", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=32, help="pairs of the dataset run")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each method on one pair (median)")
    ap.add_argument("--repeat-dataset", type=int, default=1, help="runs of each method on the dataset")
    ap.add_argument("--full-off", action="store_true", help="also run prefix_reuse off on the dataset")
    ap.add_argument("--loop-dataset", action="store_true", help="also run the loop baseline (a) on the dataset")
    ap.add_argument("--backend", choices=["hooked", "bridge"], default="hooked")
    ap.add_argument("--curves", action="store_true", help="cost against prompt length and layers (one pair)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 pairs, 1 repeat: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.pairs, args.repeat, args.repeat_dataset = 2, 4, 1, 1
    torch.set_num_threads(args.threads)
    import transformer_lens  # noqa: F401
    from importlib.metadata import version

    print(f"torch {torch.__version__}, transformer-lens {version('transformer-lens')}, {torch.get_num_threads()} "
          f"intra-op threads, {os.cpu_count()} cores, python {sys.version.split()[0]}; backend {args.backend}; "
          f"peak memory: {MEMORY_MEASURE}")
    if args.curves:
        curves(args)
        return 0
    t0 = time.perf_counter()
    model = build_model(args.layers, args.backend)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GPT-2-small-sized random ({args.layers} layers, {n_params / 1e6:.0f}M parameters), built in "
          f"{time.perf_counter() - t0:.0f} s; {args.layers} x {args.length} = {args.layers * args.length} "
          f"resid_pre sites")
    sweep_table(args, model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
