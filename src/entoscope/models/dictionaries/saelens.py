"""SAELens's folder format, read and written by entoscope itself, and SAELens SAE objects.

A folder holds `cfg.json` and `sae_weights.safetensors` (W_enc [d_in, d_sae], W_dec [d_sae, d_out],
b_enc, b_dec, and per architecture threshold / b_gate, r_mag, b_mag). cfg.json comes in two layouts:
SAELens 6 (architecture, d_in, d_sae, apply_b_dec_to_input, normalize_activations, k for topk, and
the hook under "metadata" (or "meta")), and the flat layout of earlier releases (hook_name or
hook_point at the top level; a top-k SAE written as architecture "standard" with activation_fn
"topk" and activation_fn_kwargs {k}). Both are read; the SAELens 6 layout is written.

A transcoder's output site is cfg.json's hook_name_out (older SAELens, and what entoscope writes); recent
SAELens releases record only d_out, and then an MLP transcoder (reading mlp_in or resid_mid of layer L) is
taken to write mlp_out.L.

Refused by name (DictionaryError): architectures other than standard, topk, jumprelu, gated and the
plain/jumprelu transcoders; input normalisation (normalize_activations other than "none": fold the
scaling factor into the weights first); hook_z reshaping and per-head hooks; a fine-tuning scaling
factor; top-k activations rescaled by decoder norms; a skip connection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ...errors import DictionaryError, EntoscopeError, UnknownNameError
from ...files import read_tensors
from ..names import parse_name
from .dictionary import ARCHITECTURES, SPACES, Dictionary

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
_TRANSCODERS = {"transcoder": "standard", "jumprelu_transcoder": "jumprelu"}
_NEEDS = {"standard": ("b_enc",), "topk": ("b_enc",), "jumprelu": ("b_enc", "threshold"),
          "gated": ("b_gate", "r_mag", "b_mag")}
_VECTORS = ("b_enc", "b_dec", "threshold", "b_gate", "r_mag", "b_mag")
_META_KEYS = ("model_name", "hook_name", "hook_layer", "hook_head_index", "model_class_name",
              "model_from_pretrained_kwargs", "prepend_bos", "context_size", "dataset_path", "neuronpedia_id")


def is_folder(path: Path) -> bool:
    return (path / CFG).is_file() and (path / WEIGHTS).is_file()


def read_folder(path: str | Path, name: str = "") -> Dictionary:
    """A Dictionary from a SAELens folder (cfg.json + sae_weights.safetensors)."""
    path = Path(path)
    if not is_folder(path):
        raise DictionaryError(f"{path} is not a SAELens dictionary folder (it needs {CFG} and {WEIGHTS})",
                              code="dictionary_not_found",
                              remedy="point at the folder that holds cfg.json and sae_weights.safetensors")
    try:
        cfg = json.loads((path / CFG).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as err:
        raise DictionaryError(f"{path / CFG} is not JSON ({type(err).__name__}: {err})",
                              code="dictionary_format_invalid",
                              remedy="rewrite the folder with entoscope.dictionaries.save_dictionary") from None
    if not isinstance(cfg, dict):
        raise DictionaryError(f"{path / CFG} holds a JSON {type(cfg).__name__}, not an object",
                              code="dictionary_format_invalid", remedy="cfg.json is a mapping (SAELens's layout)")
    weights, _ = read_tensors(path / WEIGHTS, refuse=_corrupt)
    try:
        return from_config(cfg, weights, name=name or path.name, where=str(path))
    except EntoscopeError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:  # a hand-edited cfg.json
        raise DictionaryError(f"{path / CFG} cannot be read as a SAELens config ({type(err).__name__}: {err})",
                              code="dictionary_format_invalid", remedy="check cfg.json against SAELens's layout, "
                              "or write the folder again with entoscope.dictionaries.save_dictionary") from None


def _corrupt(message: str) -> DictionaryError:
    return DictionaryError(message, code="dictionary_corrupt", remedy="copy or download the dictionary again, or "
                           "write it again (entoscope train-sae, entoscope.dictionaries.save_dictionary)")


def from_config(cfg: dict[str, Any], weights: dict[str, torch.Tensor], *, name: str, where: str) -> Dictionary:
    """A Dictionary from a cfg.json mapping and its weights (checked against each other)."""
    meta = {**{k: cfg[k] for k in _META_KEYS if k in cfg}, **(cfg.get("metadata") or cfg.get("meta") or {})}
    arch = str(cfg.get("architecture", "standard"))
    activation = str(cfg.get("activation_fn", cfg.get("activation_fn_str", "relu")))
    k = cfg.get("k")
    if arch == "standard" and activation == "topk":  # the layout before SAELens 6
        arch, k = "topk", (cfg.get("activation_fn_kwargs") or {}).get("k")
    transcoder = arch in _TRANSCODERS
    arch = _TRANSCODERS.get(arch, arch)
    if arch not in ARCHITECTURES:
        raise DictionaryError(f"{where}: architecture {arch!r} is not supported", code="dictionary_architecture_unsupported",
                              remedy="entoscope reads standard (ReLU), topk, jumprelu and gated SAEs, and "
                              "transcoder / jumprelu_transcoder")
    if arch == "standard" and activation not in ("relu", "topk"):
        raise DictionaryError(f"{where}: activation function {activation!r} is not supported",
                              code="dictionary_architecture_unsupported", remedy="use a ReLU, top-k, JumpReLU or gated SAE")
    _refuse_options(cfg, meta, where)
    hook_name = meta.get("hook_name") or cfg.get("hook_point")
    if not hook_name:
        raise DictionaryError(f"{where}: cfg.json names no hook (hook_name)", code="dictionary_format_invalid",
                              remedy="add metadata.hook_name, e.g. blocks.1.hook_resid_post")
    hook_in = _canonical(hook_name, where)
    hook_out = hook_in
    if transcoder:
        named = cfg.get("hook_name_out") or (cfg.get("entoscope") or {}).get("hook_out")
        hook_out = _canonical(named, where) if named else _transcoder_output(hook_in, where)
    space = str((cfg.get("entoscope") or {}).get("space") or _space_of(meta))
    _check_tensors(weights, where)
    sizes = {**{label: cfg.get(label) for label in ("d_in", "d_sae", "d_out")}, "k": k}
    wrong = [f"{label}={v!r}" for label, v in sizes.items()
             if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1)]
    if wrong:
        raise DictionaryError(f"{where}: cfg.json has {', '.join(wrong)} (sizes are whole numbers >= 1)",
                              code="dictionary_format_invalid", remedy="check cfg.json against the weights")
    d = Dictionary(
        arch, _weight(weights, "W_enc", where), _weight(weights, "W_dec", where), _weight(weights, "b_dec", where),
        hook_in, hook_out, b_enc=weights.get("b_enc"), threshold=weights.get("threshold"),
        b_gate=weights.get("b_gate"), r_mag=weights.get("r_mag"), b_mag=weights.get("b_mag"),
        k=int(k) if k is not None else None, apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        space=space, name=name, meta={"cfg": cfg},
    )
    check(d, where, declared=(cfg.get("d_in"), cfg.get("d_sae"), cfg.get("d_out")))
    return d


def _refuse_options(cfg: dict[str, Any], meta: dict[str, Any], where: str) -> None:
    norm = cfg.get("normalize_activations", "none")
    refusals = [
        (norm not in (None, "none", False), f"normalize_activations={norm!r}",
         "fold the activation scaling factor into W_enc, b_dec and W_dec (SAELens: "
         "fold_activation_norm_scaling_factor) and save with normalize_activations 'none'"),
        (cfg.get("reshape_activations", "none") not in (None, "none"), "hook_z reshaping",
         "entoscope reads SAEs on residual, attention-output and MLP activations, not on z"),
        (meta.get("hook_head_index") is not None or cfg.get("hook_head_index_out") is not None, "a per-head hook",
         "use an SAE on a whole activation"),
        (bool(cfg.get("finetuning_scaling_factor")), "a fine-tuning scaling factor",
         "fold the scaling factor into W_dec first"),
        (bool(cfg.get("rescale_acts_by_decoder_norm")), "top-k activations rescaled by decoder norms",
         "fold the decoder norms into the encoder (SAELens: fold_W_dec_norm) and save again"),
    ]
    for bad, what, remedy in refusals:
        if bad:
            raise DictionaryError(f"{where}: {what} is not supported", code="dictionary_option_unsupported",
                                  remedy=remedy)


def _transcoder_output(hook_in: str, where: str) -> str:
    """Recent SAELens transcoders do not record where they write: an MLP transcoder (reading the MLP's
    input, normalised or not) writes that MLP's output; anything else must say so."""
    act = parse_name(hook_in)
    if act.kind in ("mlp_in", "resid_mid") and act.layer is not None:
        return f"mlp_out.{act.layer}"
    raise DictionaryError(f"{where}: a transcoder reading {hook_in} does not say which activation it writes",
                          code="dictionary_format_invalid",
                          remedy="add hook_name_out to cfg.json (e.g. blocks.3.hook_mlp_out)")


