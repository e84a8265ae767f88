"""Benchmark of the Ray executor: EAP-IG and an exact patching sweep over 64 prompt pairs on a
GPT-2-small-sized random model, in-process vs Ray with 1 and with 2 workers (1 torch thread each).

    python benchmarks/bench_ray.py                 # 64 pairs; EAP-IG 5 steps; exact resid_pre x layer x position
    python benchmarks/bench_ray.py --quick         # 16 pairs, a smoke run

Targets (docs/scale.md): 2 workers vs in-process >= 1.6x on 2 cores; Ray with 1 worker vs in-process
<= 1.15x (its overhead: shipping shards, Parquet files, the merge). The model (transformers' GPT2Config
defaults: 12 layers, 12 heads, d_model 768, 32,491 edges; the tiny test tokenizer's vocabulary) is built
with random weights and saved to a temporary folder, which every worker loads (no downloads). Worker
start-up (Ray's, and each worker loading the model) is timed apart: a warm-up run on 2 pairs comes first
on each pool, as a notebook's second run would see it; the three executors run one after the other
(in-process, 1 worker, 2 workers), each on both operations. Every Ray table is checked equal to
in-process.
The machine is shared: the load average before and after is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ENTOSCOPE_QUIET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def save_model(folder: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), bos_token_id=0, eos_token_id=0, pad_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def pairs(n: int, seq: int, vocab: int):
    from entoscope.data import Dataset, Example

    g = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(n):
        p = [0] + torch.randint(1, vocab, (seq - 1,), generator=g).tolist()
        c = list(p)
        c[1: seq // 3] = torch.randint(1, vocab, (seq // 3 - 1,), generator=g).tolist()
        examples.append(Example(prompt=tuple(p), counterfactual=tuple(c), answers=(p[2],), wrong_answers=(p[3],)))
    return Dataset("bench", tuple(examples))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--seq", type=int, default=12, help="tokens per prompt")
    p.add_argument("--steps", type=int, default=5, help="EAP-IG integration steps")
    p.add_argument("--quick", action="store_true", help="16 pairs (2 batches), 2 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.steps = 16, 2
    torch.set_num_threads(1)
    import pandas as pd

    import entoscope as es

    load_before = os.getloadavg()
    folder = tempfile.mkdtemp(prefix="bench-ray-gpt2-")
    save_model(folder)
    model = es.load_model(folder)
    vocab = es.adapt(model).structure.d_vocab
    data, warm = pairs(args.prompts, args.seq, vocab), pairs(2, args.seq, vocab)
    ops = {"eap_ig": es.Circuits(method="eap_ig", steps=args.steps, faithfulness=[], n_edges=100),
           "exact patching": es.Patching(method="exact", sites=es.Sites(activation="resid_pre",
                                                                        over=["layer", "position"]))}
    print(f"model: GPT-2-small-sized random bridge from {folder}; {args.prompts} pairs of {args.seq} tokens; "
          f"1 torch thread per process; {os.cpu_count()} CPUs; load average before {load_before[0]:.1f}")
    executors = {"in-process": None, "ray 1 worker": es.Ray(workers=1), "ray 2 workers": es.Ray(workers=2)}
    start, times, tables = {}, {}, {}
    for name, ex in executors.items():  # one pool at a time (a new pool ends the last): warm it, then time it
        if ex is not None:
            t0 = time.perf_counter()
            ops["eap_ig"].run(model, warm, executor=ex, quiet=True)
            start[name] = time.perf_counter() - t0
        for op_name, op in ops.items():
            t0 = time.perf_counter()
            result = op.run(model, data, executor=ex, quiet=True)
            times[op_name, name] = time.perf_counter() - t0
            tables[op_name, name] = result.table
    rows = []
    for op_name in ops:
        for name in executors:
            pd.testing.assert_frame_equal(tables[op_name, "in-process"], tables[op_name, name])  # bit for bit
        base, one, two = (times[op_name, k] for k in executors)
        rows.append({"operation": op_name, "in-process s": base, "ray1 s": one, "ray2 s": two,
                     "2 workers speed-up": base / two, "1 worker overhead": one / base,
                     "s/prompt in-process": base / args.prompts, "s/prompt 2 workers": two / args.prompts})
    frame = pd.DataFrame(rows)
    with pd.option_context("display.float_format", "{:.3f}".format, "display.width", 160):
        print(frame.to_string(index=False))
    print("worker start-up (Ray, model load, first 2-pair run): " +
          ", ".join(f"{k} {v:.1f} s" for k, v in start.items()))
    print(f"load average after {os.getloadavg()[0]:.1f}; every Ray table equals the in-process one bit for bit")
    es.executors.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
