"""entoscope: mechanistic interpretability of language models, over datasets, with numbers you can check.

    import entoscope as es
    model = es.load_model("demo")                     # or a TransformerBridge / HookedTransformer
    data = es.tasks.ioi(n=64)
    result = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"])).run(model, data)
    result.save("runs/ioi_lens")

Every public name is imported on first use (`_lazy.py`): `import entoscope` itself loads no torch.
A new public name is one line of `_EXPORTS`.
"""

from ._lazy import lazy_exports

__version__ = "0.1.0.dev0"

_EXPORTS = {  # public name -> the module it lives in ("module:" is the module itself)
    "ActName": ".models.names",
    "CachedModel": ".models.cached",
    "Circuits": ".circuits.operation",
    "Dataset": ".data.examples",
    "DataSpec": ".data.loading",
    "DecoderLens": ".dictionaries.lens",
    "Direction": ".steering.direction",
    "DirectLogitAttribution": ".circuits.dla",
    "EntoscopeError": ".errors",
    "Example": ".data.examples",
    "FeatureDLA": ".dictionaries.dla",
    "FeatureGraph": ".dictionaries.graph",
    "HeadScores": ".circuits.head_scores",
    "InProcess": ".executors.config",
    "Inspect": ".inspection.operation",
    "InspectResult": ".inspection.result",
    "InformationFlowRoutes": ".circuits.ifr",
    "Intervention": ".models.adapter",
    "JacobianLens": ".lens.jacobian",
    "JacobianLensFit": ".lens.jacobian_fit",
    "Lens": ".lens.operation",
    "LensComparison": ".lens.compare",
    "CoordinatePatching": ".lens.coordinate_patch",
    "Metric": ".metrics",
    "ModelAdapter": ".models.adapter",
    "Operation": ".operation",
    "ParameterLens": ".lens.parameter",
    "Patching": ".patching.operation",
    "Interchange": ".interchange.operation",
    "Plan": ".prepared",
    "Probing": ".probing.operation",
    "Ray": ".executors.config",
    "Result": ".results.result",
    "Sites": ".sites",
    "Steering": ".steering.operation",
    "TunedLens": ".lens.tuned",
    "adapt": ".models.adapter",
    "errors": ".errors:",
    "inspect": ".inspection.operation",
    "load_data": ".data.loading",
    "load_model": ".models.loading",
    "register": ".registry",
    "tasks": ".data.tasks:",
    "trace": ".tracing",
    "Trace": ".tracing",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
