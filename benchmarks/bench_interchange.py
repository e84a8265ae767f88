"""Benchmark of DAS over a grid: es.Interchange against one TransformerLens 4.3 fit_das call per cell.

    python benchmarks/bench_interchange.py              # demo model, 3 layers x 3 roles, 1 thread
    python benchmarks/bench_interchange.py --quick      # 8 prompts, 2 epochs: a smoke run

Model: the bundled demo model (3 layers, d_model 128) as a TransformerBridge. Data: ioi, n prompts (2n pairs:
each prompt and its name-swapped copy, both directions); half train DAS, half measure IIA. Grid: resid_post
at layers 0, 1, 2 x roles S1, S2, END (9 cells); DAS rank r, the same epochs, batch size, learning rate and
seed both ways.

Compared, in this one process, on the same intra-op threads (the same work both ways: per cell a DAS subspace
trained on the training pairs, then its IIA on the held-out pairs):
  (a) per cell: transformer_lens.tools.analysis.fit_das (its own source read, then epochs of full forwards and
      backwards), then collect_activations + intervened_logits on the held-out pairs;
  (b) es.Interchange(bases=["das"], placebo=False).run: one read of every prompt shared by the 9 cells,
      training runs that start at the cell's block from one cached forward, the class logits only (it also
      measures the full-vector interchange of every cell, which (a) does not).
Reported: CPU time (process_time) and wall time of each, the ratio (a) / (b), and both IIAs per cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import set_threads  # noqa: E402

ROLES = ["S1", "S2", "END"]


def per_cell(model, adapter, pairs, td, held, rank, epochs, batch, lr, seed):
    """(a): one fit_das call per cell, its IIA on the held-out pairs by TransformerLens's own intervened_logits."""
    import numpy as np
    import torch
    from transformer_lens.tools.analysis import SubspaceInterchange, collect_activations, fit_das, intervened_logits

    from entoscope.data.tokenized import pad

    tokens, lengths = pad(td.prompts, 0)
    classes = torch.tensor([[adapter.token_id(c) for c in row] for row in pairs.classes])
    by_row = {tuple(tokens[i].tolist()): i for i in range(len(td.prompts))}
    roles = td.roles

    def task_logits(batch_tokens):
        rows = [by_row[tuple(r.tolist())] for r in batch_tokens]
        logits = model(batch_tokens)
        at = logits[torch.arange(len(rows)), lengths[rows] - 1]
        return at.gather(1, classes[pairs.base[rows]].to(at.device))

    train, test = np.flatnonzero(~held), np.flatnonzero(held)
    targets = torch.from_numpy(pairs.target)
    out = {}
    for role in ROLES:
        pos = roles.positions[:, roles.index(role)] if role != "END" else lengths - 1
        for layer in range(3):
            hook = adapter.hook_name(f"resid_post.{layer}")
            b, s = pairs.base, pairs.source
            fit = fit_das(model, hook, tokens[b[train]], tokens[s[train]], targets[train], task_logits, rank=rank,
                          base_positions=pos[b[train]], source_positions=pos[s[train]], epochs=epochs,
                          batch_size=batch, lr=lr, seed=seed)
            src = collect_activations(model, hook, tokens[s[test]], task_logits, positions=pos[s[test]])
            logits = intervened_logits(model, hook, SubspaceInterchange(fit.subspace), tokens[b[test]], src,
                                       task_logits, positions=pos[b[test]])
            out[f"resid_post.{layer}@{role}"] = float((logits.argmax(-1) == targets[test]).double().mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=20)  # fit_das's default
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.epochs = 8, 2
    set_threads(args.threads)
    import entoscope as es
    from entoscope.data.tokenized import tokenize_data
    from entoscope.interchange.causal import build_pairs, split
    from entoscope.models.adapter import adapt

    model = es.load_model("demo")
    adapter = adapt(model)
    data = es.tasks.ioi(n=args.prompts, seed=0)
    op = es.Interchange(activation="resid_post", layers=[0, 1, 2], positions=ROLES, bases=["das"], placebo=False,
                        rank=args.rank, epochs=args.epochs, das_batch_size=16, lr=0.05, seed=0)
    op.plan(model, data)  # the once-per-model checks, outside both timings
    pairs = build_pairs(data, None)
    td = tokenize_data(adapter, pairs.prompts)
    held = split(pairs, op.test_share, op.seed)

    c0, w0 = time.process_time(), time.perf_counter()
    theirs = per_cell(model, adapter, pairs, td, held, args.rank, args.epochs, 16, 0.05, 0)
    ca, wa = time.process_time() - c0, time.perf_counter() - w0
    c0, w0 = time.process_time(), time.perf_counter()
    result = op.run(model, data, quiet=True)
    cb, wb = time.process_time() - c0, time.perf_counter() - w0
    t = result.table.set_index(["site", "basis"])
    print(f"{len(pairs)} pairs ({int(held.sum())} held out), 9 cells, rank {args.rank}, {args.epochs} epochs, "
          f"{args.threads} thread(s)")
    print(f"(a) fit_das per cell: CPU {ca:.1f} s, wall {wa:.1f} s")
    print(f"(b) es.Interchange:   CPU {cb:.1f} s, wall {wb:.1f} s")
    print(f"ratio (a)/(b): CPU {ca / cb:.2f}x, wall {wa / wb:.2f}x")
    for site, iia in theirs.items():
        row = t.loc[(site, "das")]
        print(f"  {site:18s} IIA fit_das {iia:.3f}  entoscope {row['iia']:.3f} "
              f"[{row['iia_ci_low']:.3f}, {row['iia_ci_high']:.3f}]")


if __name__ == "__main__":
    main()
