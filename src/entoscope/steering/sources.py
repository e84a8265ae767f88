"""The constructors of a `Direction`: a mean difference, a probe, a dictionary feature, a file.

mean_difference (Turner et al. 2023 use one pair; Panickssery et al. 2023, CAA, average many):
    positive prompts minus negative prompts, or each prompt minus its counterfactual (pairs), at one site
    and read position (collect.py); pca=True takes the top principal component of the paired differences.
from_probe: a fitted probe's unit direction in the raw activation basis (probing/result.py: binary probes
    point to the positive class, classes[1]; multi-class: one per class, chosen by `class_index`).
from_feature: row `feature` of a dictionary's decoder W_dec, at the site the dictionary writes (docs/features.md).
from_file: a .npy or .safetensors vector (vectorfile.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from ..models.adapter import ModelAdapter, adapt
from .collect import difference, read_code, site_vectors
from .direction import Direction, canonical_site
from .sites import steerable
from .vectorfile import read_vector

MAX_DIGESTS = 4096  # prompts whose digests a direction keeps (to keep held-out text out of its own prompts)


def prompt_digest(prompt: Any) -> str:
    """A short stable digest of a prompt (text or token ids): the direction remembers its prompts by them."""
    return hashlib.sha1(repr(prompt if isinstance(prompt, str) else tuple(prompt)).encode()).hexdigest()[:12]


def collect_sides(model: ModelAdapter, td: Any, index: list[int], site: Any, head: int | None, read_at: str,
                  *, pairs: bool, batch_size: int, bos_in_mean: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Vectors of prompts `index` of `td` ([n, width] float32; and their counterfactuals' when pairs), in `index`
    order; read_at "mean" leaves a leading BOS out unless bos_in_mean (collect.py)."""
    from ..data.tokenized import pad, pad_id

    pid = pad_id(model)
    bos = None if bos_in_mean else model.bos_token_id
    at = read_code(read_at, td.roles, "read_at")
    at_cf = read_code(read_at, td.cf_roles, "read_at") if pairs else None
    out, out_cf = [], []
    with torch.no_grad():
        for lo in range(0, len(index), batch_size):
            idx = index[lo:lo + batch_size]
            tokens, lengths = pad([td.prompts[i] for i in idx], pid)
            roles = None if td.roles is None else td.roles.subset(idx)
            out.append(site_vectors(model, tokens, lengths, roles, site, head, at, bos))
            if pairs:
                tokens, lengths = pad([td.counterfactuals[i] for i in idx], pid)
                roles = None if td.cf_roles is None else td.cf_roles.subset(idx)
                out_cf.append(site_vectors(model, tokens, lengths, roles, site, head, at_cf, bos))
    first = torch.cat(out).numpy()
    return first, (torch.cat(out_cf).numpy() if pairs else None)


def mean_difference(model: Any, site: str, data: Any, negative: Any = None, *, read_at: str = "last",
                    pca: bool = False, head: int | None = None, batch_size: int = 32,
                    prepend_bos: bool = True, bos_in_mean: bool = False) -> Direction:
    """The mean difference at `site` of `data` minus `negative` (two prompt sets), or, without `negative`, of each
    prompt of `data` minus its counterfactual (contrastive pairs); see the module docstring."""
    from ..data.loading import load_data
    from ..data.tokenized import length_batches, tokenize_data

    a = adapt(model)
    act, _ = steerable(a, site, head)
    pos_data = load_data(data, tokenizer=a.tokenizer)
    pairs = negative is None
    td = tokenize_data(a, pos_data, prepend_bos=prepend_bos, pairs=pairs)
    order = [i for b in length_batches(td.lengths, batch_size) for i in b]  # length-grouped, read back in data order
    with a.evaluating():
        pos, neg = collect_sides(a, td, order, act, head, read_at, pairs=pairs, batch_size=batch_size,
                                 bos_in_mean=bos_in_mean)
        back = np.argsort(order)
        pos = pos[back]
        neg_data = None
        if pairs:
            assert neg is not None
            neg = neg[back]
        else:
            neg_data = load_data(negative, tokenizer=a.tokenizer)
            td_neg = tokenize_data(a, neg_data, prepend_bos=prepend_bos)
            order_neg = [i for b in length_batches(td_neg.lengths, batch_size) for i in b]
            neg, _ = collect_sides(a, td_neg, order_neg, act, head, read_at, pairs=False, batch_size=batch_size,
                                   bos_in_mean=bos_in_mean)
            neg = neg[np.argsort(order_neg)]
    vector, info = difference(pos, neg, paired=pairs, pca=pca)
    prompts = [e.prompt for e in pos_data] + ([e.counterfactual for e in pos_data] if pairs else
                                              [e.prompt for e in neg_data or []])
    provenance = {"source": "pca" if pca else "mean_difference", "site": str(act), "read_at": read_at,
                  **({"bos_in_mean": bos_in_mean} if read_at == "mean" else {}),
                  "pairs": pairs, "data": _data_record(pos_data, data),
                  "negative": None if pairs else _data_record(neg_data, negative), **info,
                  "prompt_digests": [prompt_digest(p) for p in prompts][:MAX_DIGESTS]}
    return Direction(str(act), torch.from_numpy(vector), head, provenance)


