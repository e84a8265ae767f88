"""The lens comparison and coordinate patching on a real model (docs/lens.md has the numbers).

On SmolLM2-135M (30 layers): `lens_comparison` on 16 IOI prompts' last tokens for layers 20, 25 and 29, its
Jacobian lens fitted in the run on 2 built-in corpus texts (32 tokens, skip_first 8; no `lens` given); then
`coordinate_patching` with that lens at layers 20 and 25 (swap the answer's and the wrong answer's coefficients)
on the same prompts. Prints both tables, the takeaways and the CPU time. About 10 minutes on one CPU thread.

    python scripts/check_lens_comparison_real.py [FOLDER]   # default /root/.cache/entoscope/real-models/smollm2-135m
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch


def main() -> None:
    torch.set_num_threads(1)
    import entoscope as es

    folder = sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/entoscope/real-models/smollm2-135m"
    if not Path(folder).exists():
        print(f"no model at {folder}")
        return
    pd.set_option("display.width", 250)
    model = es.load_model(folder)
    ioi = es.tasks.get("ioi", n=16, seed=1, tokenizer=model.tokenizer)
    t0, c0 = time.perf_counter(), time.process_time()
    compared = es.LensComparison(layers=[20, 25, 29], fit_data={"task": "corpus", "n": 2, "seed": 5, "params": {"sentences": 3}},
                                 fit_max_length=32, fit_skip_first=8).run(model, ioi)
    t1, c1 = time.perf_counter(), time.process_time()
    print(compared.table.to_string())
    print(compared.takeaway)
    print(f"lens_comparison: {t1 - t0:.0f} s wall, {c1 - c0:.0f} s CPU")
    path = compared.extra["jacobian_lens"].save(Path(tempfile.mkdtemp()) / "lens")
    sites = es.Sites(activation="resid_post", over=["layer"], layers=[20, 25], positions=[-1])
    patched = es.CoordinatePatching(lens=str(path), sites=sites, edit="swap").run(model, ioi)
    t2, c2 = time.perf_counter(), time.process_time()
    cols = ["site", "metric_base", "effect", "effect_ci_low", "effect_ci_high", "control_effect",
            "control_effect_ci_low", "control_effect_ci_high", "minus_control_ci_low", "minus_control_ci_high",
            "answer_in_support", "answer_in_support_ci_low", "answer_in_support_ci_high", "error", "beats_control"]
    print(patched.table[cols].to_string())
    print(patched.takeaway)
    print(f"coordinate_patching: {t2 - t1:.0f} s wall, {c2 - c1:.0f} s CPU")


if __name__ == "__main__":
    main()
