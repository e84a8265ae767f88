"""Benchmark of exact activation patching: entoscope's batched engine against TransformerLens.

    python benchmarks/bench_patching.py            # GPT-2-small-sized model, 2 intra-op threads
    python benchmarks/bench_patching.py --quick    # 2 layers, 4 pairs, 1 repeat: a smoke run (about a minute)
    python benchmarks/bench_patching.py --threads 4 --backend bridge

Model: a random GPT-2-small-sized model (transformers.GPT2Config() defaults: 12 layers, d_model
768, 50257-token vocabulary) built offline, as a HookedTransformer (TransformerLens's own patching
utilities take one) or a TransformerBridge. Prompts: 15 random tokens (BOS first), clean and
corrupt differing everywhere after BOS; metric: logit difference of two fixed tokens at the last
position. Sweep: resid_pre at every layer x position (12 x 15 = 180 sites), exact denoising.

Compared, in this one process, with the thread count set and printed:
  (a) a plain TransformerLens loop: one run_with_hooks per patch (a hook writing the clean value);
  (b) transformer_lens.patching.get_act_patch_resid_pre (also one forward per patch);
  (c) entoscope.patching.Patching(method="exact"), prefix reuse "auto" (layers and positions on a
      HookedTransformer) and, for reference, prefix_reuse "off" (batched full forwards).
on one pair and on a dataset of 32 pairs (TransformerLens runs the 32 as one batch per patch; on
the dataset, (a) runs only with --loop-dataset and "off" only with --full-off: each costs about as
much as (b)). Times are the median of --repeat runs (one pair)
and of --repeat-dataset runs (the dataset); "max |diff|" is the largest difference of the [layer, pos]
metric grid from (b). Peak memory is the largest rise, during a call, of the bytes malloc has handed
out (glibc's mallinfo2, where torch's CPU tensors live; sampled every millisecond), above what was
allocated when the call began (the model's weights are not counted).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ENTOSCOPE_QUIET", "1")

import torch  # noqa: E402

ANSWER, WRONG = 11, 17


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _allocated_reader():
    """A function giving the bytes malloc has handed out now (glibc >= 2.33), else the resident set size."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2

        def allocated() -> int:
            info = libc.mallinfo2()
            return info.uordblks + info.hblkhd  # heap in use + mmap-ed blocks (torch's big tensors)
        allocated()
        return allocated, "bytes allocated (glibc mallinfo2)"
    except (OSError, AttributeError):
        import resource

        return (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "max resident set size"


ALLOCATED, MEMORY_MEASURE = _allocated_reader()


class PeakMemory:
    """Largest rise of allocated memory during the `with` block, sampled every millisecond in a thread."""

    def __enter__(self) -> PeakMemory:
        self.start = self.peak = ALLOCATED()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, ALLOCATED())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, ALLOCATED())
        self.rise = self.peak - self.start


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
    """(b) transformer_lens.patching.get_act_patch_resid_pre."""
    from transformer_lens import patching

    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        return patching.get_act_patch_resid_pre(model, corrupt, cache, metric).cpu()


def entoscope_patching(model, clean: torch.Tensor, corrupt: torch.Tensor, reuse: str) -> torch.Tensor:
    """(c) entoscope's batched engine; the [layer, pos] grid of the dataset-mean metric."""
    from entoscope import Sites
    from entoscope.data import Dataset, Example
    from entoscope.patching import Patching

    data = Dataset("bench", tuple(Example(tuple(c.tolist()), tuple(k.tolist()), answers=(ANSWER,),
                                          wrong_answers=(WRONG,)) for c, k in zip(clean, corrupt)))
    op = Patching(sites=Sites(activation="resid_pre", over=["layer", "position"]), comparison="absolute",
                  prefix_reuse=reuse, per_prompt=False, memory_budget_mb=4096)
    table = op.run(model, data, quiet=True).table
    return torch.tensor(table.pivot(index="layer", columns="position", values="value").values, dtype=torch.float32)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--length", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=32, help="pairs of the dataset run")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each method on one pair (median)")
    ap.add_argument("--repeat-dataset", type=int, default=1, help="runs of each method on the dataset")
    ap.add_argument("--full-off", action="store_true", help="also run prefix_reuse off on the dataset")
    ap.add_argument("--loop-dataset", action="store_true", help="also run the loop baseline (a) on the dataset")
    ap.add_argument("--backend", choices=["hooked", "bridge"], default="hooked")
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 pairs, 1 repeat: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.pairs, args.repeat, args.repeat_dataset = 2, 4, 1, 1
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cores, "
          f"python {sys.version.split()[0]}; backend {args.backend}; peak memory: {MEMORY_MEASURE}")
    t0 = time.perf_counter()
    model = build_model(args.layers, args.backend)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GPT-2-small-sized random ({args.layers} layers, {n_params / 1e6:.0f}M parameters), built in "
          f"{time.perf_counter() - t0:.0f} s; {args.layers} x {args.length} = {args.layers * args.length} "
          f"resid_pre sites")
    vocab = 300  # ids the tiny tokenizer knows; the model's own vocabulary is 50257
    head = f"{'pairs':>5}  {'method':<40} {'time':>9} {'vs (b)':>8} {'vs (a)':>8} {'max |diff|':>11} {'peak mem':>10}"
    print()
    print(head)
    print("-" * len(head), flush=True)
    for n in (1, args.pairs):
        clean, corrupt = make_pairs(n, args.length, vocab)
        runs = {"(b) transformer_lens.patching": lambda: tl_patching(model, clean, corrupt)}
        if n == 1 or args.loop_dataset:
            runs["(a) TransformerLens loop"] = lambda: tl_loop(model, clean, corrupt)
        runs["(c) entoscope exact, prefix reuse auto"] = lambda: entoscope_patching(model, clean, corrupt, "auto")
        if n == 1 or args.full_off:
            runs["(c) entoscope exact, prefix reuse off"] = lambda: entoscope_patching(model, clean, corrupt, "off")
        entoscope_patching(model, clean[:1], corrupt[:1], "auto")  # warm-up (vocabulary strings, kernels)
        repeat = args.repeat if n == 1 else args.repeat_dataset
        ref = ref_t = loop_t = None
        for label, fn in runs.items():
            t, out, peak = measure(fn, repeat)
            if ref is None:
                ref, ref_t = out, t
            if label.startswith("(a)"):
                loop_t = t
            vs_loop = f"{loop_t / t:>7.2f}x" if loop_t else f"{'-':>8}"
            print(f"{n:>5}  {label:<40} {t:>8.2f}s {ref_t / t:>7.2f}x {vs_loop} {float((out - ref).abs().max()):>11.2e} "
                  f"{peak / 2**20:>8.0f}MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
