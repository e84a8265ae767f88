"""Is the Jacobian lens informative earlier than the logit lens on a real model? (docs/lens.md has the numbers.)

Fits a Jacobian lens on SmolLM2-135M (30 layers) for layers 18, 22 and 26 on 2 built-in corpus texts (40 tokens,
skip_first 16), then reads 16 IOI prompts' last tokens with the logit and the Jacobian lens: per layer the mean
KL(final || lens) and the share of prompts whose answer is the lens's top token, each with its 95% interval.
About 12 minutes on one CPU thread.

    python scripts/check_jacobian_lens_real.py [FOLDER]   # default /root/.cache/entoscope/real-models/smollm2-135m
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch


def main() -> None:
    torch.set_num_threads(1)
    import entoscope as es

    folder = sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/entoscope/real-models/smollm2-135m"
    if not Path(folder).exists():
        print(f"no model at {folder}")
        return
    model = es.load_model(folder)
    layers = [18, 22, 26]
    lens = es.JacobianLens.fit(model, es.tasks.get("corpus", n=2, seed=5, sentences=3), max_length=40,
                               skip_first=16, layers=layers)
    print(lens.fit_result.table.to_string())
    path = lens.save(Path(tempfile.mkdtemp()) / "lens")
    ioi = es.tasks.get("ioi", n=16, seed=1, tokenizer=model.tokenizer)
    sites = es.Sites(activation="resid_post", over=["layer"], layers=layers + [model.cfg.n_layers - 1])
    for method, kw in (("logit", {}), ("jacobian", {"lens": str(path)})):
        r = es.Lens(method=method, sites=sites, **kw).run(model, ioi, quiet=True)
        print(method)
        print(r.table[["layer", "kl_mean", "kl_mean_ci_low", "kl_mean_ci_high", "target_top1", "target_top1_ci_low",
                       "target_top1_ci_high", "top1_token"]].to_string())


if __name__ == "__main__":
    main()
