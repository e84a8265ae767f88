"""Linear probes over many sites at once: batched torch solvers, held-out metrics, control tasks.

Model-independent core: give it activations [sites, examples, features] and labels; see
docs/probing.md for the method and the definitions. On a model: the `Probing` operation (collection
at any sites, pooling, probes, control task, causal check) and `collect_activations`.
"""

from .causal import CausalCheck
from .collect import Collected, collect_activations

from .controls import group_labels, shuffled_labels
from .fit import DEFAULT_ALPHA_GRID, DEFAULT_C_GRID, fit_probes
from .metrics import accuracy, auroc, auroc_ovr, f1_macro, mse, r2
from .operation import Probing, ProbingResult
from .pooling import Pooling
from .project import orthonormal_basis, project_out
from .result import ProbeDirections, ProbeFit, load_directions
from .solvers import LinearSolution, LogisticProbe, logistic_path, ridge_path
from .splits import Split, holdout_split, kfold_indices, kfold_splits
from .standardize import Standardizer

__all__ = [
    "CausalCheck",
    "Collected",
    "Pooling",
    "Probing",
    "ProbingResult",
    "collect_activations",
    "DEFAULT_ALPHA_GRID",
    "DEFAULT_C_GRID",
    "LinearSolution",
    "LogisticProbe",
    "ProbeDirections",
    "ProbeFit",
    "Split",
    "Standardizer",
    "accuracy",
    "auroc",
    "auroc_ovr",
    "f1_macro",
    "fit_probes",
    "group_labels",
    "holdout_split",
    "kfold_indices",
    "kfold_splits",
    "load_directions",
    "logistic_path",
    "mse",
    "orthonormal_basis",
    "project_out",
    "r2",
    "ridge_path",
    "shuffled_labels",
]
