"""The conformance suite's parts: the table of operation cases, the model kinds, and the check functions.

Every registered operation (`entoscope.registry.names("operation")`) has one or more cases in CASES (a small
config, the data it runs on, which model it needs, how its table names its rows). tests/test_conformance.py
runs every check below on every case and every model kind; a registered operation without a case fails
the suite, so a new operation gets the checks by being registered and given a case here.

The check functions take what they check as arguments and raise AssertionError when the contract does not
hold, so they can be called on any operation (tests/test_conformance.py calls them on a deliberately broken
one to show that they fail). Numbers are checked against something the operation does not compute:
forward and backward passes are counted by hooks on the model's own torch blocks and around
torch.autograd.grad; the saved files are read back by pandas and json; tables are compared bit for bit.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

import entoscope as es
from entoscope import registry
from entoscope.data import Dataset, Example
from entoscope.errors import EntoscopeError
from entoscope.models.adapter import adapt

from conftest import has_hooked_transformer
from extras import missing, required

FAST = {"n_boot": 40}  # few resamples: the checks compare runs with each other, not intervals with truth

# ---------------------------------------------------------------------------------------------- model kinds
BACKENDS = ("bridge", "compat", "hooked", "nnsight")
KINDS = tuple(k for b in BACKENDS for k in (b, f"{b}+cached"))


def has_nnsight() -> bool:
    """nnsight where installed; CI sets ENTOSCOPE_REQUIRE_NNSIGHT=1 so that a missing nnsight fails instead."""
    if missing("nnsight") and required("nnsight"):
        raise ImportError("ENTOSCOPE_REQUIRE_NNSIGHT=1 but " + missing("nnsight"))
    return not missing("nnsight")


def unavailable(kind: str) -> str:
    """Why this installation cannot build the model kind ('' if it can)."""
    backend = kind.split("+")[0]
    if backend == "hooked" and not has_hooked_transformer():
        return "transformer-lens 4.x has no HookedTransformer (the 3.x CI pass runs these)"
    if backend == "nnsight" and not has_nnsight():
        return missing("nnsight")
    return ""


def build_model(family: str, backend: str, *, n_layers: int = 2) -> Any:
    """A new model: the tiny random GPT-2 ("tiny") or the bundled trained one ("demo"), on one backend."""
    from entoscope.models.loading import from_hf
    from entoscope.models.tiny import tiny_hf_model, tiny_model, tiny_tokenizer

    if family == "demo":
        assert n_layers == 2, "the demo model has its own layers"
        if backend == "compat":
            return es.load_model("demo", compat=True)
        return es.load_model("demo", backend=backend)
    if backend == "nnsight":
        return from_hf(tiny_hf_model("gpt2", n_layers=n_layers), tiny_tokenizer(), backend="nnsight", name="tiny-gpt2")
    return tiny_model("gpt2", "bridge" if backend == "compat" else backend, backend == "compat", n_layers=n_layers)


_MODELS: dict[tuple[str, str], Any] = {}


def plain_model(family: str, kind: str) -> Any:
    """The session's one model of (family, backend): the suite never changes it."""
    key = (family, kind.split("+")[0])
    if key not in _MODELS:
        _MODELS[key] = build_model(*key)
    return _MODELS[key]


