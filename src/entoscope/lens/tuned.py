"""The tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the
Tuned Lens"): one affine translator per layer, identity plus a zero-initialised correction,
h -> h + A_l h + b_l, trained to minimise KL(final output || lens output) on text.

Translator l reads the residual stream entering layer l (resid_pre.l, HuggingFace's
hidden_states[l]); resid_post.l is resid_pre.(l+1), and the last resid_post needs no translator
(it is the model's own output). This is the tuned-lens package's indexing, so its saved
translators (a folder with config.json and params.pt) load here; ours are saved as
config.json + translators.safetensors (nothing executable is ever unpickled: params.pt is read
with torch.load(weights_only=True)).

Translators learn the coordinates of the model they were trained on: a lens trained on a plain
bridge (HuggingFace weights) does not fit a compatibility-mode bridge, whose residual stream is
centred. The config records the model mode; applying it to another mode is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ..data.examples import Dataset
from ..data.tokenized import Batch, make_batches, pad_id, tokenize_data
from ..errors import ConfigError, ModelLoadError
from ..executors.contract import Sharded
from ..executors.shards import PerPrompt
from ..files import read_tensors
from ..models.adapter import ModelAdapter, adapt
from ..models.names import ActName
from ..operation import Operation, Plan, Prepared, progress
from ..results.result import Result
from .project import decode_states


class TunedLens(nn.Module):
    """Per-layer translators for a model with `n_layers` layers and width `d_model`."""

    def __init__(self, n_layers: int, d_model: int, *, mode: str = "plain", bias: bool = True) -> None:
        super().__init__()
        self.n_layers, self.d_model, self.mode = n_layers, d_model, mode
        self.translators = nn.ModuleList(nn.Linear(d_model, d_model, bias=bias) for _ in range(n_layers))
        for t in self.translators:
            nn.init.zeros_(t.weight)
            if t.bias is not None:
                nn.init.zeros_(t.bias)

    @classmethod
    def for_model(cls, model: Any) -> TunedLens:
        s = adapt(model).structure
        return cls(s.n_layers, s.d_model, mode=s.mode)

    def index_of(self, act: ActName) -> int | None:
        """Translator index for a residual state; None means identity (the final residual)."""
        if act.kind == "resid_pre":
            return act.layer
        if act.kind == "resid_post":
            nxt = (act.layer or 0) + 1
            return None if nxt >= self.n_layers else nxt
        raise ConfigError(f"the tuned lens translates resid_pre and resid_post, not {act.kind}",
                          code="tuned_lens_site", remedy="use resid_pre or resid_post sites, or method='logit'")

    def transform(self, h: Tensor, index: int | None) -> Tensor:
        if index is None:
            return h
        t = self.translators[index]  # on the model's device; a layer placed elsewhere (device_map) is moved to it
        return h + t(h.to(t.weight.device, t.weight.dtype)).to(h.device, h.dtype)

    def check_model(self, model: ModelAdapter) -> None:
        s = model.structure
        if (s.n_layers, s.d_model) != (self.n_layers, self.d_model):
            raise ConfigError(f"these translators are for {self.n_layers} layers x d_model {self.d_model}, the model "
                              f"has {s.n_layers} x {s.d_model}", code="tuned_lens_mismatch",
                              remedy="train a tuned lens for this model (entoscope train-lens)")
        if self.mode != "unknown" and self.mode != s.mode:
            raise ConfigError(f"these translators were trained on a {self.mode} model; this one is {s.mode}",
                              code="tuned_lens_mismatch",
                              remedy="load the model the same way it was when the lens was trained, or retrain")

    # ------------------------------------------------------------------ save / load
    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        state = {f"{i}.{k}": v.detach().contiguous().cpu() for i, t in enumerate(self.translators)
                 for k, v in t.state_dict().items()}
        save_file(state, str(out / "translators.safetensors"))
        cfg = {"format": "entoscope-tuned-lens", "num_hidden_layers": self.n_layers, "d_model": self.d_model,
               "bias": self.translators[0].bias is not None, "mode": self.mode}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out

    @classmethod
    def load(cls, folder: str | Path) -> TunedLens:
        """Load ours (translators.safetensors) or the tuned-lens package's (params.pt) from a folder."""
        p = Path(folder).expanduser()
        cfg_path = p / "config.json"
        if not cfg_path.exists():
            raise ModelLoadError(f"no tuned lens at {p} (config.json missing)", code="tuned_lens_missing",
                                 remedy="give the folder written by TunedLens.save or by the tuned-lens package")
        corrupt = dict(code="tuned_lens_corrupt", remedy="train the lens again (entoscope train-lens) or copy the "
                       "folder again: its files are damaged or from another program")
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            n_layers, d_model = cfg["num_hidden_layers"], cfg["d_model"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{cfg_path} is not a tuned-lens config ({type(err).__name__}: {err})",
                                 **corrupt) from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (n_layers, d_model)):
            raise ModelLoadError(f"{cfg_path}: num_hidden_layers and d_model must be whole numbers >= 1, got "
                                 f"{n_layers!r} and {d_model!r}", **corrupt)
        if (p / "translators.safetensors").exists():
            state, _ = read_tensors(p / "translators.safetensors", refuse=lambda m: ModelLoadError(m, **corrupt))
        elif (p / "params.pt").exists():  # the tuned-lens package: layer_translators.state_dict()
            try:
                state = torch.load(p / "params.pt", map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - a damaged or foreign pickle: these files cannot be used
                raise ModelLoadError(f"the translators in {p} cannot be read ({type(err).__name__}: "
                                     f"{str(err).splitlines()[0][:200] if str(err) else ''})", **corrupt) from None
        else:
            raise ModelLoadError(f"{p} has neither translators.safetensors nor params.pt", code="tuned_lens_missing",
                                 remedy="give a folder written by TunedLens.save or by the tuned-lens package")
        bias = bool(cfg.get("bias", True))
        expect = {f"{i}.{k}": shape for i in range(n_layers)
                  for k, shape in (("weight", (d_model, d_model)), ("bias", (d_model,)))[: 2 if bias else 1]}
        have = {k: tuple(v.shape) for k, v in state.items()} if isinstance(state, dict) and all(
            torch.is_tensor(v) for v in state.values()) else None
        if have != expect:  # checked before any translator is built: a hand-edited d_model allocates nothing
            wrong = "not a mapping of tensors" if have is None else "; ".join(
                [f"{k} {have.get(k)} (expected {v})" for k, v in expect.items() if have.get(k) != v][:3] +
                [f"unexpected {k}" for k in have if k not in expect][:2])
            raise ModelLoadError(f"the translators in {p} do not fit its config ({n_layers} layers x d_model "
                                 f"{d_model}): {wrong}", **corrupt)
        if not all(v.is_floating_point() and bool(torch.isfinite(v).all()) for v in state.values()):
            raise ModelLoadError(f"the translators in {p} hold NaN, inf or non-float values", **corrupt)
        lens = cls(n_layers, d_model, mode=cfg.get("mode", "plain"), bias=bias)
        lens.translators.load_state_dict(state)
        return lens

    # ------------------------------------------------------------------ training
    def fit(self, model: Any, data: Dataset, *, steps: int = 300, lr: float = 1e-3, batch_size: int = 16,
            weight_decay: float = 0.0, seed: int = 0, prepend_bos: bool = True, quiet: bool = False,
            executor: Any = None) -> list[float]:
        """Train every translator at once to minimise the mean over layers and (non-pad) positions of
        KL(final output || lens output). Adam; the model's weights are not touched. Returns the losses.

        executor: where the training data (every batch's residual states and logits) is collected:
        in-process (default) or es.Ray(...) (docs/scale.md); the training itself runs here."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"steps must be a whole number >= 1, got {steps!r}", code="bad_steps",
                              remedy="train for at least one step, e.g. --steps 300")
        if not lr > 0 or lr != lr or lr == float("inf"):
            raise ConfigError(f"lr must be a finite number > 0, got {lr!r}", code="bad_lr", remedy="e.g. --lr 1e-3")
        adapter = adapt(model)
        self.check_model(adapter)
        collection = LensTrainingData(batch_size=batch_size, prepend_bos=prepend_bos)
        # the model is frozen: each batch is read once (in eval mode: no dropout), here or on Ray workers
        cached = collection.run(model, data, executor=executor, quiet=True).extra["batches"]
        self.to(next(adapter.module.parameters()).device)
        opt = torch.optim.Adam(self.parameters(), lr=lr, weight_decay=weight_decay)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        frozen = [(p, p.requires_grad) for p in adapter.module.parameters()]
        for p, _ in frozen:  # gradients flow to the translators only
            p.requires_grad_(False)
        try:
            for _ in progress(range(steps), total=steps, desc="tuned lens", quiet=quiet):
                states, target = cached[int(torch.randint(len(cached), (1,), generator=gen))]
                loss = self.kl_per_layer(adapter, states, target).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        finally:
            for p, flag in frozen:
                p.requires_grad_(flag)
        return losses

    def kl_per_layer(self, adapter: ModelAdapter, states: Tensor, target_logp: Tensor) -> Tensor:
        """KL(final || lens) per layer, averaged over rows: states [L, N, d], target [N, V] -> [L]."""
        out = []
        for i in range(self.n_layers):
            logp = decode_states(adapter, self.transform(states[i], i)).log_softmax(-1)
            out.append((target_logp.exp() * (target_logp - logp)).sum(-1).mean())
        return torch.stack(out)


@dataclass(frozen=True)
class LensTrainingState:
    """What the training data's prepare resolved: the batches and the dataset's longest prompt (tokens)."""

    batches: list[Batch]
    longest: int


class LensTrainingData(Sharded, Operation):
    """The tuned lens's training data: every batch's residual states (resid_pre of each layer) and the
    model's logits at its real positions. Sharded (docs/scale.md): a shard returns its prompts' states and
    logits padded to the dataset's longest prompt; `summarise` cuts each batch back to its own length, so
    the batches equal an in-process collection's."""

    name = "tuned_lens_data"

    def prepare(self, model: ModelAdapter, data: Dataset | None) -> Prepared[LensTrainingState]:
        assert data is not None
        td = tokenize_data(model, data, prepend_bos=self.prepend_bos)
        batches = make_batches(td, self.batch_size or 16, pad_id(model))
        s = model.structure
        T = max(td.lengths)
        per_example = 4 * T * (s.n_layers * s.d_model + s.d_vocab) * 2
        plan = Plan(self.name, rows=len(td), forward_passes=len(td), backward_passes=0,
                    batch_sizes=[len(b) for b in batches], examples=len(td),
                    peak_memory_bytes=len(td) * per_example, files=[])
        return Prepared(model, data, plan, LensTrainingState(batches, T))

    def execute_shard(self, prepared: Prepared[LensTrainingState], phase: str, batches: list[int], *,
                      quiet: bool = False) -> PerPrompt:
        model, st = prepared.model, prepared.state
        reads = [ActName("resid_pre", L) for L in range(model.structure.n_layers)]
        mine = [st.batches[i] for i in batches]
        states, logits = [], []
        for b in mine:
            with torch.no_grad():
                out = model.run(b.tokens, reads)
            pad = st.longest - b.tokens.shape[1]
            states.append(_storable(nn.functional.pad(torch.stack([out[a] for a in reads], 1), (0, 0, 0, pad))))
            logits.append(_storable(nn.functional.pad(out.logits, (0, 0, 0, pad))))  # [B, T, V]
        return PerPrompt([i for b in mine for i in b.index], {"states": torch.cat(states).numpy(),  # [n, L, T, d]
                                                             "logits": torch.cat(logits).numpy()})

    def summarise(self, prepared: Prepared[LensTrainingState], merged: dict[str, Any], *,
                  quiet: bool = False) -> Result:
        m = merged["main"]
        all_states, all_logits = m["states"], m["logits"]  # the training data, read once (a global step)
        out = []
        for b in prepared.state.batches:
            T = b.tokens.shape[1]
            mask = torch.arange(T)[None, :] < b.lengths[:, None]
            states = torch.from_numpy(all_states[b.index][:, :, :T]).transpose(0, 1)  # [n_layers, B, T, d_model]
            logits = torch.from_numpy(all_logits[b.index][:, :T])
            dev, dtype = prepared.model.device, next(prepared.model.module.parameters()).dtype
            out.append((states[:, mask].to(dev, dtype), logits[mask].to(dev, dtype).log_softmax(-1)))  # [L, N, d], [N, V]
        return Result(self.name, pd.DataFrame(), extra={"batches": out})


def _storable(x: Tensor) -> Tensor:
    """On the CPU, in a dtype numpy has (bfloat16 is widened to float32, exactly)."""
    return (x.float() if x.dtype == torch.bfloat16 else x).detach().cpu()
