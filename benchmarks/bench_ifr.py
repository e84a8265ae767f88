"""Benchmark of information flow routes (Ferrando & Voita 2024) on a TransformerBridge: entoscope's
InformationFlowRoutes against a straightforward implementation of the paper's method written here.

    python benchmarks/bench_ifr.py                 # GPT-2-small-sized bridge, 1 thread, 24-token prompts
    python benchmarks/bench_ifr.py --curves        # one prompt of 16, 64 and 256 tokens
    python benchmarks/bench_ifr.py --quick         # 4 prompts, 1 repeat: a smoke run

Model: GPT-2 small's shape (12 layers, 12 heads, d_model 768, vocabulary 50257), random weights, built
offline as a TransformerBridge. Prompts: random token ids, BOS first. tau 0.04, head granularity.

(a) straightforward, per prompt: `run_with_cache`, then per layer the parts of the attention node
    resid_mid@i (the residual, every head h and source j: A^h[i, j] v^h_j W_O[h] as one [T, H, T, d]
    tensor, queries chunked to 2^25 floats, and b_O) and of the MLP node resid_post@i (resid_mid, mlp_out),
    the proximity max(||y||_1 - ||y - z||_1, 0) of each part to its node and its share of the node's
    total; then the routes top-down from the last position's last node, keeping the edges above tau.
(b) entoscope.InformationFlowRoutes(tau=0.04): prompts batched, one read-only run (no logits but the last
    position's), importances computed top-down only at the nodes the routes reach (and the last position),
    sources j <= i only.
Both give, per prompt, the kept edges and their importances: they must be the same edges, importances
within 1e-5. Times are medians of --repeat runs (one prompt) and of --repeat-dataset runs (the dataset);
peak memory is the largest rise, during a call, of the bytes malloc has handed out (glibc's mallinfo2,
sampled every millisecond) above what was allocated when the call began.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import MEMORY_MEASURE, PeakMemory, gpt2_small, random_prompts, set_threads

TAU = 0.04


def straightforward(model, prompts: list[tuple[int, ...]], tau: float = TAU) -> list[dict]:
    """(a): per prompt, {(source node, target node, component): importance} of the kept edges."""
    import torch

    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    out = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = torch.tensor([prompt])
            T = tokens.shape[1]
            _, cache = model.run_with_cache(tokens)
            shares = []
            for L in range(n_layers):
                pre, mid = cache[f"blocks.{L}.hook_resid_pre"][0], cache[f"blocks.{L}.hook_resid_mid"][0]
                post, mlp = cache[f"blocks.{L}.hook_resid_post"][0], cache[f"blocks.{L}.hook_mlp_out"][0]
                pattern, v = cache[f"blocks.{L}.attn.hook_pattern"][0], cache[f"blocks.{L}.attn.hook_v"][0]
                attn = model.blocks[L].attn
                v = v.repeat_interleave(n_heads // v.shape[1], dim=1)  # [T, H, d_head]
                vo = torch.einsum("jhd,hdm->jhm", v, attn.W_O)  # [T, H, d]
                chunk = max(1, 2**25 // (n_heads * T * mid.shape[-1]))
                prox_attn = []
                for q in range(0, T, chunk):
                    parts = torch.einsum("hij,jhm->ihjm", pattern[:, q:q + chunk], vo)  # [q, H, T, d]
                    y = mid[q:q + chunk, None, None]
                    prox_attn.append((y.abs().sum(-1) - (y - parts).abs().sum(-1)).clamp(min=0))
                prox_attn = torch.cat(prox_attn)  # [T, H, T]
                prox = lambda z, y: (y.abs().sum(-1) - (y - z).abs().sum(-1)).clamp(min=0)  # noqa: E731
                p_res, p_bias = prox(pre, mid), prox(attn.b_O, mid)
                total = p_res + p_bias + prox_attn.sum((1, 2))
                den = torch.where(total > 0, total, torch.ones_like(total))
                p_mlp, p_mres = prox(mlp, post), prox(mid, post)
                den_post = torch.where(p_mlp + p_mres > 0, p_mlp + p_mres, torch.ones_like(p_mlp))
                shares.append({"attn": prox_attn / den[:, None, None], "res": p_res / den, "bias": p_bias / den,
                               "mlp": p_mlp / den_post, "mres": p_mres / den_post})
            out.append(_routes(shares, T, tau))
    return out


def _routes(shares: list[dict], T: int, tau: float) -> dict:
    """Top-down from resid_post.(L-1)@(T-1): every edge above tau into a node already reached."""
    def pre(L: int, p: int) -> str:
        return f"resid_pre.0@{p}" if L == 0 else f"resid_post.{L - 1}@{p}"

    edges = {}
    reached_post = {T - 1}
    for L in range(len(shares) - 1, -1, -1):
        s = shares[L]
        reached_mid = set()
        for i in sorted(reached_post):
            for key, value in (("residual", s["mres"][i]), (f"m{L}", s["mlp"][i])):
                if value > tau:
                    edges[(f"resid_mid.{L}@{i}", f"resid_post.{L}@{i}", key)] = float(value)
                    reached_mid.add(i)
        reached_pre = set()
        for i in sorted(reached_mid):
            if s["res"][i] > tau:
                edges[(pre(L, i), f"resid_mid.{L}@{i}", "residual")] = float(s["res"][i])
                reached_pre.add(i)
            for h, j in (s["attn"][i] > tau).nonzero().tolist():
                edges[(pre(L, j), f"resid_mid.{L}@{i}", f"a{L}.h{h}")] = float(s["attn"][i, h, j])
                reached_pre.add(j)
        reached_post = reached_pre
    return edges


def ours(model, prompts: list[tuple[int, ...]], tau: float = TAU) -> list[dict]:
    """(b): the same edges from entoscope's result (its per-prompt edge table)."""
    import entoscope as es
    from entoscope.data import Dataset, Example

    data = Dataset("bench", tuple(Example(p) for p in prompts))
    table = es.InformationFlowRoutes(tau=tau, drawn_routes=0).run(model, data, quiet=True).per_prompt
    out: list[dict] = [{} for _ in prompts]
    for r in table.itertuples():
        out[r.example][(r.source, r.target, r.component)] = float(r.importance)
    return out


