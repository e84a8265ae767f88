"""Benchmark of entoscope.CachedModel: what a cache miss and a cache hit cost next to an uncached
`run_with_cache` of the same call, and what an entry weighs on disk with and without row dedupe.

    python benchmarks/bench_cache.py                 # 2 intra-op threads (or fewer if fewer cores)
    python benchmarks/bench_cache.py --threads 4 --batch 8 --seq 64

Models: a GPT-2-small-sized random model (transformers.GPT2Config() defaults: 124M parameters,
50257-token vocabulary) wrapped as a TransformerBridge, and the bundled demo model when
src/entoscope/demo/config.json exists (skipped, with a note, otherwise). Everything runs offline.

Times are the best of several interleaved rounds in this one process (the least disturbed run of
each kind, robust on a shared machine), so the ratios compare like with like.
"miss" is a call whose entry is not on disk yet (forward pass + write), with the model's weights
already hashed; "first hash" is the one-time cost of hashing every weight the first time a model is
fingerprinted in a process. A "hit" re-checks the fingerprint (a walk over the parameters' version
counters), reads the entry, verifies its checksum and rebuilds the ActivationCache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def _timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _entry_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def bench_model(label: str, model, tokens: torch.Tensor, names: list[str], root: Path, repeat: int) -> dict:
    """Uncached, miss and hit timings of one call, interleaved round by round so that a change in
    the machine's load hits all three alike; the best (least disturbed) round of each."""
    from entoscope.models.cached import CachedModel
    from entoscope.models.fingerprint import forget, model_fingerprint

    forget(model)
    t0 = time.perf_counter()
    model_fingerprint(model)
    first_hash = time.perf_counter() - t0

    def call(target):
        with torch.no_grad():
            target.run_with_cache(tokens, names_filter=names, return_type="logits")

    call(model)  # warm-up
    warm = CachedModel(model, root / f"{label}-hit")
    call(warm)  # the entry every hit reads
    full = CachedModel(model, root / f"{label}-hit", verify="full")
    unc, miss, hit, hit_full = [], [], [], []
    for r in range(repeat):
        unc += _timed(lambda: call(model), 1)
        cold = CachedModel(model, root / f"{label}-miss{r}")
        miss += _timed(lambda: call(cold), 1)
        assert cold.cache_stats()["misses"] == 1
        hit += _timed(lambda: call(warm), 3)
        hit_full += _timed(lambda: call(full), 1)
    stats = warm.cache_stats()
    assert stats["hits"] == 3 * repeat and stats["misses"] == 1, stats
    assert full.cache_stats()["hits"] == repeat
    t_unc, t_miss, t_hit = min(unc), min(miss), min(hit)
    return {"label": label, "call": f"{tokens.shape[0]}x{tokens.shape[1]} tokens, {len(names)} names",
            "uncached": t_unc, "miss": t_miss, "hit": t_hit, "hit_full": min(hit_full),
            "first_hash": first_hash, "entry": _entry_bytes(root / f"{label}-hit")}


def bench_seed_usage(label: str, model, tokens: torch.Tensor, names: list[str], root: Path, repeat: int) -> dict:
    """The seed page's own usage: gradients enabled, parameters that require grad, no torch.no_grad().
    Baseline: the same uncached call in the same grad mode (what the user pays without the cache)."""
    from entoscope.models.cached import CachedModel

    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(True)
    try:
        assert torch.is_grad_enabled()
        cached = CachedModel(model, root / f"{label}-seed")
        cached.run_with_cache(tokens, names_filter=names)  # the miss that writes the entry
        unc, hit = [], []
        for _ in range(repeat):
            unc += _timed(lambda: model.run_with_cache(tokens, names_filter=names), 1)
            hit += _timed(lambda: cached.run_with_cache(tokens, names_filter=names), 3)
        stats = cached.cache_stats()
        assert stats["hits"] == 3 * repeat and stats["misses"] == 1 and stats["bypassed"] == 0, stats
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
    return {"label": label, "uncached": min(unc), "hit": min(hit)}


