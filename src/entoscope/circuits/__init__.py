"""Circuit discovery: head scores, direct logit attribution, information flow routes, component graph,
EAP / EAP-IG, edge patching and faithfulness, ACDC."""

from . import report_dla  # noqa: F401  (registers the "dla" report section)
from .dla import DirectLogitAttribution
from .head_scores import HeadScores
from .ifr import InformationFlowRoutes

__all__ = ["DirectLogitAttribution", "HeadScores", "InformationFlowRoutes"]
