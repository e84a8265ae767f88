"""The terms the report's pages use, each defined once (with the paper it follows), shown beside the
section that uses it first."""

from __future__ import annotations

import html

TERMS: dict[str, str] = {
    "names": "one spelling everywhere (tables, figures, takeaways, the command line; entoscope/naming.py): a2.h0 is "
    "head 0 of layer 2 (its output), a2 the whole attention layer's output, a2.b_O its output bias, a0.kv1 a key/value "
    "head; m1 is MLP 1's output, m1.n13 its neuron 13, m1.b_out its output bias; any other activation goes by its "
    "name and layer (resid_pre.2: the residual stream entering block 2); @POS is the position: a token index (3), "
    "counted from each prompt's end (-1: the last token), or a role (IO, S1, S2, END; S2+1 the token after S2); "
    ".f256 is a dictionary feature of that site (resid_post.1.f256@END), .error the dictionary's reconstruction error "
    "there; <q> <k> <v> a head's query, key and value inputs; A->B the edge from A to B; input the token embeddings.",
    "q-value": "a cell's p-value adjusted by Benjamini-Hochberg over the table's cells: the smallest false discovery "
    "rate at which it would count as significant (Benjamini & Hochberg 1995).",
    "error node": "attribution graphs: a dictionary's reconstruction error at a site, x - decode(encode(x)), the part "
    "of the activation its features do not explain, kept as a node so the graph reproduces the model.",
    "logit difference": "the logit of the right answer minus the logit of the wrong one at the last "
    "position (IOI: the indirect object's name minus the subject's).",
    "probability difference": "greater-than: the probability of the years after the start year minus that of "
    "the years up to it, at the last position (Hanna et al. 2023).",
    "normalised effect": "denoising: patch one site of the corrupt run with its value from the clean run; "
    "(mean patched - mean corrupt) / (mean clean - mean corrupt) over prompts, a ratio of means. 1: that site "
    "alone restores the clean behaviour; 0: no effect; negative: it moves the metric the other way "
    "(Wang et al. 2022; Zhang & Nanda 2024).",
    "95% interval": "a bias-corrected and accelerated bootstrap interval over prompts (1,000 resamples of the "
    "per-prompt table, never a re-run of the model; Efron 1987). docs/statistics.md says more.",
    "significant": "survives a Benjamini-Hochberg screen at the run's false discovery rate (stats.fdr, 5% by "
    "default) over the table's cells (Benjamini & Hochberg 1995): q <= fdr, an approximate control of the "
    "false discovery rate with bootstrap p-values, not a guarantee (docs/statistics.md).",
    "fragile": "leaving one prompt out moves the cell by more than half its size: one prompt carries it.",
    "degenerate pair": "a pair whose clean and corrupt metric differ by under 10% of the median gap (the "
    "stats.degenerate_share setting): its per-pair ratio would explode, so it is left out of per-pair ratios (never out "
    "of the ratio of means), its normalised value is blank, and the page's warnings box counts them.",
    "KL(final || lens)": "sum over the vocabulary of p_final (log p_final - log p_lens), in nats: what the "
    "model's own next-token distribution loses when read through the lens at a layer (0 at the last layer).",
    "logit lens": "the residual stream at a layer put through the final norm and the unembedding "
    "(nostalgebraist 2020).",
    "Jacobian lens": "the logit lens applied after carrying a layer's residual state to the last layer through "
    "the average Jacobian of the later blocks, fitted on texts (Gurnee et al. 2026).",
    "score": "head scores: the mean attention a head pays to its targets, over query positions that have a "
    "target; an ideal head scores 1.",
    "score_tl": "TransformerLens's head-detector score ('mul'): attention on targets over all attention; on a "
    "sequence shown twice an ideal induction head scores about 0.5 by it, since the first copy has no targets.",
    "direct logit attribution": "a component's output at the last position, divided by the final norm's scale "
    "of the clean run (frozen) and projected on the unembedding direction of (right - wrong answer); the rows "
    "plus the constant add up to the logit difference.",
    "information flow routes": "edges kept when a component's proximity to a residual state (its share of "
    "that state, Ferrando & Voita 2024) is above tau; routes grow down from the last position's last layer. A route "
    "into the prediction is a kept attention edge from an earlier token into the last position; a component on "
    "every prompt's route is always on.",
    "EAP": "edge attribution patching: each edge's score is (corrupt - clean activation of its sender) times the "
    "gradient of the metric at its receiver's input on the clean run, a first-order estimate of patching the edge "
    "(Syed et al. 2023).",
    "EAP-IG": "edge attribution patching with integrated gradients: each edge's score is (clean - corrupt "
    "activation of its sender) times the gradient of the metric at its receiver's input, averaged along the "
    "straight path from corrupt to clean inputs (Hanna et al. 2024).",
    "faithfulness": "(m(circuit) - m(empty)) / (m(full) - m(empty)): the share of the model's metric the circuit "
    "alone recovers, the edges outside it given their corrupt values (MIB, Mueller et al. 2025).",
    "CPR": "circuit performance ratio: the area under the faithfulness curve over the fractions of edges kept; "
    "higher is better (MIB, Mueller et al. 2025).",
    "CMD": "circuit-model distance: the area between the faithfulness curve and 1 (|1 - faithfulness|); lower "
    "is better (MIB).",
    "circuit search": "a circuit is found, not fixed at a size: the smallest set of top edges (by |score|) whose "
    "faithfulness reaches the target (0.8, its point estimate), with at most the budget's edges, read along the "
    "faithfulness curve and bisected between its points, then pruned to the edges on a path from the input to the "
    "logits; where none reaches it, the page says so and draws the curve instead of a circuit.",
    "head tests": "a head is named as one of its kind by a test heads of other kinds fail: an induction or "
    "duplicate-token head attends to its targets more than on a control prompt whose repeat is shuffled, by over "
    "a tenth of its attention with its whole interval; a previous-token head puts most of its attention (its "
    "interval above one half) on the token before.",
    "stable circuit": "the edges chosen in at least half (the stability_share setting) of the bootstrap "
    "resamples of the prompts; Jaccard: the "
    "overlap of two circuits' edge sets (shared / either).",
    "held-out score": "probing: accuracy (classes) or R^2 (numbers) of a linear probe on prompts it was not "
    "fit on; the control task gives the prompts random labels of the same distribution, and selectivity is "
    "score - control (Hewitt & Liang 2019).",
    "causal check": "the probe's direction projected out of the residual stream at the best layer; the change "
    "in the task metric, against a random direction's.",
    "feature": "a direction of a sparse autoencoder (SAE) trained on one activation: reading a feature site "
    "encodes the activation, writing one decodes the edit and keeps the SAE's error term (docs/features.md).",
    "attribution patching": "the first-order estimate of exact patching: (clean - corrupt activation) times "
    "the metric's gradient, for every site in one backward pass (Nanda 2023; Kramar et al. 2024).",
    "replacement score": "of the influence reaching the metric from the prompt's tokens and the SAEs' error "
    "nodes, the share that comes from the tokens through features (Ameisen et al. 2025); 1: the features "
    "explain the model with no error.",
    "completeness score": "the influence-weighted share of each node's incoming attribution that comes from "
    "non-error nodes (Ameisen et al. 2025).",
    "steering effect": "the mean over prompts of (metric steered - metric unsteered) when c times the direction is "
    "added at a site (activation addition, Turner et al. 2023; CAA, Panickssery et al. 2023); c is the coefficient.",
    "random baseline": "the same steering with a seeded random direction of the same norm at the same site: what "
    "pushing on any direction that hard does. The direction beats it where the interval of (direction - random) "
    "excludes 0 on the effect's side (docs/steering.md).",
    "KL(steered || unsteered)": "sum over the vocabulary of p_steered (log p_steered - log p_unsteered), in nats, "
    "averaged over a held-out prompt's positions: how much steering changes the next-token distribution on text "
    "the direction was not made from.",
    "loss change": "the held-out prompts' next-token cross-entropy steered minus unsteered, in nats (AxBench, Wu et al. "
    "2025, scores fluency apart from the concept).",
}


def terms_html(terms: tuple[str, ...] | list[str]) -> str:
    """A definition list of `terms` (each must be in TERMS), folded under 'terms used here'."""
    if not terms:
        return ""
    items = "".join(f"<dt>{html.escape(t)}</dt><dd>{html.escape(TERMS[t])}</dd>" for t in terms)
    return f'<details class="terms"><summary>terms used here</summary><dl>{items}</dl></details>'
