"""Train the dictionaries bundled for the demo model: a top-k SAE on resid_post of each layer and a
ReLU transcoder for each MLP (mlp_in.L -> mlp_out.L), in SAELens's folder format, with training_report.json.

    HF_HUB_OFFLINE=1 python scripts/train_demo_dictionaries.py --out src/entoscope/demo/dictionaries

Each is `entoscope train-sae` with the same options (the report lists them). Training prompts are the
demo tasks' generators (IOI, induction, facts, greater-than; prompts and counterfactuals) on seeds
2,000,000 + i, never the evaluation seeds; quality is measured on the tasks' default prompts (seed 0,
64 examples each). About 5 minutes on one thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

try:
    import entoscope as es
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import entoscope as es
from entoscope.dictionaries import save_dictionary
from entoscope.dictionaries.train import TrainConfig, task_data, task_prompts, train_dictionary

TASKS = ["ioi", "induction", "facts", "greater_than"]
TRAIN_SEED = 2_000_000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=512, help="training examples per task")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--d-sae", type=int, default=512)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--l1", type=float, default=3.0, help="transcoders (ReLU + L1): the L1 coefficient")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = es.load_model("demo")
    n_layers = model.cfg.n_layers
    train = task_prompts(model, TASKS, n=args.n, seed=TRAIN_SEED)
    heldout = task_data(model, TASKS, n=64, seed=0)
    jobs = [(f"resid_post.{L}", None, f"resid_post.{L}") for L in range(n_layers)]
    jobs += [(f"mlp_in.{L}", f"mlp_out.{L}", f"transcoder.{L}") for L in range(n_layers)]
    reports = {}
    start = time.perf_counter()
    for i, (site, target, folder) in enumerate(jobs):
        cfg = TrainConfig(architecture="standard" if target else "topk", d_sae=args.d_sae, k=args.k, l1=args.l1,
                          steps=args.steps, seed=args.seed + i)
        d, report = train_dictionary(model, train, site, target, cfg, heldout=heldout, name=f"demo/{folder}")
        save_dictionary(d, Path(args.out) / folder, model_name="entoscope-demo")
        reports[folder] = report
        q = report["quality"]
        print(f"{folder:16s} L0 {q['l0']:5.1f}  explained variance {q['explained_variance']:.3f}  "
              f"dead {q['dead_fraction']:.1%}  answer loss {q['answer_loss_clean']:.3f} -> {q['answer_loss_spliced']:.3f} "
              f"(zeroed {q['answer_loss_zeroed']:.3f}, recovered {q['answer_loss_recovered']:.3f})  ({report['seconds']} s)",
              flush=True)
    summary = {"model": "demo (plain TransformerBridge activations)", "tasks": TASKS, "train_examples_per_task": args.n,
               "train_seed": TRAIN_SEED, "heldout": "the tasks' default prompts (seed 0), 64 examples each, "
               "prompts and counterfactuals, every position but the first", "threads": args.threads,
               "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
               "python": platform.python_version(), "dictionaries": reports}
    (Path(args.out) / "training_report.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
