"""Circuit discovery: head scores, direct logit attribution, information flow routes, component graph,
EAP / EAP-IG, edge patching and faithfulness, ACDC."""

from . import report as _circuits_report  # noqa: F401  (registers the "circuits" report section)
from . import report_dla  # noqa: F401  (registers the "dla" report section)
from . import report_ifr  # noqa: F401  (registers the "ifr" report section)
from .dla import DirectLogitAttribution
from .graph import Circuit, ComponentGraph
from .head_scores import HeadScores
from .ifr import InformationFlowRoutes
from .operation import Circuits

__all__ = ["Circuit", "Circuits", "ComponentGraph", "DirectLogitAttribution", "HeadScores",
           "InformationFlowRoutes"]
