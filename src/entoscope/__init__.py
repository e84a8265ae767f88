"""entoscope: mechanistic interpretability of language models, over datasets, with numbers you can check.

    import entoscope as es
    model = es.load_model("demo")                     # or a TransformerBridge / HookedTransformer
    data = es.tasks.ioi(n=64)
    result = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"])).run(model, data)
    result.save("runs/ioi_lens")
"""

from . import errors
from .circuits import Circuits, DirectLogitAttribution, HeadScores, InformationFlowRoutes
from .data import Dataset, DataSpec, Example, load_data
from .data import tasks
from .dictionaries import DecoderLens, FeatureDLA, FeatureGraph
from .errors import EntoscopeError
from .executors import InProcess, Ray
from .lens import Lens, ParameterLens, TunedLens
from .metrics import Metric
from .models import ActName, CachedModel, Intervention, ModelAdapter, adapt, load_model
from .operation import Operation, Plan
from .patching import Patching
from .probing import Probing
from .registry import register
from .results import Result
from .sites import Sites
from .steering import Direction, Steering

__version__ = "0.1.0.dev0"
__all__ = ["ActName", "CachedModel", "Circuits", "Dataset", "DataSpec", "DecoderLens", "Direction", "DirectLogitAttribution", "EntoscopeError", "Example", "FeatureDLA", "FeatureGraph", "HeadScores",
           "InProcess", "InformationFlowRoutes", "Intervention", "Lens",
           "Metric", "ModelAdapter", "Operation", "ParameterLens", "Patching", "Plan", "Probing", "Ray", "Result", "Sites", "Steering", "TunedLens", "adapt",
           "errors", "load_data", "load_model", "register", "tasks"]
