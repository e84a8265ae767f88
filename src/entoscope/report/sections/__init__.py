"""One module per report section; importing this package registers them all."""

from . import circuits, dla, features, head_scores, ifr, lens, patching, probing, steering  # noqa: F401
