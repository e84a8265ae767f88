"""Circuit discovery: head scores, direct logit attribution, information flow routes, component graph,
EAP / EAP-IG, edge patching and faithfulness, ACDC."""

from .dla import DirectLogitAttribution
from .graph import Circuit, ComponentGraph
from .head_scores import HeadScores
from .ifr import InformationFlowRoutes
from .operation import Circuits

__all__ = ["Circuit", "Circuits", "ComponentGraph", "DirectLogitAttribution", "HeadScores",
           "InformationFlowRoutes"]
