"""The terms the report's pages use, each defined once (with the paper it follows), shown beside the
section that uses it first."""

from __future__ import annotations

import html

TERMS: dict[str, str] = {
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
    "significant": "different from 0 with the false discovery rate held at 5% over the table's cells "
    "(Benjamini & Hochberg 1995).",
    "fragile": "leaving one prompt out moves the cell by more than half its size: one prompt carries it.",
    "degenerate pair": "a pair whose clean and corrupt metric differ by under 10% of the median gap: its "
    "per-pair ratio would explode, so it is left out of per-pair ratios (never out of the ratio of means).",
    "KL(final || lens)": "sum over the vocabulary of p_final (log p_final - log p_lens), in nats: what the "
    "model's own next-token distribution loses when read through the lens at a layer (0 at the last layer).",
    "logit lens": "the residual stream at a layer put through the final norm and the unembedding "
    "(nostalgebraist 2020).",
    "score": "head scores: the mean attention a head pays to its targets, over query positions that have a "
    "target; an ideal head scores 1.",
    "score_tl": "TransformerLens's head-detector score ('mul'): attention on targets over all attention; on a "
    "sequence shown twice an ideal induction head scores about 0.5 by it, since the first copy has no targets.",
    "direct logit attribution": "a component's output at the last position, divided by the final norm's scale "
    "of the clean run (frozen) and projected on the unembedding direction of (right - wrong answer); the rows "
    "plus the constant add up to the logit difference.",
    "information flow routes": "edges kept when a component's proximity to a residual state (its share of "
    "that state, Ferrando & Voita 2024) is above tau; routes grow down from the last position's last layer.",
    "EAP-IG": "edge attribution patching with integrated gradients: each edge's score is (clean - corrupt "
    "activation of its sender) times the gradient of the metric at its receiver's input, averaged along the "
    "straight path from corrupt to clean inputs (Hanna et al. 2024).",
    "faithfulness": "(m(circuit) - m(empty)) / (m(full) - m(empty)): the share of the model's metric the circuit "
    "alone recovers, the edges outside it given their corrupt values (MIB, Mueller et al. 2025).",
    "CPR": "circuit performance ratio: the area under the faithfulness curve over the fractions of edges kept; "
    "higher is better (MIB, Mueller et al. 2025).",
    "CMD": "circuit-model distance: the area between the faithfulness curve and 1 (|1 - faithfulness|); lower "
    "is better (MIB).",
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
