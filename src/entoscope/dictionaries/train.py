"""Training small dictionaries on a model's activations: SAEs (top-k or ReLU + L1) and transcoders.

    d, report = train_dictionary(model, data, site="resid_post.1")                  # an SAE
    d, report = train_dictionary(model, data, site="mlp_in.1", target="mlp_out.1")  # a transcoder

Activations are collected at every real token of every prompt (and counterfactual) except position 0:
the BOS position's residual is an outlier of large norm that no sparse code needs to spend features on
(it is still encoded at run time; the error term carries what the dictionary misses there).

Transcoders are trained as standard (ReLU + L1): SAELens's format has no top-k transcoder.
Top-k (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"): the k largest pre-activations
survive; loss = ||x_out - x_hat||^2 + aux_coef * AuxK, where AuxK reconstructs the residual error from
the k_aux largest pre-activations of features dead for `dead_after` training tokens. ReLU ("standard",
Bricken et al. 2023): loss = ||x_out - x_hat||^2 + l1 * sum_i f_i ||W_dec,i||. Both: Adam, b_dec
initialised at the mean target, decoder rows kept at unit norm after every step (top-k) or folded into
the encoder at the end (ReLU), seeded (torch.Generator) so a run repeats exactly on one thread.

The training report's quality numbers come from evaluate.py, on held-out prompts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from ..data.examples import Dataset
from ..data.tokenized import pad, pad_id
from ..errors import ConfigError, DictionaryError
from ..models.adapter import adapt
from ..models.names import ActName, parse_name
from ..models.features import space_of
from ..models.dictionaries.dictionary import Dictionary
from .evaluate import loss_recovered, quality


@dataclass
class TrainConfig:
    """Hyper-parameters of `train_dictionary` (the training report stores them)."""

    architecture: Literal["topk", "standard"] = "topk"
    d_sae: int = 512
    k: int = 16
    l1: float = 3.0  # gives the demo's transcoders an L0 near 13; scale it with ||x_out||^2 / ||f||_1
    steps: int = 2000
    batch_tokens: int = 1024
    lr: float = 1e-3
    aux_coef: float = 1 / 32
    dead_after: int = 50_000  # tokens without firing before a feature counts as dead in training
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot train (or would train something else than asked) before any work."""
        if self.architecture not in ("topk", "standard"):
            raise ConfigError(f"architecture {self.architecture!r} cannot be trained here",
                              code="train_architecture_unsupported", remedy="train topk or standard (ReLU + L1)")
        whole = {"d_sae": self.d_sae, "k": self.k, "steps": self.steps, "batch_tokens": self.batch_tokens,
                 "dead_after": self.dead_after}
        for name, v in whole.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}", code="train_config_invalid",
                                  remedy=f"e.g. --{name.replace('_', '-')} {getattr(TrainConfig, name)}")
        if self.architecture == "topk" and not self.k <= self.d_sae:
            raise ConfigError(f"k={self.k} must be in 1..d_sae={self.d_sae}", code="train_config_invalid",
                              remedy="choose k <= d_sae")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a whole number >= 0, got {self.seed!r}", code="train_config_invalid",
                              remedy="e.g. --seed 0")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a finite number > 0, got {self.lr!r}", code="train_config_invalid",
                              remedy="e.g. --lr 1e-3")
        for name in ("l1", "aux_coef"):  # a negative L1 coefficient rewards activity: no sparse code
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r} (a negative penalty rewards "
                                  "dense activity)", code="train_config_invalid",
                                  remedy=f"e.g. --{name.replace('_', '-')} {getattr(TrainConfig, name):g}")


# a dictionary reads or writes one vector per token of a layer; in forward order within the layer
TRAINABLE = ("resid_pre", "attn_in", "attn_out", "resid_mid", "mlp_in", "mlp_pre", "mlp_post", "mlp_out", "resid_post")