def _space_of(meta: dict[str, Any]) -> str:
    """SAELens trains on HookedTransformer.from_pretrained (processed) unless the kwargs turn processing off."""
    kwargs = meta.get("model_from_pretrained_kwargs") or {}
    if kwargs.get("fold_ln") is False and kwargs.get("center_writing_weights") is False:
        return "plain"
    return "processed"


def _canonical(hook: str, where: str) -> str:
    try:
        act = parse_name(str(hook))
    except UnknownNameError as err:
        raise DictionaryError(f"{where}: hook {hook!r} is not an activation entoscope knows ({err.message})",
                              code="dictionary_hook_unknown", remedy=err.remedy) from None
    return str(act)


def _check_tensors(weights: dict[str, torch.Tensor], where: str) -> None:
    """Matrices where matrices belong, vectors where vectors do, floating-point and finite (weights from a
    file were checked by read_tensors already; an sae_lens object's are checked here)."""
    for key, t in weights.items():
        ndim = 2 if key in ("W_enc", "W_dec") else 1 if key in _VECTORS else None
        if ndim is not None and (t.ndim != ndim or 0 in t.shape):
            raise DictionaryError(f"{where}: {key} has shape {tuple(t.shape)}; it must be a non-empty "
                                  f"{'matrix' if ndim == 2 else 'vector'}", code="dictionary_shape_mismatch",
                                  remedy="the weights must come from a SAELens dictionary")
        if ndim is not None and not t.is_floating_point():
            raise _corrupt(f"{where}: {key} holds {str(t.dtype).removeprefix('torch.')} values, not floats")
        if ndim is not None and not bool(torch.isfinite(t).all()):
            raise _corrupt(f"{where}: {key} holds {int((~torch.isfinite(t)).sum())} NaN or infinite value(s)")


