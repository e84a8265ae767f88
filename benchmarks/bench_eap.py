"""Benchmark of circuit discovery: EAP-IG over every edge of a GPT-2-small-sized random model, and
circuit evaluation by edge patching, next to a plain forward + backward of the same model.

    python benchmarks/bench_eap.py                  # 2 intra-op threads, 8 prompts of 24 tokens, 5 steps
    python benchmarks/bench_eap.py --quick          # a smoke run (under a minute)
    python benchmarks/bench_eap.py --threads 4 --prompts 16 --batch 8

On a machine shared with other busy jobs, --threads 1 can be several times faster than 2: every small
operation then waits for a descheduled second thread (docs/circuits.md has both measurements).

Model: transformers.GPT2Config() defaults (12 layers, 12 heads, d_model 768: 32,491 edges) with the
tiny test tokenizer's vocabulary (so the unembedding is small), random weights, as a TransformerBridge.
Everything runs offline. Times are medians of `--repeat` runs in this one process:
- baseline: one forward + backward of the model (gradient of the metric w.r.t. the input
  embeddings) per batch, per prompt;
- EAP-IG: the full score computation (clean and corrupt runs, `steps` forward + backward passes with
  every receiver's input gradient, the score matrix), per prompt; target <= 2 s per prompt;
- circuit evaluation: one patched forward pass per batch, with every edge kept (nothing recomputed)
  and with a random half of the edges kept (every receiver recomputed from its own residual).
The phases are interleaved (baseline, EAP-IG, evaluations, again and again) so that each repeat sees
them under the same load; a warm-up call of each comes first. Peak memory is the process's peak
resident set size after each phase's warm-up (it only grows: model, then each phase's extra).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ENTOSCOPE_QUIET", "1")

import torch  # noqa: E402


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds: all threads) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_tokenizer, tokenizer_dir

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = GPT2LMHeadModel(cfg)
    hf.config._attn_implementation = "eager"
    return from_hf(hf.eval(), tok, backend="bridge", name="gpt2-small-random", folder=tokenizer_dir())


def build_batches(adapter, n: int, seq: int, batch: int):
    from entoscope.data import Dataset, Example
    from entoscope.data.tokenized import make_batches, pad_id, tokenize_data

    g = torch.Generator().manual_seed(1)
    V = adapter.structure.d_vocab
    examples = []
    for _ in range(n):
        p = torch.randint(1, V, (seq,), generator=g).tolist()
        c = list(p)
        c[1: seq // 3] = torch.randint(1, V, (seq // 3 - 1,), generator=g).tolist()
        examples.append(Example(prompt=tuple(p), counterfactual=tuple(c), answers=(p[2],), wrong_answers=(p[3],)))
    td = tokenize_data(adapter, Dataset("bench", tuple(examples)), pairs=True, answers=True)
    return make_batches(td, batch, pad_id(adapter))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--seq", type=int, default=24)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 prompts of 12 tokens, 2 steps, one repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.seq, args.batch, args.steps, args.repeat = 2, 12, 2, 2, 1
    torch.set_num_threads(args.threads)

    from entoscope.circuits.eap import edge_scores
    from entoscope.circuits.edge_patching import EdgePatcher
    from entoscope.circuits.graph import ComponentGraph
    from entoscope.metrics import at_positions, logit_diff
    from entoscope.models import adapt
    from entoscope.models.names import ActName
    from entoscope.models.adapter import Intervention

    t0 = time.perf_counter()
    model = build_model()
    a = adapt(model)
    graph = ComponentGraph.from_model(a)
    batches = build_batches(a, args.prompts, args.seq, args.batch)
    print(f"model: GPT-2-small-sized random bridge, {sum(x.numel() for x in model.parameters()) / 1e6:.0f}M "
          f"parameters, {graph.n_edges} edges; built in {time.perf_counter() - t0:.1f}s")
    print(f"threads {args.threads}; {args.prompts} prompts of {args.seq} tokens in batches of {args.batch}; "
          f"EAP-IG {args.steps} steps; medians of {args.repeat}")
    n = args.prompts

    def baseline():
        for b in batches:
            kept = {}

            def leaf(h, kept=kept):
                kept["x"] = h.detach().requires_grad_(True)
                return kept["x"]
            out = a.run(b.tokens, interventions=[Intervention(ActName("resid_pre", 0), leaf)], grad=True)
            value = logit_diff(at_positions(out.logits, b.last), b.answers, b.wrong_answers).sum()
            torch.autograd.grad(value, [kept["x"]])

    patcher = EdgePatcher(a, graph, batches, logit_diff)
    torch.manual_seed(0)
    half = graph.mask & (torch.rand(graph.mask.shape) > 0.5)
    phases = {
        "baseline": baseline,
        "eap_ig": lambda: edge_scores(a, batches, logit_diff, method="eap_ig", steps=args.steps, quiet=True),
        "eval_all": lambda: patcher.per_prompt(graph.mask),
        "eval_half": lambda: patcher.per_prompt(half),
    }
    mems = {}
    for name, fn in phases.items():  # warm-up; the peak resident set after each phase (it only grows)
        fn()
        mems[name] = _peak_mib()
    # The phases are interleaved, so that each repeat sees them all under the same machine load.
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in phases}
    for _ in range(args.repeat):
        for name, fn in phases.items():
            samples[name].append(_timed(fn))
    timing = {k: (statistics.median(w for w, _ in v) / n, statistics.median(c for _, c in v) / n)
              for k, v in samples.items()}
    base, ig, full_eval, half_eval = (timing[k] for k in phases)
    mem_base, mem_ig, mem_eval = mems["baseline"], mems["eap_ig"], mems["eval_half"]
    rows = [("forward + backward (baseline)", base, mem_base),
            (f"EAP-IG, {args.steps} steps, all edges", ig, mem_ig),
            ("circuit evaluation, all edges kept", full_eval, mem_eval),
            ("circuit evaluation, half the edges kept", half_eval, mem_eval)]
    print(f"\n{'':42s} {'s/prompt':>9s} {'x base':>7s} {'cpu-s/prompt':>13s} {'x base':>7s} {'peak RSS MiB':>13s}")
    for name, (wall, cpu), mem in rows:
        print(f"{name:42s} {wall:9.3f} {wall / base[0]:7.1f} {cpu:13.3f} {cpu / base[1]:7.1f} {mem:13.0f}")
    ig = ig[0]
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(wall times are only meaningful on an otherwise idle machine)")
    verdict = "meets" if ig <= 2.0 else "misses"
    print(f"\nEAP-IG: {ig:.2f} s per prompt ({verdict} the 2 s target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