def _data_record(dataset: Any, given: Any) -> dict[str, Any]:
    spec = given.model_dump(exclude_defaults=True) if hasattr(given, "model_dump") else \
        given if isinstance(given, dict) else None
    return {"name": dataset.name, "n": len(dataset), "spec": spec if spec is not None else dict(dataset.params)}


def from_probe(probing: Any, site: str | None = None, *, class_index: int | None = None) -> Direction:
    """The unit direction a Probing result fitted at one probed site (its label in the table, e.g. "resid_post.1"; default:
    the only site, else the site with the best held-out score)."""
    table = getattr(probing, "table", None)
    fits = getattr(probing, "extra", {}).get("fits")
    if table is None or not fits or "activation" not in table:
        raise DataError("from_probe takes the Result of a Probing run", code="direction_probe",
                        remedy="run es.Probing(...).run(model, data) and pass its result")
    labels = list(table["site"])
    if site is None:
        score = [c for c in table.columns if c.startswith("test_") and c.count("_") == 1]
        site = labels[int(np.nanargmax(table[score[0]].to_numpy(float)))] if len(labels) > 1 else labels[0]
    if site not in labels:
        raise DataError(f"the probing run has no site {site!r}", code="direction_probe",
                        remedy=f"its sites: {', '.join(labels[:12])}")
    row = table[table["site"] == site].iloc[0]
    fit = next(f for f in fits.values() if site in f.site_names)
    dirs = fit.directions[fit.site_names.index(site)]  # [K', D]
    if dirs.shape[0] > 1 and class_index is None:
        raise DataError(f"the probe at {site} is multi-class ({dirs.shape[0]} directions, one per class)",
                        code="direction_probe", remedy=f"give class_index: 0..{dirs.shape[0] - 1} (classes "
                        f"{list(fit.classes or [])[:8]})")
    k = 0 if class_index is None else class_index
    if not 0 <= k < dirs.shape[0]:
        raise DataError(f"class_index {k} is out of range for {dirs.shape[0]} directions", code="direction_probe",
                        remedy=f"give class_index 0..{dirs.shape[0] - 1}")
    layer = row.get("layer")
    act = canonical_site(f"{row['activation']}.{int(layer)}" if layer is not None and np.isfinite(layer)
                         else str(row["activation"]))
    head = row.get("head")
    head = int(head) if head is not None and np.isfinite(head) else None
    classes = [str(c) for c in (fit.classes or [])]
    provenance = {"source": "probe", "site": act, "probe_site": site, "task": fit.task, "classes": classes,
                  "class_index": k, "points_to": (classes[1] if len(classes) == 2 else classes[k] if classes else
                                                  "an increasing target"),
                  "test_score": {c: float(row[c]) for c in table.columns
                                 if c.startswith("test_") and c.count("_") == 1}}
    return Direction(act, dirs[k].detach().float().cpu(), head, provenance)


def from_feature(dictionary: Any, feature: int, model: Any = None) -> Direction:
    """Row `feature` of a dictionary's decoder, at the site the dictionary writes; with `model`, the dictionary is
    checked against it (layer, width, activation space)."""
    from ..models.dictionaries.catalog import get_dictionary
    from ..models.names import parse_name

    d = get_dictionary(dictionary)
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < d.d_sae:
        raise DataError(f"feature {feature!r} is not in dictionary {d.name or dictionary!r} (0..{d.d_sae - 1})",
                        code="direction_feature", remedy=f"give a feature index in 0..{d.d_sae - 1}")
    site = parse_name(d.hook_out)
    if model is not None and isinstance(dictionary, str):
        adapt(model).resolve(f"features.{site.layer}@{dictionary}")  # refuses a dictionary of another model or space
    provenance = {"source": "feature", "dictionary": d.name or str(dictionary), "feature": int(feature),
                  "writes": d.hook_out, "decoder_row_norm": float(d.W_dec[feature].double().norm())}
    return Direction(str(site), d.W_dec[feature].detach().float().cpu(), None, provenance)


def from_file(path: Any, site: str, *, key: str | None = None, row: int | None = None,
              head: int | None = None) -> Direction:
    """A vector read from .npy / .safetensors (checked: vectorfile.py), at `site`."""
    vector = read_vector(path, key=key, row=row)
    provenance = {"source": "file", "path": str(path), "key": key, "row": row}
    return Direction(site, torch.from_numpy(vector), head, provenance)