def compare(a: list[dict], b: list[dict]) -> tuple[bool, float, int]:
    """(same edge sets, largest importance difference, edges in all)."""
    same = all(set(x) == set(y) for x, y in zip(a, b))
    gap = max((abs(x[k] - y[k]) for x, y in zip(a, b) for k in x if k in y), default=0.0)
    return same, gap, sum(len(x) for x in a)


def timed(fn, *args, repeat: int) -> tuple[float, float]:
    """(median seconds, largest peak memory rise in MiB) of `repeat` calls."""
    times, peak = [], 0
    for _ in range(repeat):
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        peak = max(peak, mem.rise)
    return statistics.median(times), peak / 2**20


def table(model, args) -> None:
    head = f"{'prompts':>7}  {'method':<34} {'time':>9} {'ratio':>7} {'peak mem':>9}  same edges, max |diff|"
    print("\n" + head + "\n" + "-" * len(head), flush=True)
    for n in (1, args.prompts):
        prompts = random_prompts(n, args.length, seed=n)
        ours(model, prompts[:1])  # warm-up (vocabulary strings, kernels)
        same, gap, edges = compare(straightforward(model, prompts), ours(model, prompts))
        repeat = args.repeat if n == 1 else args.repeat_dataset
        ta, ma = timed(straightforward, model, prompts, repeat=repeat)
        tb, mb = timed(ours, model, prompts, repeat=repeat)
        print(f"{n:>7}  {'(a) straightforward, per prompt':<34} {ta:>8.2f}s {1:>6.2f}x {ma:>7.0f}MiB", flush=True)
        print(f"{n:>7}  {'(b) entoscope InformationFlowRoutes':<34} {tb:>8.2f}s {ta / tb:>6.2f}x {mb:>7.0f}MiB  "
              f"{same} ({edges} edges), {gap:.1e}", flush=True)


def curves(model, args) -> None:
    head = f"{'tokens':>6}  {'(a) time':>9} {'(b) time':>9} {'ratio':>7} {'(a) peak':>9} {'(b) peak':>9}  same edges"
    print("\n" + head + "\n" + "-" * len(head), flush=True)
    for T in (16, 64, 256):
        prompts = random_prompts(1, T, seed=T)
        same, gap, edges = compare(straightforward(model, prompts), ours(model, prompts))
        ta, ma = timed(straightforward, model, prompts, repeat=1)
        tb, mb = timed(ours, model, prompts, repeat=1)
        print(f"{T:>6}  {ta:>8.2f}s {tb:>8.2f}s {ta / tb:>6.2f}x {ma:>7.0f}MiB {mb:>7.0f}MiB  {same} ({edges} edges), "
              f"{gap:.1e}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--length", type=int, default=24, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=32, help="prompts of the dataset run")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each method on one prompt (median)")
    ap.add_argument("--repeat-dataset", type=int, default=1, help="runs of each method on the dataset")
    ap.add_argument("--curves", action="store_true", help="one prompt of 16, 64 and 256 tokens")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 1 repeat: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.repeat = 4, 1
    set_threads(args.threads)
    import torch
    from importlib.metadata import version

    print(f"torch {torch.__version__}, transformer-lens {version('transformer-lens')}, {torch.get_num_threads()} "
          f"intra-op threads, python {sys.version.split()[0]}; peak memory: {MEMORY_MEASURE}")
    t0 = time.perf_counter()
    model = gpt2_small("bridge")
    print(f"model: GPT-2-small-sized random bridge, built in {time.perf_counter() - t0:.0f} s; prompts of "
          f"{args.length} tokens; tau {TAU}")
    (curves if args.curves else table)(model, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
