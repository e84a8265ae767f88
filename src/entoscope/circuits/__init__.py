"""Circuit discovery: head scores, direct logit attribution, component graph, EAP / EAP-IG, edge
patching and faithfulness, information flow routes, ACDC."""

from .head_scores import HeadScores

__all__ = ["HeadScores"]