def cold_cache_dir() -> str:
    """A new empty cache folder, removed when the test process ends (the suite makes thousands)."""
    folder = tempfile.mkdtemp(prefix="entoscope-conformance-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def model_for(family: str, kind: str) -> Any:
    """The model a run of this kind gets: the plain model, or a CachedModel over it with a new (cold) cache."""
    model = plain_model(family, kind)
    if kind.endswith("+cached"):
        return es.CachedModel(model, cache_dir=cold_cache_dir())
    return model


# ---------------------------------------------------------------------------------------------- data
def pairs(n: int = 8, T: int = 8, labels: bool = False, seed: int = 0) -> Dataset:
    """n clean/corrupt pairs of T random token ids (positions 2.. re-drawn), one answer and one wrong answer each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        clean = [0] + torch.randint(1, 300, (T - 1,), generator=g).tolist()
        corrupt = clean[:2] + torch.randint(1, 300, (T - 2,), generator=g).tolist()
        out.append(Example(tuple(clean), tuple(corrupt), answers=(5 + i,), wrong_answers=(40 + i,),
                           label=i % 2 if labels else None))
    return Dataset("random", tuple(out))


def repeats(n: int = 8, period: int = 5) -> Dataset:
    """BOS then a random sequence twice (previous-token, duplicate-token and induction targets)."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 300, (period,), generator=g).tolist() for _ in range(n)]
    return Dataset("repeats", tuple(Example(tuple([0] + s + s)) for s in seqs))


# ---------------------------------------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Case:
    """One small configuration of one operation.

    make:        seed -> the operation (its config).
    data:        the data it runs on (None: it needs none).
    family:      "tiny" (a random 2-layer GPT-2) or "demo" (the bundled trained model, for what needs
                 training or its dictionaries).
    ids:         the table columns that name its rows (what a takeaway may name).
    descriptive: float columns that are no aggregate needing an interval, each with why (see aggregates()).
    random:      columns another seed changes (intervals, splits, random baselines); () = the operation makes
                 no random choice, so another seed changes nothing.
    refused:     model family or kind -> (the EntoscopeError code it is refused with, why).
    at_most:     the plan's numbers that are an upper bound (rows, forward_passes, backward_passes) -> why.
    names_rows:  the takeaway names at least one row (a component, head or site id).
    """

    make: Callable[[int], Any]
    data: Callable[[], Any] | None
    family: str = "tiny"
    ids: tuple[str, ...] = ("site",)
    descriptive: dict[str, str] = field(default_factory=dict)
    random: tuple[str, ...] = ()
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    at_most: dict[str, str] = field(default_factory=dict)
    names_rows: bool = True

    def op(self, seed: int = 0) -> Any:
        return self.make(seed)

    def dataset(self) -> Any:
        return None if self.data is None else self.data()


_V = torch.randn(64, generator=torch.Generator().manual_seed(0))
_STEER = (_V / _V.norm() * 5.0)
STEER_DESCRIPTIVE = {"direction_norm": "|v| of the direction steered with (a setting of the run, the same on every row)",
                     "written_norm": "|c| times what a coefficient multiplies: the dose's size, a setting",
                     "negligible_share": "the share of the unsteered metric an effect must pass (a constant)"}
PATCH_DESCRIPTIVE = {c: "descriptive mean over prompts (stats.moments) beside `value`, which carries the claim"
                     for c in ("patched_mean", "difference_mean", "normalized_mean", "normalized_of_means",
                               "base_mean", "source_mean")}
DICTIONARY_REFUSED = {
    "tiny": ("dictionary_shape_mismatch", "the demo dictionaries read the demo model's activations (d_model "
             "128); the tiny model's are 64 wide"),
    "compat": ("dictionary_space_mismatch", "the demo dictionaries were trained on plain activations; a compat "
               "bridge gives processed ones (folded norms, centred weights)"),
    "hooked": ("dictionary_space_mismatch", "the demo dictionaries were trained on plain activations; a "
               "HookedTransformer gives processed ones (folded norms, centred weights)"),
}

PROBING_DESCRIPTIVE = {
    **{f"control_test_{m}": "the control task's other scores, read beside control_test_accuracy and selectivity "
       "(which carry the comparison, with intervals)" for m in ("f1_macro", "auroc")},
    **{f"train_{m}": "the probe's fit on its own training rows (a measure of fit, never the result: docs/probing.md)"
       for m in ("accuracy", "f1_macro", "auroc")},
    "C": "the regularisation chosen on validation rows (a setting)",
    "chance_accuracy": "the majority class's share of the labels (a property of the data)",
    "direction_agreement": "how much the folds' directions agree (a property of the fit)",
    "n_test": "test rows per fold (a count)",
    "metric_base": "the mean metric metric_change is taken from (metric_change carries the claim, with its interval)",
    "metric_ablated": "the mean metric metric_change is taken from (metric_change carries the claim, with its "
                      "interval)",
    "probe_accuracy_ablated": "held-out score of the fitted probes once their direction is removed, mean over folds "
                              "(no interval yet: reported to the lead)",
    "refit_accuracy_ablated": "held-out score of a probe refitted once the direction is removed, mean over folds "
                              "(no interval yet: reported to the lead)",
}
LENS_DESCRIPTIVE = {
    **{f"top{i}_prob": "the top tokens of each site's mean lens distribution, listed for reading" for i in range(1, 6)},
    **{f"{m}_std": f"the spread over prompts of {m}_mean (stats.moments)"
       for m in ("kl", "target_prob", "target_logit")},
}
JACOBIAN_DESCRIPTIVE = {
    "norm": "the fitted matrix's Frobenius norm (a property of the fit)",
    "identity_distance": "how far the fitted matrix is from the logit lens's identity (a property of the fit)",
    "split_half_change": "the fit's settledness: relative change between even- and odd-numbered prompts",
}
WEIGHTS = "a projection of the weights (no prompts, so nothing to resample)"
_TRANSLATORS: list[str] = []


def tuned_translators() -> str:
    """A folder of tuned-lens translators for the tiny model (plain activations), trained a few steps, once."""
    if not _TRANSLATORS:
        model = plain_model("tiny", "bridge")
        lens = es.TunedLens.for_model(model)
        lens.fit(model, pairs(8, seed=3), steps=3, quiet=True)
        _TRANSLATORS.append(str(lens.save(tempfile.mkdtemp(prefix="entoscope-conformance-lens-"))))
    return _TRANSLATORS[0]


PROCESSED_REFUSED = "translators trained on the plain model's activations; this model gives processed ones"
JACOBIAN_REFUSED = "a Jacobian lens fitted on the plain model's activations; this model gives processed ones"
_JACOBIAN: list[str] = []


def jacobian_lens_file() -> str:
    """A Jacobian lens for the tiny model (plain activations), fitted once on a few prompts."""
    if not _JACOBIAN:
        folder = tempfile.mkdtemp(prefix="entoscope-conformance-jlens-")
        es.JacobianLens.fit(plain_model("tiny", "bridge"), pairs(4, seed=5), skip_first=1, quiet=True).save(folder)
        _JACOBIAN.append(folder)
    return _JACOBIAN[0]
CIRCUIT_IDS = ("edge", "sender", "receiver")
FIT_TEXT = "the cat sat on the mat and the dog ran"  # a text to fit a Jacobian lens on (any tokenizer)
_TOP_PAIRS: list[Dataset] = []


def top_pairs() -> Dataset:
    """pairs() whose answer is the tiny model's own top token at the end and whose wrong answer its second:
    tokens whose lens vectors the last layers' decompositions hold (an edit that changes something)."""
    if not _TOP_PAIRS:
        a = adapt(plain_model("tiny", "bridge"))
        out = []
        for ex in pairs():
            top = a.run(torch.tensor([list(ex.prompt)])).logits[0, -1].topk(2).indices.tolist()
            out.append(Example(ex.prompt, ex.counterfactual, answers=(top[0],), wrong_answers=(top[1],)))
        _TOP_PAIRS.append(Dataset("random-top", tuple(out)))
    return _TOP_PAIRS[0]

INSPECT_PROMPT = "When Mary and John went to the store, John gave a drink to"
INSPECT_CF = "When Mary and John went to the store, Mary gave a drink to"
ONE_PROMPT = "one prompt's own value, exact (nothing to resample: es.inspect looks at one prompt)"
INSPECT_DESCRIPTIVE = {c: ONE_PROMPT for c in [f"top{i}_prob" for i in range(1, 6)] +
                       ["answer_prob", "answer_logit", "wrong_prob", "wrong_logit", "logit_diff"]}

CASES: dict[str, dict[str, Case]] = {
    "lens": {
        "logit": Case(lambda s: es.Lens(sites=es.Sites(activation="resid_post", over=["layer"]), stats=FAST, seed=s,
                                        batch_size=4), pairs, ids=("site", "layer"), descriptive=LENS_DESCRIPTIVE,
                      random=("kl_mean_ci_low",)),
        "tuned": Case(lambda s: es.Lens(method="tuned", translators=tuned_translators(),
                                        sites=es.Sites(activation="resid_post", over=["layer"]), stats=FAST, seed=s,
                                        batch_size=4), pairs, ids=("site", "layer"), descriptive=LENS_DESCRIPTIVE,
                      random=("kl_mean_ci_low",),
                      refused={"compat": ("tuned_lens_mismatch", PROCESSED_REFUSED),
                               "hooked": ("tuned_lens_mismatch", PROCESSED_REFUSED)}),
        "jacobian": Case(lambda s: es.Lens(method="jacobian", lens=jacobian_lens_file(),
                                           sites=es.Sites(activation="resid_post", over=["layer"]), stats=FAST, seed=s,
                                           batch_size=4), pairs, ids=("site", "layer"), descriptive=LENS_DESCRIPTIVE,
                         random=("kl_mean_ci_low",),
                         refused={"compat": ("jacobian_lens_mismatch", JACOBIAN_REFUSED),
                                  "hooked": ("jacobian_lens_mismatch", JACOBIAN_REFUSED)}),
    },
    "inspect": {
        "pair": Case(lambda s: es.Inspect(prompt=INSPECT_PROMPT, answer=" Mary", wrong=" John",
                                          counterfactual=INSPECT_CF, seed=s), None, ids=("position", "token", "token_id"),
                     descriptive=INSPECT_DESCRIPTIVE),
    },
    "jacobian_lens_fit": {
        "default": Case(lambda s: es.JacobianLensFit(skip_first=2, max_length=8, seed=s, batch_size=4), pairs,
                        ids=("layer",), descriptive=JACOBIAN_DESCRIPTIVE),
    },
    "lens_comparison": {
        # no lens given: a Jacobian lens is fitted in the run, so every model kind runs it in its own basis
        "fitted": Case(lambda s: es.LensComparison(fit_data=[FIT_TEXT] * 2, fit_skip_first=2, fit_max_length=10,
                                                   stats=FAST, seed=s, batch_size=4), pairs, ids=("lens", "layer"),
                       random=("kl_mean_ci_low",), descriptive={
                           "fit_texts": "the texts the Jacobian lens was fitted on (a count; blank on the logit lens)",
                           "split_half_change": JACOBIAN_DESCRIPTIVE["split_half_change"]}),
    },
    "coordinate_patching": {
        "fitted": Case(lambda s: es.CoordinatePatching(fit_data=[FIT_TEXT] * 2, fit_skip_first=2, fit_max_length=10,
                                                       k=8, stats=FAST, seed=s, batch_size=4), top_pairs,
                       ids=("site", "layer"), descriptive={"alpha": "the edit's strength (a setting of the run)"},
                       random=("effect_ci_low", "control_effect")),
    },
    "parameter_lens": {
        "neuron_out": Case(lambda s: es.ParameterLens(neurons="0:4", top_k=3, seed=s), None, ids=("layer", "neuron"),
                           descriptive={"norm": WEIGHTS, **{f"{e}{i}_score": WEIGHTS for e in ("top", "bottom")
                                                            for i in range(1, 4)}}),
    },
    "head_scores": {
        "default": Case(lambda s: es.HeadScores(stats=FAST, seed=s, batch_size=4), repeats,
                        ids=("site", "layer", "head", "kind"), random=("score_ci_low",)),
    },
    "dla": {
        "default": Case(lambda s: es.DirectLogitAttribution(stats=FAST, seed=s, batch_size=4), pairs,
                        ids=("component", "layer", "head", "kind"),
                        descriptive={"std": "the spread of `mean` over prompts (stats.moments)",
                                     "mean_abs": "descriptive mean of |contribution| (stats.moments) beside `mean`"},
                        random=("mean_ci_low",)),
    },
    "ifr": {
        "default": Case(lambda s: es.InformationFlowRoutes(stats=FAST, seed=s, batch_size=4), pairs,
                        ids=("component", "layer", "head", "kind"), random=("importance_mean_ci_low",)),
    },
    "circuits": {
        "eap": Case(lambda s: es.Circuits(method="eap", n_edges=6, faithfulness=[0.001, 0.5, 1.0], stats=FAST, seed=s,
                                          batch_size=4), pairs, ids=CIRCUIT_IDS, random=("score_ci_low",)),
        "eap_ig": Case(lambda s: es.Circuits(method="eap_ig", steps=2, n_edges=6, faithfulness=[], stability=4,
                                             stats=FAST, seed=s, batch_size=4), pairs, ids=CIRCUIT_IDS,
                       descriptive={"inclusion": "the share of bootstrap resamples whose circuit keeps the edge (a "
                                    "statistic of the resampling itself)"},
                       random=("score_ci_low", "inclusion")),
        "exact": Case(lambda s: es.Circuits(method="exact", n_edges=6, faithfulness=[], stats=FAST, seed=s,
                                            batch_size=2), lambda: pairs(4), ids=CIRCUIT_IDS, random=("score_ci_low",)),
        "acdc": Case(lambda s: es.Circuits(method="acdc", acdc_threshold=1e-4, stats=FAST, seed=s, batch_size=2),
                     lambda: pairs(2), ids=CIRCUIT_IDS,
                     descriptive={"score": "ACDC's damage when the edge was tried, on that step's circuit and the "
                                  "whole dataset (a decision of the greedy search, not a mean of per-prompt values)"},
                     at_most={"forward_passes": "edges into a receiver that no longer matters are dropped without a "
                              "forward pass, so the plan counts every edge tried at most once"}),
    },
    "patching": {
        "exact": Case(lambda s: es.Patching(method="exact", sites=es.Sites(activation="attn_out", over=["layer"]),
                                            stats=FAST, seed=s, batch_size=4), lambda: pairs(16),
                      ids=("site", "layer"), descriptive=PATCH_DESCRIPTIVE, random=("value_ci_low",)),
        "attribution": Case(lambda s: es.Patching(method="attribution", sites=es.Sites(activation="z",
                                                  over=["layer", "head"]), stats=FAST, seed=s, batch_size=4),
                            lambda: pairs(16), ids=("site", "layer", "head"), descriptive=PATCH_DESCRIPTIVE,
                            random=("value_ci_low",)),
        "integrated_gradients": Case(lambda s: es.Patching(method="integrated_gradients", ig_steps=2,
                                                           sites=es.Sites(activation="attn_out", over=["layer"]),
                                                           stats=FAST, seed=s, batch_size=4), lambda: pairs(16),
                                     ids=("site", "layer"), descriptive=PATCH_DESCRIPTIVE, random=("value_ci_low",)),
    },
    "probing": {
        "kfold_causal": Case(lambda s: es.Probing(sites=es.Sites(activation="resid_post", over=["layer"]),
                                                  split="kfold", k=3, C_grid=[1.0],
                                                  causal_check={"metric": "logit_diff", "top": 2},
                                                  stats=FAST, seed=s, batch_size=8),
                             lambda: pairs(16, labels=True), ids=("site", "layer"), descriptive=PROBING_DESCRIPTIVE,
                             random=("test_accuracy_ci_low",)),
    },
    "interchange": {
        "das": Case(lambda s: es.Interchange(layers=[0, 1], positions=["END", 2], bases=["das", "pca", "random"],
                                             epochs=2, das_batch_size=4, seed=s, batch_size=4), lambda: pairs(12),
                    ids=("site", "basis"),
                    descriptive={"das_overlap": "a property of two bases made from the training pairs (the mean "
                                                "squared cosine of their principal angles), not an aggregate",
                                 "das_angle": "the smallest principal angle between two bases (degrees), a "
                                              "property of the bases",
                                 "strength": "a setting of the run (s), the same on every row"},
                    random=("das_angle",),
                    at_most={"backward_passes": "DAS differentiates with respect to its basis's parameters (no batch "
                                                "axis): the counter sees one row per torch.autograd.grad call of B "
                                                "prompts, the plan counts the B prompt backwards"}),
        "boundless": Case(lambda s: es.Interchange(layers=[0, 1], positions=["END", 2],
                                                   bases=["boundless_das", "random"], epochs=2, das_batch_size=4,
                                                   seed=s, batch_size=4), lambda: pairs(12),
                          ids=("site", "basis"),
                          descriptive={"das_overlap": "a property of two bases (none here: no das basis)",
                                       "das_angle": "a property of two bases (none here)",
                                       "strength": "a setting of the run (s), the same on every row"},
                          random=("iia",),  # the seed draws the split, the rotation and the random basis
                          at_most={"backward_passes": "as das: one row per torch.autograd.grad call of B prompts"}),
    },
    "steering": {
        "add": Case(lambda s: es.Steering(direction=es.Direction("resid_pre.1", _STEER), coefficients=[1.0, 2.0],
                                          side_effects=None, stats=FAST, seed=s, batch_size=4), pairs,
                    ids=("condition", "direction", "coefficient", "mode", "site", "metric"),
                    descriptive=STEER_DESCRIPTIVE, random=("minus_random",)),
        # coefficients in units of the site's mean norm: a sharded phase measures R before steering
        "residual_norm": Case(lambda s: es.Steering(direction=es.Direction("resid_pre.1", _STEER),
                                                    coefficients=[0.1, 0.2], units="residual_norm",
                                                    side_effects=None, stats=FAST, seed=s, batch_size=4), pairs,
                              ids=("condition", "direction", "coefficient", "mode", "site", "metric"),
                              descriptive={**STEER_DESCRIPTIVE,
                                           "residual_norm": "R, the site's mean activation norm the coefficients "
                                           "multiply (a unit of the run, the same on every row)"},
                              random=("minus_random",)),
    },
    "feature_dla": {
        "transcoders": Case(lambda s: es.FeatureDLA(dictionary="demo", activation="mlp_out", top_k_features=4,
                                                    stats=FAST, seed=s, batch_size=4),
                            lambda: es.tasks.ioi(n=8, seed=1), family="demo",
                            ids=("component", "layer", "head", "kind", "dictionary", "feature"),
                            descriptive={"std": "the spread of `mean` over prompts (stats.moments)",
                                         "mean_abs": "descriptive mean of |contribution| (stats.moments) beside "
                                                     "`mean`"},
                            random=("mean_ci_low",), refused=DICTIONARY_REFUSED,
                            at_most={"rows": "a feature gets a row where it is active in some prompt"}),
    },
    "decoder_lens": {
        "transcoder": Case(lambda s: es.DecoderLens(dictionary="demo/transcoder.1", features="0:4", top_k=3, seed=s),
                           None, family="demo", ids=("dictionary", "feature"),
                           descriptive={"norm": WEIGHTS, **{f"{e}{i}_score": WEIGHTS for e in ("top", "bottom")
                                                            for i in range(1, 4)}}, refused=DICTIONARY_REFUSED),
    },
    "feature_graph": {
        "eap": Case(lambda s: es.FeatureGraph(dictionary="demo", activation="resid_post", max_features=4, seed=s),
                    lambda: es.tasks.ioi(n=4, seed=1), family="demo", ids=("node", "layer", "kind", "dictionary",
                                                                           "feature"),
                    descriptive={"influence": "a node's influence in the prompts' averaged graph (a property of "
                                 "that graph: no per-prompt values to resample)"},
                    random=("attribution_ci_low",), refused=DICTIONARY_REFUSED,
                    at_most={"rows": "the dataset graph's nodes are the features kept in some prompt",
                             "forward_passes": "one copy of the prompt per target feature: fewer where fewer are "
                                               "active",
                             "backward_passes": "one copy of the prompt per target feature: fewer where fewer are "
                                                "active"}),
    },
}


def case_ids() -> list[tuple[str, str]]:
    """(operation, case) for every case of every registered operation; (name, "") for one without a case."""
    out = []
    for name in registry.names("operation"):
        variants = CASES.get(name) or {"": None}
        out += [(name, v) for v in variants]
    return out


def refusal(case: Case, family: str, kind: str) -> tuple[str, str] | None:
    """The declared refusal of the case on this model: by family (another family than the case's: every
    kind), else by backend (the case's own family)."""
    if family != case.family:
        return case.refused.get(family)
    return case.refused.get(kind.split("+")[0])


# ---------------------------------------------------------------------------------------------- counting passes
def blocks_of(model: Any) -> list[Any]:
    """The model's transformer blocks as torch modules (TransformerLens blocks, or the HuggingFace ones)."""
    tl = adapt(model).module
    if hasattr(tl, "blocks"):
        return list(tl.blocks)
    from entoscope.models.hf_families import family_of, get

    return list(get(tl, family_of(tl).blocks))


class PassCounter:
    """Counts what really runs through the model, in the plan's unit: prompt forwards (one prompt's pass
    through the blocks it runs; a batch of B prompts is B) and prompt backwards (one prompt's gradient
    through the blocks). Passes made while an operation prepares (adapting the model, the once-per-model
    checks) are kept apart in `prepare_passes`: they are no part of the run's cost, and a second
    preparation must make none.

    Forward: a pre-hook on every block; a pass begins when a block runs that is not after the last one run
    (so passes that start part-way, at block L, count too), and counts the most rows any of its blocks saw
    (rows joining at a later block are prompts of that pass). Backward: every torch.autograd.grad call counts
    the rows of what it differentiates with respect to: activations are batch-first ([rows, position, ...]),
    and a tensor of one prompt's positions ([position, features]) is one row. (Every operation's gradients go
    through torch.autograd.grad; a block hook on gradients would miss the passes nnsight rewrites.)"""

    def __init__(self, model: Any) -> None:
        self.blocks = blocks_of(model)
        self.passes: list[int] = []  # rows of each pass the operation's work made
        self.prepare_passes: list[int] = []  # rows of each pass made while preparing (the model checks)
        self.backwards = 0
        self._last: int | None = None
        self._preparing = 0

    def __enter__(self) -> PassCounter:
        from entoscope.operation import Operation

        self._handles = [b.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
                         for i, b in enumerate(self.blocks)]
        self._grad = torch.autograd.grad
        torch.autograd.grad = self._counting_grad
        self._prepare = Operation.prepare_for
        counter, prepare = self, Operation.prepare_for

        def preparing(op: Any, *args: Any, **kwargs: Any) -> Any:
            counter._preparing += 1
            counter._last = None
            try:
                return prepare(op, *args, **kwargs)
            finally:
                counter._preparing -= 1
                counter._last = None
        Operation.prepare_for = preparing  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from entoscope.operation import Operation

        for h in self._handles:
            h.remove()
        torch.autograd.grad = self._grad
        Operation.prepare_for = self._prepare  # type: ignore[method-assign]

    def _pre_hook(self, i: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else \
                next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            passes = self.prepare_passes if self._preparing else self.passes
            if self._last is None or i <= self._last:
                passes.append(0)
            passes[-1] = max(passes[-1], int(x.shape[0]))
            self._last = i
        return hook

    def _counting_grad(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        wrt = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        self.backwards += max((int(t.shape[0]) if t.dim() >= 3 else 1) for t in wrt)
        return self._grad(outputs, inputs, *args, **kwargs)

    @property
    def forwards(self) -> int:
        return sum(self.passes)


# ---------------------------------------------------------------------------------------------- check functions
def _agrees(planned: int, done: int, at_most: bool) -> bool:
    return done <= planned if at_most else done == planned


def check_plan_matches_run(op: Any, model: Any, data: Any, at_most: Any = ()) -> Any:
    """plan() states what run() does: its rows are the table's rows, its forward and backward passes the
    prompt forwards and backwards counted on the model's own blocks (`at_most`: the names of those the plan
    can only bound, because they depend on the numbers). Returns the run's Result."""
    plan = op.plan(model, data)  # the first preparation runs the once-per-model checks
    with PassCounter(model) as counted:
        result = op.run(model, data, quiet=True)
    done = {"rows": len(result.table), "forward_passes": counted.forwards, "backward_passes": counted.backwards}
    wrong = {k: (getattr(plan, k), v) for k, v in done.items() if not _agrees(getattr(plan, k), v, k in at_most)}
    assert not wrong, f"{op.name}: planned vs run {wrong} (forward passes of {counted.passes})"
    return result


def check_prepare_runs_no_model(op: Any, model: Any, data: Any) -> None:
    """Preparing again (plan(), and each run's own preparation) runs no forward pass: what preparing checks
    on the model (adapting it, the part-way start, the circuits' split check) is done once per model."""
    op.plan(model, data)
    with PassCounter(model) as counted:
        op.plan(model, data)
    assert not counted.prepare_passes, f"{op.name}: a second plan() ran passes of {counted.prepare_passes} rows"


def _frames_equal(a: pd.DataFrame | None, b: pd.DataFrame | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_exact=True,
                                      obj=what)


def check_same_results(a: Any, b: Any, what: str) -> None:
    """Two Results hold the same table and per-prompt table, bit for bit."""
    _frames_equal(a.table, b.table, f"{what}: table")
    _frames_equal(a.per_prompt, b.per_prompt, f"{what}: per_prompt")


def _differs(a: pd.Series, b: pd.Series) -> bool:
    x, y = a.to_numpy(), b.to_numpy()
    if pd.api.types.is_float_dtype(a):
        return not np.array_equal(x.astype(float), y.astype(float), equal_nan=True)
    return list(map(str, x)) != list(map(str, y))


def check_seed(case: Case, make_model: Callable[[], Any], first: Any) -> None:
    """Another run with the same seed gives the same tables; another seed changes what is random (case.random),
    or nothing where the operation makes no random choice."""
    data = case.dataset()
    check_same_results(first, case.op(0).run(make_model(), data, quiet=True), "same seed")
    other = case.op(1).run(make_model(), data, quiet=True)
    if case.random:
        changed = [c for c in case.random if _differs(first.table[c], other.table[c])]
        assert changed, f"another seed left {list(case.random)} unchanged"
    else:
        check_same_results(first, other, "another seed (the operation makes no random choice)")


def load_saved(path: str | Path) -> Any:
    """A saved run read back as users read it: `es.Result.load` (table, per_prompt, takeaway, manifest)."""
    return es.Result.load(path)


def _same_saved_frame(saved: pd.DataFrame | None, held: pd.DataFrame | None, what: str) -> None:
    assert (saved is None) == (held is None), f"{what}: saved {saved is not None}, held {held is not None}"
    if held is not None:
        pd.testing.assert_frame_equal(saved.reset_index(drop=True), held.reset_index(drop=True),
                                      check_exact=True, obj=what)


def check_round_trip(result: Any, folder: Path) -> None:
    """save() then Result.load() gives back the table, the per-prompt table, the takeaway and the manifest
    (the files' own tables are also read with pandas, so the round trip is checked against the files)."""
    from entoscope.results.result import _parquet_safe

    result.save(folder)
    back = load_saved(folder)
    _same_saved_frame(back.table, result.table, "loaded table")
    _same_saved_frame(back.per_prompt, result.per_prompt, "loaded per_prompt")
    pd.testing.assert_frame_equal(pd.read_parquet(folder / "table.parquet"), _parquet_safe(result.table),
                                  check_exact=True, obj="table.parquet")
    assert str(back.takeaway) == str(result.takeaway), "the loaded takeaway differs from the result's"
    expected = json.loads(json.dumps(result.manifest, default=str))
    got = {k: v for k, v in back.manifest.items() if k in expected}
    assert got == expected, "the saved manifest differs from the result's"
    assert back.manifest["takeaway"] == str(result.takeaway)
    assert set(back.manifest["files"]) <= {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


MIDDLE_LAYER = 1  # of the 3-layer model the NaN check builds


_NAN_MODELS: dict[str, tuple[Any, str]] = {}


def nan_weight_model(kind: str) -> tuple[Any, str]:
    """A 3-layer tiny model of the kind with NaN in one MLP weight of its middle block; (model, that weight's
    name). Made once per backend (a refused run leaves it as it is); a new CachedModel around it each call."""
    backend = kind.split("+")[0]
    if backend not in _NAN_MODELS:
        _NAN_MODELS[backend] = _with_nan(build_model("tiny", backend, n_layers=3))
    model, name = _NAN_MODELS[backend]
    if kind.endswith("+cached"):
        model = es.CachedModel(model, cache_dir=cold_cache_dir())
    return model, name


def _with_nan(model: Any) -> tuple[Any, str]:
    layer = re.compile(rf"(^|\.)(h|blocks|layers)\.{MIDDLE_LAYER}\.")
    tl = adapt(model).module
    name, p = next((n, p) for n, p in tl.named_parameters() if layer.search(n) and "mlp" in n and p.dim() == 2)
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    return model, name


def check_nan_refused(op: Any, model: Any, data: Any) -> None:
    """A NaN in a weight of the middle block is refused with an EntoscopeError naming that block."""
    try:
        op.run(model, data, quiet=True)
    except EntoscopeError as err:
        assert err.code, "an EntoscopeError without a code"
        where = re.compile(rf"(^|[ .])(h|blocks|layers)\.{MIDDLE_LAYER}\.")
        assert where.search(str(err)), f"the refusal does not name block {MIDDLE_LAYER}: {err}"
        return
    raise AssertionError(f"{op.name} ran a model with NaN in a weight of block {MIDDLE_LAYER}")


# What is not an aggregate, whatever the operation: statistics of another column (X_ci_low ... of X), the
# interval level, the multiple-testing decision, counts and integer coordinates (not floats).
STAT_SUFFIXES = ("_ci_low", "_ci_high", "_se", "_p", "_q", "_std", "_influence", "_influential_prompt", "_fragile")
NOT_AGGREGATES = {"ci_level", "significant"}


def aggregates(case: Case, table: pd.DataFrame) -> list[str]:
    """The table's aggregate columns: float columns (a number per row made from the prompts' values), except
    the row's own coordinates (case.ids), statistics of another aggregate (STAT_SUFFIXES), NOT_AGGREGATES and
    what the case declares descriptive (a number for reading, not a finding)."""
    out = []
    for col in table.columns:
        if col in case.ids or col in NOT_AGGREGATES or col in case.descriptive:
            continue
        if any(col.endswith(s) and col[: -len(s)] in table for s in STAT_SUFFIXES):
            continue
        if pd.api.types.is_float_dtype(table[col]):
            out.append(col)
    return out


def check_intervals(case: Case, table: pd.DataFrame) -> None:
    """Every aggregate column X has X_ci_low and X_ci_high; what the case declares descriptive is in the table."""
    missing = [c for c in aggregates(case, table) if f"{c}_ci_low" not in table or f"{c}_ci_high" not in table]
    assert not missing, f"aggregate columns without X_ci_low / X_ci_high: {missing}"
    stale = [c for c in case.descriptive if c not in table]
    assert not stale, f"columns declared descriptive that the table does not have: {stale}"


# The ids a takeaway may use for a row: an edge (a0.h1->m1), component ids (a0.h3; a1 and m0: layer 1's attention
# and layer 0's MLP), canonical activation names (resid_pre.1), layers (L1, "layer 1").
_EDGE = re.compile(r"(?<![\w.>-])([\w.]+->[\w.]+)")
_COMPONENT = re.compile(r"(?<![\w.>-])(?:a(\d+)(?:\.h(\d+))?|m(\d+))(?![\w-]|\.\w|->)")
_ACTIVATION = re.compile(r"(?<![\w.])(resid_pre|resid_mid|resid_post|attn_out|mlp_out|mlp_pre|mlp_post|z|q|k|v|"
                         r"pattern|attn_scores|result|attn_in|mlp_in)\.(\d+)(?![\w.])")
_LAYER = re.compile(r"(?<![\w.])(?:L|layer )(\d+)(?![\w.])")
_NEURON = re.compile(r"(?<![\w.>-])m(\d+)\.n(\d+)(?![\w-]|\.\w|->)")  # m1.n13: neuron 13 of MLP 1
_FEATURE = re.compile(r"(?<![\w.>-])(?:m(\d+)|a(\d+)|[a-z_]+\.(\d+))\.f(\d+)(?![\w-]|\.\w|->)")  # m1.f3, resid_post.1.f256


def mentioned_ids(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(id as written, what it names: coordinates, and the kind of component or activation) for every row
    id the text mentions."""
    found: list[tuple[str, dict[str, Any]]] = [(m.group(1), {}) for m in _EDGE.finditer(text)]
    rest = _EDGE.sub(" ", text)
    found += [(m.group(0), {"layer": int(m.group(1)), "neuron": int(m.group(2))}) for m in _NEURON.finditer(rest)]
    rest = _NEURON.sub(" ", rest)
    found += [(m.group(0), {"layer": int(next(g for g in m.groups()[:3] if g is not None)),
                            "feature": int(m.group(4))}) for m in _FEATURE.finditer(rest)]
    rest = _FEATURE.sub(" ", rest)
    for m in _COMPONENT.finditer(rest):
        if m.group(3) is not None:
            found.append((m.group(0), {"layer": int(m.group(3)), "kind": "mlp"}))
        else:
            found.append((m.group(0), {"layer": int(m.group(1)), "head": None if m.group(2) is None else
                                       int(m.group(2)), "kind": "attention"}))
    found += [(m.group(0), {"layer": int(m.group(2)), "activation": m.group(1)}) for m in _ACTIVATION.finditer(rest)]
    found += [(m.group(0), {"layer": int(m.group(1))}) for m in _LAYER.finditer(rest)]
    return found


def _names_a_row(case: Case, table: pd.DataFrame, written: str, what: dict[str, Any]) -> bool:
    """Whether an id names a row: it is in one of the case's id columns, or the row's coordinates are it."""
    if any(col in table and written in set(table[col].astype(str)) for col in case.ids):
        return True
    if "feature" in what:  # a feature of the dictionary at that layer's site (the table may have no layer column)
        if "feature" not in table:
            return False
        rows = table["feature"].astype("float") == what["feature"]
        if "layer" in table and table["layer"].notna().any():
            rows &= table["layer"].astype("float") == what["layer"]
        return bool(rows.any())
    if "layer" not in what or "layer" not in table:
        return False
    rows = table["layer"].astype("float") == what["layer"]
    if "neuron" in what:
        return "neuron" in table and bool((rows & (table["neuron"].astype("float") == what["neuron"])).any())
    if "head" in what:
        if "head" not in table:
            return False
        rows &= table["head"].isna() if what["head"] is None else table["head"].astype("float") == what["head"]
    if "kind" in table and "kind" in what and what["kind"] in set(table["kind"].astype(str)):
        rows &= table["kind"].astype(str) == what["kind"]  # a component table (DLA, IFR): attention or mlp
    if "activation" in what and "activation" in table:
        rows &= table["activation"].astype(str) == what["activation"]
    return bool(rows.any())


def _table_ids_in(case: Case, table: pd.DataFrame, text: str) -> list[str]:
    """The table's own ids (of the case's id columns) written in the text as whole words."""
    ids = {str(v) for col in case.ids if col in table for v in table[col].dropna()}
    return [i for i in ids if re.search(rf"(?<![\w.-]){re.escape(i)}(?![\w-]|\.\w)", text)]


def check_takeaway(case: Case, result: Any) -> None:
    """A takeaway exists and every row id it mentions names a row of the table (by an id column, or by the
    coordinates it spells: a1.h2 = layer 1, head 2)."""
    text = result.takeaway
    assert isinstance(text, str) and text.strip(), f"{result.operation} has no takeaway"
    ids = mentioned_ids(text)
    stray = [w for w, what in ids if not _names_a_row(case, result.table, w, what)]
    assert not stray, f"the takeaway names {stray}, which are no rows of the table: {text!r}"
    if case.names_rows:
        assert ids or _table_ids_in(case, result.table, text), f"the takeaway names no row of the table: {text!r}"


def check_shards(case: Case, make_model: Callable[[], Any], plain: Any, folder: Path) -> None:
    """A sharded operation's run with its shards written one batch each equals its one-shard run, bit for bit."""
    op = case.op(0)
    if op.not_sharded_reason():
        return
    sharded = op.run(make_model(), case.dataset(), quiet=True, shards_dir=folder)
    assert len(list(folder.glob("*.parquet"))) >= 2, "the run made fewer than two shards: nothing was checked"
    check_same_results(plain, sharded, "one shard vs one batch per shard")