def check_sites(site: str, target: str | None) -> tuple[ActName, ActName]:
    """The site (and a transcoder's target) as activation names, refused before any work where no
    dictionary can be trained: not one vector per token of a layer (pattern.1, logits, embed), or a
    target the forward reaches before the site (a transcoder predicts a later activation)."""
    names = []
    for role, name in (("--site", site), ("--target", target or site)):
        act = parse_name(str(name))
        if act.kind not in TRAINABLE or act.layer is None:
            raise DictionaryError(f"{role} {name}: a dictionary reads and writes one vector per token of a layer, "
                                  f"and {act} is not one", code="dictionary_site_unsupported",
                                  remedy=f"train on one of {', '.join(k + '.L' for k in TRAINABLE)}")
        names.append(act)
    read, written = names
    order = {k: i for i, k in enumerate(TRAINABLE)}
    if (written.layer, order[written.kind]) < (read.layer, order[read.kind]):
        raise ConfigError(f"--target {written} comes before --site {read} in the forward pass: a transcoder "
                          "predicts a later activation from an earlier one", code="train_config_invalid",
                          remedy="swap them, or choose a target at or after the site (e.g. mlp_in.1 -> mlp_out.1)")
    return read, written


def collect(model: Any, prompts: list[list[int]], names: list[ActName], batch: int = 64,
            skip_first: bool = True) -> dict[ActName, Tensor]:
    """Activations [n_tokens, width] at every real token (position 0 skipped) of `prompts`, per name."""
    m = adapt(model)
    out: dict[ActName, list[Tensor]] = {n: [] for n in names}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch):
        tokens, lengths = pad([prompts[i] for i in order[start:start + batch]], pad_id(m))
        real = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
        if skip_first:
            real[:, 0] = False
        with torch.no_grad():
            acts = m.run(tokens, names, logits=False).acts
        for n in names:
            out[n].append(acts[n][real.to(acts[n].device)].float().cpu())
    return {n: torch.cat(v) for n, v in out.items()}


def _encode_train(arch: str, pre: Tensor, k: int) -> Tensor:
    if arch == "standard":
        return torch.relu(pre)
    top = torch.topk(pre, k=k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))