def _weight(weights: dict[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
    if key not in weights:
        raise DictionaryError(f"{where}: the weights have no {key} (they have {', '.join(sorted(weights))})",
                              code="dictionary_format_invalid", remedy="write the folder with SAELens or entoscope")
    return weights[key]


def check(d: Dictionary, where: str, declared: tuple[Any, Any, Any] = (None, None, None)) -> None:
    """Refuse weights whose shapes disagree with each other, the architecture, or the declared sizes."""
    if d.space not in SPACES:
        raise DictionaryError(f"{where}: space {d.space!r} is not one of {', '.join(SPACES)}",
                              code="dictionary_format_invalid", remedy="plain, processed or any")
    missing = [n for n in _NEEDS[d.architecture] if getattr(d, n) is None]
    if d.architecture == "topk" and (d.k is None or not 0 < d.k <= d.d_sae):
        missing.append(f"k in 1..{d.d_sae}")
    if missing:
        raise DictionaryError(f"{where}: a {d.architecture} dictionary needs {', '.join(missing)}",
                              code="dictionary_format_invalid", remedy="check cfg.json and the weights")
    n_in, n_sae, n_out = d.d_in, d.d_sae, d.d_out
    expect = {"W_dec": (n_sae, n_out), "b_dec": (n_out,)}
    expect.update({n: (n_sae,) for n in ("b_enc", "threshold", "b_gate", "r_mag", "b_mag") if getattr(d, n) is not None})
    wrong = [f"{n} {tuple(getattr(d, n).shape)} (expected {s})" for n, s in expect.items()
             if tuple(getattr(d, n).shape) != s]
    if not d.is_transcoder and n_in != n_out:
        wrong.append(f"an SAE must reconstruct its input: d_in {n_in} != d_out {n_out}")
    for size, actual, label in zip(declared, (n_in, n_sae, n_out), ("d_in", "d_sae", "d_out")):
        if size is not None and int(size) != actual:
            wrong.append(f"cfg.json {label}={size} but the weights have {actual}")
    if wrong:
        raise DictionaryError(f"{where}: inconsistent weights: {'; '.join(wrong)}", code="dictionary_shape_mismatch",
                              remedy="the folder's cfg.json and sae_weights.safetensors must come from one dictionary")


def config(d: Dictionary, model_name: str = "") -> dict[str, Any]:
    """cfg.json for a dictionary, in SAELens 6's layout (plus an "entoscope" block SAELens ignores)."""
    arch = d.architecture
    if d.is_transcoder:
        if arch not in ("standard", "jumprelu"):
            raise DictionaryError(f"a {arch} transcoder has no SAELens architecture name",
                                  code="dictionary_architecture_unsupported", remedy="save a standard or jumprelu transcoder")
        arch = {"standard": "transcoder", "jumprelu": "jumprelu_transcoder"}[arch]
    hook_in, hook_out = parse_name(d.hook_in), parse_name(d.hook_out)
    cfg: dict[str, Any] = {
        "architecture": arch, "d_in": d.d_in, "d_sae": d.d_sae, "dtype": str(d.W_enc.dtype).removeprefix("torch."),
        "device": "cpu", "apply_b_dec_to_input": bool(d.apply_b_dec_to_input and not d.is_transcoder),
        "normalize_activations": "none", "reshape_activations": "none",
        "metadata": {"model_name": model_name or d.meta.get("model_name", ""), "hook_name": tl_hook(hook_in),
                     "hook_layer": hook_in.layer, "hook_head_index": None, "prepend_bos": True},
        "entoscope": {"space": d.space, "hook_in": d.hook_in, "hook_out": d.hook_out},
    }
    if d.architecture == "topk":
        cfg["k"] = d.k
    if d.is_transcoder:
        cfg.update({"d_out": d.d_out, "hook_name_out": tl_hook(hook_out), "hook_layer_out": hook_out.layer,
                    "hook_head_index_out": None})
    return cfg


def tl_hook(act: Any) -> str:
    """The HookedTransformer hook name of a canonical activation (what SAELens's hook_name holds)."""
    special = {"mlp_in": "ln2.hook_normalized", "attn_in": "ln1.hook_normalized"}
    if act.kind in special:
        return f"blocks.{act.layer}.{special[act.kind]}"
    top = {"embed": "hook_embed", "pos_embed": "hook_pos_embed"}
    if act.kind in top:
        return top[act.kind]
    attn = ("q", "k", "v", "z", "pattern", "attn_scores")
    mlp = {"mlp_pre": "mlp.hook_pre", "mlp_post": "mlp.hook_post"}
    if act.kind in attn:
        return f"blocks.{act.layer}.attn.hook_{act.kind}"
    if act.kind in mlp:
        return f"blocks.{act.layer}.{mlp[act.kind]}"
    return f"blocks.{act.layer}.hook_{act.kind}"


def write_folder(d: Dictionary, path: str | Path, model_name: str = "", extra: dict[str, Any] | None = None) -> Path:
    """Write a dictionary as a SAELens folder; returns the folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(d, model_name)
    if extra:
        cfg["entoscope"].update(extra)
    save_file({n: t.detach().contiguous().cpu() for n, t in d.tensors().items()}, str(path / WEIGHTS))
    (path / CFG).write_text(json.dumps(cfg, indent=1) + "\n")
    return path


def from_sae_lens(sae: Any, name: str = "") -> Dictionary:
    """A Dictionary holding the weights of a SAELens SAE object (sae_lens.SAE or a Transcoder).

    Reads the object's config the same way as a folder's cfg.json (so the same refusals apply),
    with the weights from its state dict (a training SAE's log_threshold becomes threshold)."""
    cfg_obj = sae.cfg
    cfg = cfg_obj.to_dict() if hasattr(cfg_obj, "to_dict") else dict(vars(cfg_obj))
    arch = cfg_obj.architecture() if callable(getattr(cfg_obj, "architecture", None)) else cfg.get("architecture")
    cfg["architecture"] = arch
    state = {k: v.detach().clone() for k, v in sae.state_dict().items()}
    if "log_threshold" in state:
        state["threshold"] = state.pop("log_threshold").exp()
    return from_config(cfg, state, name=name or f"sae_lens:{cfg.get('metadata', cfg).get('hook_name', arch)}",
                       where=f"sae_lens {type(sae).__name__}")