def bench_dedupe(label: str, model, prompt: torch.Tensor, width: int, names: list[str], root: Path) -> dict:
    """Bytes of one entry for a prompt run as wide as its patched runs, with and without row dedupe."""
    from entoscope.models.cached import CachedModel

    wide = prompt.repeat(width, 1)
    out = {"label": label, "call": f"1 prompt x {width} rows, {prompt.shape[1]} tokens, {len(names)} names"}
    for flag in (True, False):
        folder = root / f"{label}-dedupe-{flag}"
        cm = CachedModel(model, folder, dedupe_rows=flag)
        with torch.no_grad():
            first = cm.run_with_cache(wide, names_filter=names, return_type="logits")
            again = cm.run_with_cache(wide, names_filter=names, return_type="logits")
        assert torch.equal(first[0], again[0]) and all(torch.equal(first[1][k], again[1][k]) for k in names)
        out["with" if flag else "without"] = _entry_bytes(folder)
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="torch intra-op threads (default: 2, or fewer cores)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--width", type=int, default=8, help="rows of the dedupe run")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds (the best of each is kept)")
    ap.add_argument("--keep", action="store_true", help="keep the cache folders (printed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import DEMO_DIR, from_hf, load_model
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cores, "
          f"python {sys.version.split()[0]}")
    root = Path(tempfile.mkdtemp(prefix="entoscope_bench_cache_"))
    rows, dedupe, seeds = [], [], []
    gen = torch.Generator().manual_seed(0)
    try:
        models = []
        if (DEMO_DIR / "config.json").exists():
            demo = load_model("demo", backend="bridge")
            models.append(("demo", demo, len(demo.tokenizer)))
        else:
            print(f"note: no demo model at {DEMO_DIR} (not trained yet): skipping the demo rows")
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(GPT2Config())
        hf.config._attn_implementation = "eager"
        tok = tiny_tokenizer()
        n_params = sum(p.numel() for p in hf.parameters())
        gpt2 = from_hf(hf, tok, backend="bridge", name="gpt2-small-random", folder=tokenizer_dir())
        print(f"gpt2-small: GPT2Config() defaults, random weights, {n_params / 1e6:.0f}M parameters")
        models.append(("gpt2-small", gpt2, len(tok)))
        for label, model, vocab in models:
            n_layers = model.cfg.n_layers
            names = [f"blocks.{i}.hook_resid_pre" for i in range(n_layers)] + \
                [f"blocks.{i}.attn.hook_z" for i in range(n_layers)]
            tokens = torch.randint(1, vocab, (args.batch, args.seq), generator=gen)
            tokens[:, 0] = 0
            key = label.split()[0].replace("-sized", "")
            rows.append(bench_model(key, model, tokens, names, root, args.repeat))
            seeds.append(bench_seed_usage(key, model, tokens, names, root, args.repeat))
            dedupe.append(bench_dedupe(key, model, tokens[:1], args.width, names, root))
    finally:
        if args.keep:
            print(f"cache folders kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    print()
    head = f"{'model':<12} {'call':<28} {'uncached':>9} {'miss':>9} {'hit':>9} {'hit/unc':>8} {'miss/unc':>9} " \
           f"{'full/unc':>9} {'first hash':>11} {'entry':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['label']:<12} {r['call']:<28} {r['uncached'] * 1e3:>7.1f}ms {r['miss'] * 1e3:>7.1f}ms "
              f"{r['hit'] * 1e3:>7.1f}ms {r['hit'] / r['uncached']:>8.3f} {r['miss'] / r['uncached']:>9.3f} "
              f"{r['hit_full'] / r['uncached']:>9.3f} {r['first_hash'] * 1e3:>9.0f}ms {_mb(r['entry']):>10}")
    print("hit/unc, miss/unc: cost of a hit / a miss over an uncached run_with_cache of the same call; "
          "full/unc: a hit with verify='full' (every weight re-hashed)")
    print()
    print("the seed's usage (gradients enabled, parameters require grad, no torch.no_grad()):")
    for r in seeds:
        print(f"{r['label']:<12} uncached {r['uncached'] * 1e3:>7.1f}ms  hit {r['hit'] * 1e3:>7.1f}ms  "
              f"hit/unc {r['hit'] / r['uncached']:.3f}")
    print()
    head = f"{'model':<12} {'call':<44} {'with dedupe':>12} {'without':>12} {'saved':>7}"
    print("bytes of one entry, one prompt run as wide as its patched runs:")
    print(head)
    print("-" * len(head))
    for d in dedupe:
        print(f"{d['label']:<12} {d['call']:<44} {_mb(d['with']):>12} {_mb(d['without']):>12} "
              f"{1 - d['with'] / d['without']:>6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
