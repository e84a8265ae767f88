"""How big the report's runs are on a model: each section's sizes, chosen from what a forward costs.

A model's cost is its forward's multiply-adds per token (Kaplan et al. 2020 count 2N FLOPs, N the weights
a token passes through): per block 4 d_model^2 (attention's q, k, v, o) and 2 d_model d_mlp (3 for a gated
MLP), then d_model d_vocab (the unembedding). The demo model costs 0.8 M; SmolLM2-135M 147 M, Gemma 3
270M 259 M. A model up to SMALL_MACS runs each section with its `small` sizes (the demo's, what the pages'
tests read); a larger one with its `large` sizes, fewer prompts and cheaper settings chosen so that the
report on SmolLM2 fits its targets on a 2-core CPU (benchmarks/bench_report_real.py: `--quick` in 3
minutes, the full report in 10). Every size a section uses is written on its page and in the report's
`manifest.json` (`sizes`), with the model's cost.

The lens section fits a Jacobian lens (lens/jacobian_fit.py: d_model vector-Jacobian products through
every token of every text) on a budget of JACOBIAN_BUDGET multiply-adds, counted as tokens x d_model x the
blocks' multiply-adds per token: the texts are cut to what the budget buys (at most the small sizes), and
where that leaves fewer than JACOBIAN_MIN_POSITIONS fitted positions a text the section fits no
Jacobian lens and says so on its page. The probes of a large model are fitted at a few layers spread evenly
from the first to the last (their fits, not the model's forwards, are most of the probing section's time).
"""

from __future__ import annotations

from typing import Any

from ..models.adapter import adapt

SMALL_MACS = 10e6  # per token: up to this a model is "small" (the demo: 0.8 M)

IOI_ROLES = ("IO", "S1", "S1+1", "S2", "S2+1", "END")  # the patching section's exact residual-stream map
IOI_TOKENS = ("IO", "S1", "S2", "END")  # ... on a large model: the names and the last token
ALL_COEFFICIENTS = (-1.0, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5)  # the steering section's, x the residual's mean norm
# section -> setting -> (small quick, small full, large quick, large full)
SIZES: dict[str, dict[str, tuple[Any, Any, Any, Any]]] = {
    "lens": {"n": (8, 32, 8, 32), "jacobian_texts": (2, 16, 2, 2), "jacobian_max_length": (48, 128, 48, 128)},
    "circuits": {"n": (16, 48, 16, 24), "method": ("eap_ig", "eap_ig", "eap", "eap_ig"), "steps": (5, 5, 1, 3),
                 "faithfulness": ("mib", "mib", "coarse", "coarse"), "routes_n": (8, 16, 8, 16),
                 "budget": (0.2, 0.2, 0.05, 0.05), "search_steps": (6, 6, 4, 6)},
    "patching": {"n": (8, 32, 16, 32), "method": ("exact", "exact", "attribution", "attribution"),
                 "max_layers": (None, None, 6, 12), "positions": (IOI_ROLES, IOI_ROLES, IOI_TOKENS, IOI_TOKENS),
                 "recheck": (0, 0, 5, 5)},
    "probing": {"greater_than_n": (96, 320, 64, 192), "ioi_n": (160, 512, 64, 192),
                "max_layers": (None, None, 8, 12)},
    "steering": {"n": (32, 128, 16, 32), "direction_n": (64, 256, 32, 64), "side_effects_n": (16, 64, 6, 16),
                 "coefficients": (ALL_COEFFICIENTS, ALL_COEFFICIENTS, (-0.1, -0.03, 0.03, 0.1),
                                  (-0.3, -0.1, -0.03, 0.03, 0.1, 0.3)),
                 "continuation_prompts": (3, 3, 1, 3)},
}
COARSE_FRACTIONS = (0.01, 0.05, 0.2, 1.0)  # the faithfulness curve of a large model: 4 of MIB's 10 fractions
JACOBIAN_BUDGET = {True: 1.5e12, False: 4e12}  # multiply-adds, by quick
JACOBIAN_SKIP_FIRST = 4
JACOBIAN_MIN_POSITIONS = 12


def forward_macs(model: Any) -> float:
    """Multiply-adds of one token's forward (module docstring)."""
    s = adapt(model).structure
    return float(s.n_layers * block_macs(s) + s.d_model * s.d_vocab)


def block_macs(s: Any) -> float:
    return 4 * s.d_model ** 2 + (3 if s.gated_mlp else 2) * s.d_model * s.d_mlp


def tier(model: Any) -> str:
    return "small" if forward_macs(model) <= SMALL_MACS else "large"


def sizes(model: Any, section: str, quick: bool) -> dict[str, Any]:
    """The settings `section` runs with on `model` (SIZES' column for the model's tier and quick)."""
    col = (0 if quick else 1) + (0 if tier(model) == "small" else 2)
    out = {k: v[col] for k, v in SIZES.get(section, {}).items()}
    if section == "lens":
        out.update(jacobian_sizes(model, quick, out["jacobian_texts"], out["jacobian_max_length"]))
    if "max_layers" in out:
        out["layers"] = spread_layers(adapt(model).structure.n_layers, out.pop("max_layers"))
    return out


def spread_layers(n_layers: int, k: int | None) -> str | list[int]:
    """At most k layers spread evenly from the first to the last ("all" where k is None or k >= n_layers)."""
    if k is None or k >= n_layers:
        return "all"
    return sorted({round(i * (n_layers - 1) / (k - 1)) for i in range(k)})


def jacobian_sizes(model: Any, quick: bool, texts: int, max_length: int) -> dict[str, Any]:
    """The Jacobian lens fit's texts and their length within the budget; `jacobian_fit` False where the budget
    leaves fewer than JACOBIAN_MIN_POSITIONS positions a text."""
    s = adapt(model).structure
    per_token = s.d_model * s.n_layers * block_macs(s)
    length = int(min(max_length, JACOBIAN_BUDGET[quick] // (per_token * texts)))
    fits = length - JACOBIAN_SKIP_FIRST >= JACOBIAN_MIN_POSITIONS
    return {"jacobian_fit": fits, "jacobian_texts": texts, "jacobian_max_length": length,
            "jacobian_skip_first": JACOBIAN_SKIP_FIRST, "jacobian_budget_macs": JACOBIAN_BUDGET[quick],
            "jacobian_macs": float(per_token * texts * length)}
