"""`es.inspect` on SmolLM2-135M (the real model: scripts/fetch_real_models.py) for a 20-token prompt on one thread,
after loading, against the same computations written by hand on TransformerLens in the same script: one
`run_with_cache`, the top next tokens at every position, the logit lens over every layer x position
(`accumulated_resid(apply_ln=True)` through W_U, top tokens, the answer's rank, KL to the output), every head's
attention pattern, and DLA at the last position (`stack_head_results` / `decompose_resid` with apply_ln=True on
the logit-difference direction). With --counterfactual, also exact patching of resid_pre over layer x position:
by hand a `run_with_hooks` per cell (a full forward each; timed on every tenth cell and scaled to all, said so),
against inspect with the counterfactual (its patched runs start at the patched layer and position).

    python benchmarks/bench_inspect.py [--repeats 3] [--counterfactual]

Both sides run on the same TransformerBridge object; each time is the best of --repeats runs (the machine is shared).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import set_threads  # noqa: E402

import torch  # noqa: E402

PROMPT = "The Eiffel Tower is in Paris, and the Louvre is also located in the city of"
COUNTERFACTUAL = "The Eiffel Tower is in Paris, and the Kremlin is also located in the city of"
ANSWER, WRONG = " Paris", " Moscow"


def by_hand(model, tokens, answer, wrong, k=5):
    """The views of es.inspect written on TransformerLens: one run_with_cache and the maths on its cache."""
    n_layers = model.cfg.n_layers
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        logp = logits[0].float().log_softmax(-1)
        predictions = logp.topk(k, dim=-1)
        acc = cache.accumulated_resid(layer=-1, incl_mid=False, apply_ln=True)[1:, 0]  # every resid_post [L, T, d]
        lens = acc @ model.W_U + model.b_U
        lens_logp = lens.log_softmax(-1)
        lens_top = lens_logp.topk(k, dim=-1)
        rank = (lens > lens[..., answer:answer + 1]).sum(-1)
        kl = (logp.exp() * (logp - lens_logp)).sum(-1)
        patterns = torch.stack([cache["pattern", L][0] for L in range(n_layers)]).float().cpu().numpy()
        direction = model.W_U[:, answer] - model.W_U[:, wrong]
        heads = cache.stack_head_results(layer=-1, apply_ln=True, pos_slice=-1)[:, 0]  # [L * H, d]
        rest = cache.decompose_resid(layer=-1, apply_ln=True, pos_slice=-1, mode="mlp", incl_embeds=True)[:, 0]
        dla = (heads @ direction, rest @ direction)
    return predictions, lens_top, rank, kl, patterns, dla


def patched_by_hand(model, clean, corrupt, answer, wrong, every=10):
    """resid_pre of each (layer, position) of the corrupt run set to the clean run's, one full forward per cell,
    on every `every`-th cell: (wall seconds per cell, cells timed)."""
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
    cells = [(L, p) for L in range(model.cfg.n_layers) for p in range(clean.shape[1])][::every]
    t = time.perf_counter()
    for L, p in cells:
        def hook(x, hook, L=L, p=p):
            x[:, p] = cache[f"blocks.{L}.hook_resid_pre"][:, p]
            return x
        with torch.no_grad():
            out = model.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{L}.hook_resid_pre", hook)])
        float(out[0, -1, answer] - out[0, -1, wrong])
    return (time.perf_counter() - t) / len(cells), len(cells)


def best(fn, repeats):
    """(wall, CPU) seconds of the fastest of `repeats` runs (CPU: this process's; the machine is shared, so the
    CPU time is the work and the wall time what a user waited)."""
    times = []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - t, time.process_time() - c))
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--counterfactual", action="store_true", help="also exact patching of the pair")
    args = ap.parse_args()
    threads = set_threads(1)
    import entoscope as es

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from fetch_real_models import fetch

    model = es.load_model(str(fetch("smollm2-135m")))
    a = es.adapt(model)
    tokens = torch.tensor([a.tokenize(PROMPT)])
    assert tokens.shape[1] == 20, tokens.shape
    answer, wrong = a.token_id(ANSWER), a.token_id(WRONG)
    es.inspect(model, PROMPT, answer=ANSWER, wrong=WRONG)  # warm-up: the one-time checks, vocabulary strings
    by_hand(model, tokens, answer, wrong)
    (tl_s, tl_cpu) = best(lambda: by_hand(model, tokens, answer, wrong), args.repeats)
    (es_s, es_cpu) = best(lambda: es.inspect(model, PROMPT, answer=ANSWER, wrong=WRONG), args.repeats)
    print(f"es.inspect on SmolLM2-135M, a {tokens.shape[1]}-token prompt with an answer and a wrong answer, "
          f"{threads} thread, best of {args.repeats} (wall / CPU)")
    print(f"  TransformerLens by hand (run_with_cache + lens, attention, DLA)  {tl_s:.2f} s / {tl_cpu:.2f} s")
    print(f"  es.inspect (the same views, as tables)                           {es_s:.2f} s / {es_cpu:.2f} s")
    print(f"  ratio (by hand / es.inspect): {tl_s / es_s:.2f}x wall, {tl_cpu / es_cpu:.2f}x CPU")
    if args.counterfactual:
        corrupt = torch.tensor([a.tokenize(COUNTERFACTUAL)])
        assert corrupt.shape == tokens.shape, (corrupt.shape, tokens.shape)
        es.inspect(model, PROMPT, answer=ANSWER, wrong=WRONG, counterfactual=COUNTERFACTUAL)  # warm-up
        es_cf, es_cf_cpu = best(lambda: es.inspect(model, PROMPT, answer=ANSWER, wrong=WRONG,
                                                    counterfactual=COUNTERFACTUAL), args.repeats)
        per_cell, timed = patched_by_hand(model, tokens, corrupt, answer, wrong)
        cells = model.cfg.n_layers * tokens.shape[1]
        hand = tl_s + per_cell * cells
        print(f"with the counterfactual: exact patching of resid_pre over {cells} cells (layer x position)")
        print(f"  TransformerLens by hand: the views + one run_with_hooks per cell ({per_cell:.3f} s a cell, timed on "
              f"{timed} cells) {hand:.1f} s")
        print(f"  es.inspect with counterfactual=                              {es_cf:.1f} s (CPU {es_cf_cpu:.1f} s)")
        print(f"  ratio (by hand / es.inspect): {hand / es_cf:.2f}x")


if __name__ == "__main__":
    main()