def fit(x_in: Tensor, x_out: Tensor, cfg: TrainConfig, *, sae: bool) -> tuple[dict[str, Tensor], list[float]]:
    """The weights of a dictionary trained on rows x_in -> x_out ([N, d_in], [N, d_out]), and the loss curve."""
    cfg.check()
    gen = torch.Generator().manual_seed(cfg.seed)
    n, d_in = x_in.shape
    d_out = x_out.shape[1]
    W_dec = torch.randn(cfg.d_sae, d_out, generator=gen)
    W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
    W_enc = W_dec.T.clone() if sae else torch.randn(d_in, cfg.d_sae, generator=gen) / math.sqrt(d_in)
    params = {"W_enc": W_enc, "b_enc": torch.zeros(cfg.d_sae), "W_dec": W_dec, "b_dec": x_out.mean(0)}
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.Adam(params.values(), lr=cfg.lr)
    last_fired = torch.zeros(cfg.d_sae, dtype=torch.long)
    seen = 0
    losses = []
    for step in range(cfg.steps):
        idx = torch.randint(0, n, (cfg.batch_tokens,), generator=gen)
        xi, xo = x_in[idx], x_out[idx]
        centred = xi - params["b_dec"] if sae else xi
        pre = centred @ params["W_enc"] + params["b_enc"]
        f = _encode_train(cfg.architecture, pre, cfg.k)
        recon = f @ params["W_dec"] + params["b_dec"]
        mse = (recon - xo).pow(2).sum(-1).mean()
        loss = mse
        if cfg.architecture == "standard":
            loss = loss + cfg.l1 * (f * params["W_dec"].norm(dim=1)).sum(-1).mean()
        seen += cfg.batch_tokens
        last_fired[(f > 0).any(0)] = seen
        dead = (seen - last_fired) > cfg.dead_after
        if cfg.architecture == "topk" and dead.any():
            k_aux = min(int(dead.sum()), d_out // 2)
            aux_pre = pre.masked_fill(~dead, -math.inf)
            top = torch.topk(aux_pre, k=k_aux, dim=-1)
            aux_f = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
            residual = (xo - recon).detach()
            loss = loss + cfg.aux_coef * (aux_f @ params["W_dec"] - residual).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if cfg.architecture == "topk":
            with torch.no_grad():
                params["W_dec"] /= params["W_dec"].norm(dim=1, keepdim=True)
        losses.append(float(mse.detach()))
    out = {k: v.detach().clone() for k, v in params.items()}
    if cfg.architecture == "standard":  # unit decoder rows, the scale moved into the encoder
        norms = out["W_dec"].norm(dim=1).clamp(min=1e-12)
        out["W_dec"] /= norms[:, None]
        out["W_enc"] *= norms[None, :]
        out["b_enc"] *= norms
    return out, losses


def train_dictionary(model: Any, prompts: list[list[int]], site: str, target: str | None = None,
                     config: TrainConfig | None = None, heldout: list[Dataset] | None = None,
                     name: str = "") -> tuple[Dictionary, dict[str, Any]]:
    """Train an SAE on `site` (or a transcoder from `site` to `target`) on token-id prompts.

    Returns the dictionary and its training report (config, quality on the `heldout` datasets' prompts
    and counterfactuals or, without them, on the training tokens, the loss curve's start and end, seconds)."""
    cfg = config or TrainConfig()
    cfg.check()
    check_sites(site, target)
    m = adapt(model)
    hook_in = m.resolve(site)
    hook_out = m.resolve(target) if target else hook_in
    if hook_in != hook_out and cfg.architecture == "topk":
        raise ConfigError("SAELens's format has no top-k transcoder, so one trained here could not be saved",
                          code="train_architecture_unsupported", remedy="train the transcoder as standard (ReLU + L1)")
    names = sorted({hook_in, hook_out})
    start = time.perf_counter()
    acts = collect(m, prompts, names)
    weights, losses = fit(acts[hook_in], acts[hook_out], cfg, sae=hook_in == hook_out)
    arch = "topk" if cfg.architecture == "topk" else "standard"
    d = Dictionary(arch, weights["W_enc"], weights["W_dec"], weights["b_dec"], str(hook_in), str(hook_out),
                   b_enc=weights["b_enc"], k=cfg.k if arch == "topk" else None,
                   apply_b_dec_to_input=hook_in == hook_out, space=space_of(m), name=name)
    seconds = time.perf_counter() - start
    test = collect(m, prompts_of(m, heldout), names) if heldout else acts
    q = quality(d, test[hook_in], test[hook_out])
    if heldout:
        q.update(loss_recovered(m, d, prompts_of(m, heldout), heldout))
    report = {"site": str(hook_in), "target": str(hook_out), "config": asdict(cfg),
              "train_tokens": int(len(acts[hook_in])), "quality": q,
              "quality_on": "held-out prompts" if heldout else "training tokens",
              "mse_first_steps": float(sum(losses[:20]) / max(1, len(losses[:20]))),
              "mse_last_steps": float(sum(losses[-20:]) / max(1, len(losses[-20:]))), "seconds": round(seconds, 1)}
    return d, report


def task_data(model: Any, tasks: list[str], n: int, seed: int) -> list[Dataset]:
    """Built-in tasks' datasets, n examples each, seeds seed, seed + 1, ..."""
    from ..data import tasks as builtins

    return [builtins.get(task, n=n, seed=seed + i, tokenizer=adapt(model).tokenizer) for i, task in enumerate(tasks)]


def prompts_of(model: Any, datasets: list[Dataset], counterfactuals: bool = True) -> list[list[int]]:
    """Token ids of every prompt (and counterfactual) of the datasets."""
    m = adapt(model)
    return [m.tokenize(t, prepend_bos=isinstance(t, str)) for data in datasets for e in data
            for t in (e.prompt, e.counterfactual if counterfactuals else None) if t is not None]


def task_prompts(model: Any, tasks: list[str], n: int, seed: int, counterfactuals: bool = True) -> list[list[int]]:
    """Token ids of the prompts (and counterfactuals) of built-in tasks, n examples each, seeded."""
    return prompts_of(model, task_data(model, tasks, n, seed), counterfactuals)
