"""`entoscope train-sae`: train one SAE (or transcoder) on a model's activations and save it as a SAELens folder.

    entoscope train-sae --model demo --site resid_post.1 --out sae/resid_post.1
    entoscope train-sae --model demo --site mlp_in.1 --target mlp_out.1 --out sae/transcoder.1
    entoscope train-sae --model demo --site resid_post.0 --data '{task: ioi, n: 256}' --k 8 --steps 500 --out x

Without --data the prompts are the built-in tasks' (IOI, induction, facts, greater-than: --n examples
each, prompts and counterfactuals, seeds from --data-seed). Seeded (--seed) and single-threaded by
default (--threads 1), so a run repeats exactly. Writes cfg.json, sae_weights.safetensors and
training_report.json (L0, explained variance, dead features, next-token and answer loss recovered, on
held-out prompts: the built-in tasks' seed-0 ones).

Every option is checked before the model loads (sizes, rates and the L1 coefficient finite and in
range, --site / --target activations a dictionary can read and write, in forward order, --out a folder
that is not a file); a folder already holding a dictionary is replaced only with --overwrite, and is
written whole or not at all (results/folder.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

DEFAULT_TASKS = ("ioi", "induction", "facts", "greater_than")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--site", required=True, help="the activation read, e.g. resid_post.1 (a transcoder: mlp_in.1)")
    p.add_argument("--target", default=None, help="a transcoder's output activation, e.g. mlp_out.1 (default: --site)")
    p.add_argument("--data", default=None, help="a task name, a file, or YAML (default: the built-in tasks' mix)")
    p.add_argument("--n", type=int, default=512, help="examples per built-in task (without --data)")
    p.add_argument("--data-seed", type=int, default=2_000_000, help="seed of the built-in tasks' prompts")
    p.add_argument("--architecture", choices=["topk", "standard"], default=None,
                   help="topk (k largest pre-activations) or standard (ReLU + L1 penalty); default: topk for an "
                   "SAE, standard for a transcoder (SAELens's format has no top-k transcoder)")
    p.add_argument("--d-sae", type=int, default=512, help="number of features")
    p.add_argument("--k", type=int, default=16, help="topk: active features per token")
    p.add_argument("--l1", type=float, default=3.0, help="standard: L1 coefficient (on sum_i f_i ||W_dec,i||)")
    p.add_argument("--steps", type=int, default=2000, help="optimiser (Adam) steps")
    p.add_argument("--batch-tokens", type=int, default=1024, help="activation rows (tokens) drawn per step")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the rows drawn")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: runs repeat exactly)")
    p.add_argument("--out", required=True, help="folder to write (SAELens format)")
    p.add_argument("--overwrite", action="store_true", help="replace a dictionary already saved in --out")


def config_of(args: argparse.Namespace) -> Any:
    from .train import TrainConfig

    arch = args.architecture or ("standard" if args.target and args.target != args.site else "topk")
    return TrainConfig(architecture=arch, d_sae=args.d_sae, k=args.k, l1=args.l1, steps=args.steps,
                       batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed)


def check_args(args: argparse.Namespace) -> None:
    """Every option checked before the model loads: sizes and rates, sites, seeds, threads, --out."""
    from ..errors import ConfigError
    from ..results.folder import DICTIONARY, check_out
    from .train import check_sites

    for name in ("threads", "n"):
        v = getattr(args, name)
        if v < 1 and (name == "threads" or args.data is None):
            raise ConfigError(f"--{name} must be at least 1, got {v}", code="bad_arguments",
                              remedy=f"e.g. --{name} {1 if name == 'threads' else 512}")
    if args.data_seed < 0:
        raise ConfigError(f"--data-seed must be >= 0, got {args.data_seed}", code="bad_arguments",
                          remedy="e.g. --data-seed 2000000")
    config_of(args).check()
    check_sites(args.site, args.target)
    check_out(args.out, overwrite=args.overwrite, output=DICTIONARY)


def run(args: argparse.Namespace, model: Any, data_spec: Any) -> int:
    from ..models.adapter import adapt
    from ..results.folder import DICTIONARY, writing_run
    from ..models.dictionaries.saelens import write_folder
    from .train import prompts_of, task_data, task_prompts, train_dictionary

    check_args(args)
    torch.set_num_threads(args.threads)
    m = adapt(model)
    if data_spec is None:
        prompts = task_prompts(model, list(DEFAULT_TASKS), n=args.n, seed=args.data_seed)
    else:
        from ..data.loading import load_data

        data = load_data(data_spec, tokenizer=m.tokenizer)
        prompts = prompts_of(m, [data])
    heldout = task_data(model, list(DEFAULT_TASKS), n=64, seed=0)
    d, report = train_dictionary(model, prompts, args.site, args.target, config_of(args), heldout=heldout)
    with writing_run(args.out, overwrite=args.overwrite, output=DICTIONARY) as partial:  # whole, or not at all
        write_folder(d, partial, model_name=m.name)
        (partial / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    folder = Path(args.out)
    q = report["quality"]
    print(f"{d.hook_in} -> {d.hook_out}: {d.d_sae} features, L0 {q['l0']:.1f}, explained variance "
          f"{q['explained_variance']:.3f}, dead {q['dead_fraction']:.1%}, answer loss recovered "
          f"{q['answer_loss_recovered']:.3f} ({report['quality_on']}); saved {Path(folder)}")
    return 0
