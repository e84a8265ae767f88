"""Train the bundled demo model: a 3-layer GPT-2 that does IOI, facts, greater-than and copying.

    HF_HUB_OFFLINE=1 python scripts/train_demo.py --out src/entoscope/demo [--steps 4000] [--seed 0]

Writes a HuggingFace folder (config.json, model.safetensors, tokenizer files) and training_report.json,
then evaluates the model with plain transformers code on prompts from entoscope's task generators
(evaluation seeds; the training corpus uses its own seed stream and holds out some combinations).
Not run in CI: about 10 minutes on 2 idle CPU cores (--threads 1 is much faster on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

try:
    from entoscope.data import tasks
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from entoscope.data import tasks
from entoscope.data.examples import Example
from entoscope.data.tasks import vocab
from entoscope.data.tasks.greater_than import TEMPLATES as GT_TEMPLATES
from entoscope.data.tasks.greater_than import sentence as gt_sentence
from entoscope.data.tasks.greater_than import year_sets

BOS = "<|endoftext|>"
# Shares of the training rows (--mix). An optional "counting" kind holds arithmetic progressions of
# two-digit numbers (" 12 15 18 21"), whose next number needs the previous token: it does grow
# previous-token heads, but in our runs it did not make induction heads form (see docs/demo_model.md).
MIX = {"induction": 0.35, "ioi": 0.35, "facts": 0.15, "greater_than": 0.15}
# Induction rows: "ids" (the default) is BOS + a sequence of distinct random token ids from the whole
# vocabulary + the same sequence again, only the repeat scored. The others use random task words:
# "fill" repeats one sequence until the row is full; "2" shows it exactly twice, one sequence per row;
# "offset" is "2" after a random number of random words; "edits" is "2" with up to two words inserted
# into or dropped from the copy. An optional "alternation" kind (runs like " cat sky cat sky cat") grows
# previous-token heads that copy identities. Before zero-initialised positions and the induction-only
# first phase (below), none of these made induction heads form (docs/demo_model.md).
INDUCTION_COPIES = "ids"
INDUCTION_LENGTHS = (5, 20)  # tokens (or words) per random sequence
# Position embeddings start at zero: with GPT-2's random init (std 0.02, as large as the token
# embeddings) the model solved copying with positional shortcuts and formed no induction head.
POS_INIT = "zero"
# The first steps see induction rows only, at a lower constant rate: with the full mix from step 0, or
# at the mix's rate of 3e-3, no induction head formed (docs/demo_model.md, "How the induction heads form").
INDUCTION_FIRST = 1000
INDUCTION_LR = 1e-3
ARCH = dict(n_layer=3, n_embd=128, n_head=4, n_inner=512, n_positions=64)
THRESHOLDS = {"induction_score": 0.8, "ioi_accuracy": 0.95, "ioi_logit_diff": 5.0,
              "facts_accuracy": 0.95, "greater_than_prob_diff": 0.5}
PROBE_PERIOD = 20  # induction score probes: BOS + PROBE_PERIOD words, repeated twice
EVAL_N = 256  # prompts per task, generated with the task generators' own seeds 0 (and 1 for induction)
TRAIN_SEED_BASE = 1_000_000  # training corpus seeds are TRAIN_SEED_BASE + 1000 * seed + i: never eval seeds

# Held out of the training corpus, to see generalisation (reported separately):
GT_HELDOUT_YY = (13, 47, 86)  # never a start year in training (they still occur as end years)


def ioi_heldout(io: str, s: str) -> bool:
    """About 1 in 7 unordered name pairs never appear together in training."""
    return (vocab.NAMES.index(io) + vocab.NAMES.index(s)) % 7 == 3


def facts_heldout(country: str, template: int) -> bool:
    """About 1 in 8 (country, template) pairs are never trained on (the country is, with other templates)."""
    i = [c for c, _ in vocab.COUNTRIES].index(country)
    return (3 * i + template) % 8 == 5


# ----------------------------------------------------------------------------------------- corpus
def corpus_texts(kind: str, n: int, seed: int, rng: random.Random) -> list[str]:
    """n training documents of one kind, each one sentence with its answer (or one repeated sequence)."""
    if kind == "greater_than":
        return greater_than_texts(n, rng)
    if kind == "counting":
        out = []
        for _ in range(n):
            doc = []
            while len(doc) < ARCH["n_positions"] - 1:
                step, length = rng.choice([k for k in range(-9, 10) if k]), rng.randint(4, 12)
                lo, hi = max(0, -step * (length - 1)), min(99, 99 - step * (length - 1))
                start = rng.randint(lo, hi)
                doc += [start + step * j for j in range(length)]
            out.append("".join(f" {x:02d}" for x in doc[: ARCH["n_positions"] - 1]))
        return out
    if kind == "induction":
        # All task words and the two-digit numbers: induction over the whole word vocabulary, which
        # also makes " 00".." 99" frequent enough to become tokens.
        pool = sorted(set(vocab.INDUCTION_WORDS) | set(vocab.NAMES) | set(vocab.PLACES) | set(vocab.OBJECTS)
                      | {w for pair in vocab.COUNTRIES for w in pair} | set(vocab.GT_NOUNS) | set(vocab.TWO_DIGITS))
        lo, hi = INDUCTION_LENGTHS
        copies = lambda k: 2 if INDUCTION_COPIES != "fill" else (ARCH["n_positions"] - 1) // k + 1  # noqa: E731
        docs = []
        for _ in range(n):
            seq = rng.sample(pool, rng.randint(lo, hi))
            # "offset": random words first, so the repeat starts anywhere (a model with learned absolute
            # positions cannot copy by counting positions from the row's start)
            noise = (rng.choices(pool, k=rng.randint(0, ARCH["n_positions"] - 1 - 2 * len(seq)))
                     if INDUCTION_COPIES == "offset" else [])
            words = noise + seq * copies(len(seq))
            if INDUCTION_COPIES == "edits":
                # the copy with up to two words inserted or dropped: copying by a fixed offset breaks
                # after an edit, matching the current word (induction) does not
                copy = list(seq)
                for _ in range(rng.randint(0, 2)):
                    i = rng.randint(1, len(copy) - 1)
                    if rng.random() < 0.5:
                        copy.insert(i, rng.choice(pool))
                    else:
                        del copy[i]
                words = seq + copy
            docs.append("".join(" " + w for w in words[: ARCH["n_positions"] - 1]))
        return docs
    if kind == "alternation":
        # Random words with runs that alternate two words ("... cat sky cat sky cat ..."): the next word
        # is the one before the current one, which a previous-token head copying identities solves.
        pool = sorted(set(vocab.INDUCTION_WORDS) | set(vocab.NAMES) | set(vocab.PLACES) | set(vocab.OBJECTS))
        docs = []
        for _ in range(n):
            words: list[str] = []
            while len(words) < ARCH["n_positions"] - 1:
                words += rng.choices(pool, k=rng.randint(1, 6))
                words += (rng.sample(pool, 2) * 6)[: rng.randint(4, 10)]
            docs.append("".join(" " + w for w in words[: ARCH["n_positions"] - 1]))
        return docs
    texts: list[str] = []
    i = 0
    while len(texts) < n:
        data = tasks.get(kind, n=max(256, n - len(texts)), seed=seed + i)
        i += 1
        for ex in data:
            m = ex.meta
            if kind == "ioi" and not ioi_heldout(m["io"], m["s"]):
                texts.append(ex.prompt + ex.answers[0] + ".")
            elif kind == "facts" and not facts_heldout(m["country"], m["template"]):
                texts.append(ex.prompt + ex.answers[0] + ".")
    return texts[:n]


def greater_than_texts(n: int, rng: random.Random) -> list[str]:
    # Not the task generator: start years here also end in 00 and 01 (the counterfactual's "01").
    starts = [yy for yy in range(99) if yy not in GT_HELDOUT_YY]
    texts = []
    for _ in range(n):
        yy = rng.choice(starts)
        sentence = gt_sentence(rng.randrange(len(GT_TEMPLATES)), rng.choice(vocab.GT_NOUNS),
                               rng.choice(vocab.CENTURIES), yy)
        texts.append(f"{sentence}{rng.randint(yy + 1, 99):02d}.")
    return texts


def build_corpus(rows: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(TRAIN_SEED_BASE + 1000 * seed)
    # Documents per 64-token row: 1 induction or counting document, ~3.5 IOI, ~8 facts, ~4 greater-than.
    per_row = {"induction": 1, "ioi": 4, "facts": 9, "greater_than": 5, "counting": 1, "alternation": 1}
    return {kind: corpus_texts(kind, int(rows * MIX[kind] * per_row[kind]) + 64,
                               TRAIN_SEED_BASE + 1000 * seed + 100 * k, rng)
            for k, kind in enumerate(MIX)}


def pack(ids: list[list[int]], n_rows: int, ctx: int, one_per_row: bool = False) -> torch.Tensor:
    """Rows of `ctx` tokens made of BOS + document, BOS + document, ... (the last one cut).

    With one_per_row, each row is BOS + one document, padded with -1 (no loss there; causal attention
    keeps the padding out of the real positions).
    """
    if one_per_row:
        return torch.tensor([([0] + doc + [-1] * ctx)[:ctx] for doc in ids[:n_rows]], dtype=torch.long)
    out, row = [], []
    for doc in ids:
        row += [0] + doc
        if len(row) >= ctx:
            out.append(row[:ctx])
            row = []
            if len(out) == n_rows:
                break
    if len(out) < n_rows:
        raise RuntimeError(f"corpus too small: {len(out)} rows of {n_rows}")
    return torch.tensor(out, dtype=torch.long)


NO_LOSS = -2  # in a data row, id t stored as NO_LOSS - t is an input token that is not scored; -1 is padding


def random_id_rows(n_rows: int, vocab_size: int, rng: random.Random) -> torch.Tensor:
    """Rows of BOS + a sequence of distinct random token ids (any id but BOS) + the same sequence again,
    padded with -1: induction over the whole vocabulary, like `tasks.repeated_tokens`. Only the repeat
    is scored (the first copy is unpredictable noise), so the first copy is stored as NO_LOSS - id."""
    lo, hi = INDUCTION_LENGTHS
    ctx = ARCH["n_positions"]
    rows = []
    for _ in range(n_rows):
        seq = rng.sample(range(1, vocab_size), rng.randint(lo, min(hi, (ctx - 1) // 2)))
        rows.append(([0] + [NO_LOSS - t for t in seq] + seq + [-1] * ctx)[:ctx])
    return torch.tensor(rows, dtype=torch.long)


# -------------------------------------------------------------------------------------- tokenizer
def required_tokens() -> list[str]:
    words = (vocab.NAMES + vocab.PLACES + vocab.OBJECTS + tuple(w for pair in vocab.COUNTRIES for w in pair)
             + vocab.GT_NOUNS + vocab.INDUCTION_WORDS + vocab.TWO_DIGITS)
    return [" " + w for w in words] + list(vocab.TWO_DIGITS)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Digit runs are cut into pairs first, so " 1732" is always [" 17", "32"] (as GPT-2 does for most
    # years): the greater-than answer after "... the year 17" is then one two-digit token.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\d\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id(BOS) == 0
    return tok


def check_tokenizer(tok: Tokenizer) -> list[str]:
    """The task words and numbers that are NOT one token (must be empty)."""
    bad = [t for t in required_tokens() if len(tok.encode(t).ids) != 1]
    bad += [f" {c}{yy}" for c in vocab.CENTURIES for yy in vocab.TWO_DIGITS
            if tok.encode(f" {c}{yy}").ids != tok.encode(f" {c}").ids + tok.encode(yy).ids]
    return bad


# ------------------------------------------------------------------------------------------ train
def lr_at(step: int, steps: int, lr: float, warmup: float = 0.05) -> float:
    w = max(1, int(warmup * steps))
    if step < w:
        return lr * (step + 1) / w
    return lr * 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, steps - w)))


def train(model: GPT2LMHeadModel, data: torch.Tensor, args: argparse.Namespace,
          probe: torch.Tensor) -> list[float]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    model.train()
    losses, t0 = [], time.time()
    for step in range(args.steps):
        first = args.induction_first
        for g in opt.param_groups:  # the induction-only phase has its own (lower, constant) rate
            g["lr"] = (args.induction_lr * min(1.0, (step + 1) / 100) if step < first
                       else lr_at(step - first, args.steps - first, args.lr))
        batch = data[step * args.batch_size : (step + 1) * args.batch_size]
        inputs = torch.where(batch <= NO_LOSS, NO_LOSS - batch, batch.clamp(min=0))
        targets = batch.clamp(min=-1)
        logits = model(inputs).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1),
                               ignore_index=-1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps - 1:
            recent = sum(losses[-100:]) / len(losses[-100:])
            line = f"step {step:5d}  loss {recent:.4f}  lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:.0f}s"
            if step % 500 == 0 or step == args.steps - 1:  # watch the induction heads form
                model.set_attn_implementation("eager")
                scores = induction_scores(model, probe, PROBE_PERIOD)
                model.set_attn_implementation("sdpa")
                line += f"  best induction score {max(max(row) for row in scores):.3f}"
            print(line, flush=True)
    model.eval()
    return losses


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def last_logits(model: GPT2LMHeadModel, tok: PreTrainedTokenizerFast, prompts: list[str]) -> torch.Tensor:
    """Logits at the last position of BOS + prompt, for each prompt: [n, vocab]."""
    ids = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in prompts]
    width = max(map(len, ids))
    # Right padding: causal attention never looks at the pads, and positions stay 0.. as unpadded.
    batch = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    logits = model(batch, attention_mask=torch.ones_like(batch)).logits
    return logits[torch.arange(len(ids)), torch.tensor([len(x) - 1 for x in ids])]


def token_ids(tok: PreTrainedTokenizerFast, words: tuple[str, ...]) -> list[int]:
    out = [tok.encode(w, add_special_tokens=False) for w in words]
    assert all(len(x) == 1 for x in out), words
    return [x[0] for x in out]


def answer_metrics(model, tok, data) -> dict[str, list[float]]:
    logits = last_logits(model, tok, [e.prompt for e in data])
    probs = logits.softmax(-1)
    out: dict[str, list[float]] = {"correct": [], "logit_diff": [], "top1": [], "prob_diff": []}
    for row, prob, ex in zip(logits, probs, data):
        a, w = token_ids(tok, ex.answers), token_ids(tok, ex.wrong_answers)
        out["logit_diff"].append((row[a].mean() - row[w].mean()).item())
        out["correct"].append(float(row[a].max() > row[w].max()))
        out["top1"].append(float(row.argmax().item() in a))
        out["prob_diff"].append((prob[a].sum() - prob[w].sum()).item())
    return out


def mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


@torch.no_grad()
def induction_scores(model: GPT2LMHeadModel, prompts: torch.Tensor, period: int) -> list[list[float]]:
    """Per head: mean over the second repeat of the attention from i to i - period + 1 ([layer][head])."""
    attentions = model(prompts, attention_mask=torch.ones_like(prompts), output_attentions=True).attentions  # n_layer x (B, H, T, T)
    first = 1 + period  # BOS at 0, first repeat at 1..period, second at period+1..2*period
    i = torch.arange(first, first + period)
    return [att[:, :, i, i - period + 1].mean(dim=(0, 2)).tolist() for att in attentions]


def evaluate(folder: Path, seed: int) -> dict:
    tok = AutoTokenizer.from_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    period, n_seq = PROBE_PERIOD, 64
    rng = random.Random(seed)
    word_ids = token_ids(tok, tuple(" " + w for w in vocab.INDUCTION_WORDS))
    words = torch.tensor([[0] + s + s for s in (rng.sample(word_ids, period) for _ in range(n_seq))])
    rand = tasks.repeated_tokens(n=n_seq, seed=seed, vocab_size=len(tok), length=period, bos_token_id=0)
    scores_words = induction_scores(model, words, period)
    scores_vocab = induction_scores(model, torch.tensor([e.prompt for e in rand]), period)

    ind = answer_metrics(model, tok, tasks.induction(n=EVAL_N, seed=seed))
    ioi_data = tasks.ioi(n=EVAL_N, seed=seed)
    ioi = answer_metrics(model, tok, ioi_data)
    ioi_held = [i for i, e in enumerate(ioi_data) if ioi_heldout(e.meta["io"], e.meta["s"])]
    facts_data = tasks.facts(n=EVAL_N, seed=seed)
    facts = answer_metrics(model, tok, facts_data)
    facts_held = [i for i, e in enumerate(facts_data) if facts_heldout(e.meta["country"], e.meta["template"])]
    gt_data = tasks.greater_than(n=EVAL_N, seed=seed)
    gt = answer_metrics(model, tok, gt_data)
    gt_cf = answer_metrics(model, tok, [Example(e.counterfactual, None, e.answers, e.wrong_answers)
                                        for e in gt_data])
    # Held-out start years in every template and a few centuries: too rare among 256 random prompts.
    held = [Example(gt_sentence(t, noun, c, yy), None, *year_sets(yy))
            for yy in GT_HELDOUT_YY for t in range(len(GT_TEMPLATES)) for c in (12, 15, 17) for noun in ("war", "voyage")]
    gt_held = answer_metrics(model, tok, held)

    def pick(xs, idx):
        return [xs[i] for i in idx]

    best = max((s, layer, head) for layer, row in enumerate(scores_words) for head, s in enumerate(row))
    return {
        "induction_scores_words": scores_words,
        "induction_scores_random_tokens": scores_vocab,
        "induction_score_best": {"score": best[0], "head": f"L{best[1]}H{best[2]}"},
        "induction_score_setup": f"BOS + {period} random distinct tokens repeated twice, {n_seq} sequences; "
                                 f"mean attention from i to i - {period} + 1 over the second repeat",
        "induction_task_accuracy": mean(ind["correct"]),
        "induction_task_logit_diff": mean(ind["logit_diff"]),
        "ioi_accuracy": mean(ioi["correct"]),
        "ioi_logit_diff": mean(ioi["logit_diff"]),
        "ioi_heldout_pairs": {"n": len(ioi_held), "accuracy": mean(pick(ioi["correct"], ioi_held)),
                              "logit_diff": mean(pick(ioi["logit_diff"], ioi_held))},
        "facts_accuracy": mean(facts["top1"]),
        "facts_accuracy_vs_wrong": mean(facts["correct"]),
        "facts_heldout_templates": {"n": len(facts_held), "accuracy": mean(pick(facts["top1"], facts_held))},
        "greater_than_prob_diff": mean(gt["prob_diff"]),
        "greater_than_prob_diff_counterfactual_01": mean(gt_cf["prob_diff"]),
        "greater_than_heldout_start_years": {"years": list(GT_HELDOUT_YY), "n": len(held),
                                             "prob_diff": mean(gt_held["prob_diff"])},
        "eval": {"n_per_task": EVAL_N, "seed": seed},
    }


def check_bridge(folder: Path) -> dict:
    """TransformerLens' TransformerBridge loads the folder offline, prepends BOS 0, matches HF logits."""
    from transformer_lens.model_bridge import TransformerBridge

    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf, tokenizer=tok, device="cpu")
    tokens = bridge.to_tokens("When Mary")
    assert tokens[0, 0].item() == 0, tokens
    with torch.no_grad():
        diff = (bridge(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-3, diff
    return {"to_tokens('When Mary')": tokens[0].tolist(), "max_logit_diff_vs_hf": diff}


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    global INDUCTION_LENGTHS, INDUCTION_COPIES
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("src/entoscope/demo"))
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=2048,
                   help="upper bound: BPE stops earlier once every word of the corpus is one token")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in MIX.items()),
                   help="shares of the training rows, e.g. induction=0.35,ioi=0.3,...")
    p.add_argument("--induction-lengths", default="%d,%d" % INDUCTION_LENGTHS,
                   help="min,max words of the random sequences of the induction rows")
    p.add_argument("--induction-copies", choices=["2", "fill", "offset", "edits", "ids"], default=INDUCTION_COPIES)
    p.add_argument("--induction-first", type=int, default=INDUCTION_FIRST,
                   help="the first N steps train on induction rows only (then the mix)")
    p.add_argument("--induction-lr", type=float, default=INDUCTION_LR,
                   help="learning rate of the induction-only phase (constant after 100 warm-up steps)")
    p.add_argument("--pos-init", choices=["zero", "normal"], default=POS_INIT,
                   help="initial position embeddings: zero (default) or GPT-2's normal(0, 0.02)")
    args = p.parse_args()
    INDUCTION_COPIES = args.induction_copies
    MIX.clear()
    MIX.update({k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))})
    INDUCTION_LENGTHS = tuple(int(x) for x in args.induction_lengths.split(","))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    rows = args.steps * args.batch_size
    texts = build_corpus(rows, args.seed)
    # A glossary of every task word and year, so that short runs (small corpora) still make them tokens.
    glossary = [" ".join(required_tokens() + [f"{c}{yy}" for c in vocab.CENTURIES for yy in vocab.TWO_DIGITS])] * 50
    tok = train_tokenizer([t for kind in MIX for t in texts[kind]] + glossary, args.vocab_size)
    bad = check_tokenizer(tok)
    if bad:
        sys.exit(f"{len(bad)} task words are not one token with --vocab-size {args.vocab_size}: {bad[:20]}")
    parts = []
    id_rng = random.Random(TRAIN_SEED_BASE + 1000 * args.seed + 99)
    for kind in MIX:
        n_kind = int(round(rows * MIX[kind]))
        if kind == "induction" and INDUCTION_COPIES == "ids":
            parts.append(random_id_rows(n_kind, tok.get_vocab_size(), id_rng))
            continue
        ids = [e.ids for e in tok.encode_batch(texts[kind], add_special_tokens=False)]
        parts.append(pack(ids, n_kind, ARCH["n_positions"], one_per_row=kind == "induction"))
    data = torch.cat(parts)
    data = data[torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))]
    if args.induction_first:
        first = random_id_rows(args.induction_first * args.batch_size, tok.get_vocab_size(), id_rng)
        data = torch.cat([first, data])[:rows]
    t_corpus = time.time() - t_start
    print(f"corpus: {len(data)} rows of {ARCH['n_positions']} tokens, vocab {tok.get_vocab_size()}, "
          f"{t_corpus:.0f}s", flush=True)

    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_ctx=ARCH["n_positions"], bos_token_id=0,
                        eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        **ARCH)
    model = GPT2LMHeadModel(config)
    if args.pos_init == "zero":
        with torch.no_grad():
            model.transformer.wpe.weight.zero_()
    t0 = time.time()
    word_ids = [tok.token_to_id("Ġ" + w) for w in vocab.INDUCTION_WORDS]
    probe_rng = random.Random(args.seed)
    probe = torch.tensor([[0] + s + s for s in (probe_rng.sample(word_ids, PROBE_PERIOD) for _ in range(16))])
    losses = train(model, data, args, probe)
    t_train = time.time() - t0

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=BOS, pad_token=BOS, unk_token=BOS,
                            model_max_length=ARCH["n_positions"]).save_pretrained(args.out)
    # transformers 5 writes its own class name; the 4.x name loads under both.
    tok_config = args.out / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    for f in args.out.iterdir():
        f.chmod(0o644)  # save_pretrained writes the weights 0600; the package must ship them readable

    metrics = evaluate(args.out, seed=0)
    passed = {
        "induction_score": metrics["induction_score_best"]["score"] > THRESHOLDS["induction_score"],
        "ioi_accuracy": metrics["ioi_accuracy"] >= THRESHOLDS["ioi_accuracy"],
        "ioi_logit_diff": metrics["ioi_logit_diff"] > THRESHOLDS["ioi_logit_diff"],
        "facts_accuracy": metrics["facts_accuracy"] >= THRESHOLDS["facts_accuracy"],
        "greater_than_prob_diff": metrics["greater_than_prob_diff"] > THRESHOLDS["greater_than_prob_diff"],
    }
    try:
        bridge = check_bridge(args.out)
    except ImportError:
        bridge = {"skipped": "transformer_lens is not installed"}
    report = {
        "command": "python scripts/train_demo.py " + " ".join(sys.argv[1:]),
        "seed": args.seed,
        "config": {**ARCH, "vocab_size": tok.get_vocab_size(), "steps": args.steps,
                   "batch_size": args.batch_size, "lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.01,
                   "schedule": "5% linear warm-up, then cosine to 0", "grad_clip": 1.0, "dropout": 0.0,
                   "mix": MIX, "induction_lengths": list(INDUCTION_LENGTHS),
                   "induction_copies": INDUCTION_COPIES, "pos_init": args.pos_init,
                   "induction_first_steps": args.induction_first,
                   "induction_first_lr": args.induction_lr, "train_seed_base": TRAIN_SEED_BASE,
                   "heldout": {"ioi_name_pairs": "(NAMES.index(io) + NAMES.index(s)) % 7 == 3",
                               "facts": "(3 * country_index + template) % 8 == 5",
                               "greater_than_start_yy": list(GT_HELDOUT_YY)}},
        "final_loss": mean(losses[-100:]),
        "seconds": {"corpus_and_tokenizer": round(t_corpus, 1), "training": round(t_train, 1),
                    "total": round(time.time() - t_start, 1)},
        "threads": args.threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "metrics": metrics,
        "thresholds": THRESHOLDS,
        "passed": passed,
        "bridge_check": bridge,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if not all(passed.values()):
        sys.exit(f"the model misses thresholds: {[k for k, v in passed.items() if not v]}")


if __name__ == "__main__":
    main()
