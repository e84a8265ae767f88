"""The component graph seen from the model: what each sender writes and what each receiver reads.

Senders write into the residual stream: `input` (everything that enters block 0: token embedding,
plus the learned positional embedding where there is one; read at resid_pre.0), each attention
head (its result z_h @ W_O[h]; the attention bias b_O is NOT a sender) and each MLP (mlp_out, which
includes its output bias: the bias is constant across runs, so it cancels in every difference).
Under a family's post-norms (Gemma 2/3) a head's output is its result carried through the post-attention
norm with that norm's scale frozen at the run it comes from (post_norms.py: the heads of a layer then sum
to attn_out, the post-normed output added to the residual); mlp_out is already post-normed. A corrupt
sender's output uses the corrupt run's scale, a clean one the clean run's, so delta_s is the change in
what s adds to the residual stream, and the senders still add up to the final residual (`check_split`).
Receivers read the residual stream through a norm: each query head's q, each key/value head's k and
v, each MLP's input, and the logits (the final residual, before the final norm).

A receiver's input is the PRE-NORM residual it reads (the sum of the outputs of the senders upstream
of it, plus the biases). In a normal forward pass all receivers of a block read one shared residual;
here each one gets its own copy:
- gradients: d metric / d input(r) is the vector-Jacobian product of the receiver's norm at the
  shared residual x, applied to (d metric / d q_h) W_Q[h]^T (likewise k, v; the MLP through its
  normalised input). Done in closed form for all receivers at once (`EdgeGradients`).
- patching: q_h (k_j, v_j, the MLP input, the final residual) is recomputed from x + offset_r with
  the model's own norm and weights (`PatchedRun`), so each receiver reads its own modified residual
  while the residual stream itself is left alone.

Grouped-query attention: one k and one v receiver per KEY/VALUE head j (the k/v that query heads
j*g .. j*g+g-1 share, g = n_heads / n_kv_heads), because that is what the model computes once;
with g = 1 they are the per-head receivers of MIB/EAP.

Layout (the order of the dense [n_senders, n_receivers] tensors, MIB's forward/backward order):
  senders:   input, then per layer L: a{L}.h0 .. a{L}.h{H-1}, m{L}
  receivers: per layer L: q of heads 0..H-1, k of kv heads 0..K-1, v of kv heads 0..K-1, m{L};
             last: logits
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import CheckFailedError, SiteError
from .adapter import Intervention, ModelAdapter, RunOutput
from .names import ActName
from .post_norms import head_outputs, post_scale_reads
from .structure import Structure
from .weights import Norm

RESULT_COLUMNS = 128  # receivers whose linear terms EdgeGradients.result multiplies by the senders in one product


@dataclass(frozen=True)
class Layout:
    """Indices of senders and receivers in the dense graph tensors."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool

    @classmethod
    def of(cls, s: Structure) -> Layout:
        return cls(s.n_layers, s.n_heads, s.n_kv_heads, s.parallel)

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def per_layer_receivers(self) -> int:
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def n_receivers(self) -> int:
        return self.n_layers * self.per_layer_receivers + 1

    # senders
    def head_senders(self, layer: int) -> slice:
        start = 1 + layer * (self.n_heads + 1)
        return slice(start, start + self.n_heads)

    def mlp_sender(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def senders_before_attn(self, layer: int) -> int:
        """How many senders (a prefix of the order) attention of `layer` reads."""
        return 1 + layer * (self.n_heads + 1)

    def senders_before_mlp(self, layer: int) -> int:
        return self.senders_before_attn(layer) + (0 if self.parallel else self.n_heads)

    # receivers
    def attn_receivers(self, layer: int) -> slice:
        """q (H), k (K), v (K) of `layer`, contiguous."""
        start = layer * self.per_layer_receivers
        return slice(start, start + self.n_heads + 2 * self.n_kv_heads)

    def q_receivers(self, layer: int) -> slice:
        start = layer * self.per_layer_receivers
        return slice(start, start + self.n_heads)

    def k_receivers(self, layer: int) -> slice:
        start = layer * self.per_layer_receivers + self.n_heads
        return slice(start, start + self.n_kv_heads)

    def v_receivers(self, layer: int) -> slice:
        start = layer * self.per_layer_receivers + self.n_heads + self.n_kv_heads
        return slice(start, start + self.n_kv_heads)

    def mlp_receiver(self, layer: int) -> int:
        return (layer + 1) * self.per_layer_receivers - 1

    @property
    def logits_receiver(self) -> int:
        return self.n_receivers - 1

    def receiver_reads(self) -> list[int]:
        """For each receiver, how many senders (a prefix of the sender order) it reads."""
        out = []
        for L in range(self.n_layers):
            out += [self.senders_before_attn(L)] * (self.n_heads + 2 * self.n_kv_heads)
            out.append(self.senders_before_mlp(L))
        out.append(self.n_senders)
        return out

    def edge_mask(self) -> Tensor:
        """[n_senders, n_receivers] bool: True where sender s is upstream of receiver r."""
        reads = torch.tensor(self.receiver_reads())
        return torch.arange(self.n_senders)[:, None] < reads[None, :]


# ---------------------------------------------------------------------- which activations
def mlp_input_site(s: Structure, layer: int) -> ActName:
    """The pre-norm residual the MLP of `layer` reads (resid_mid; resid_pre for parallel blocks)."""
    return ActName("resid_pre" if s.parallel else "resid_mid", layer)


def final_residual(s: Structure) -> ActName:
    return ActName("resid_post", s.n_layers - 1)


def sender_reads(s: Structure) -> list[ActName]:
    """What a run must read to give every sender's output."""
    reads = [ActName("resid_pre", 0)]
    for L in range(s.n_layers):
        reads += [ActName("z", L), *post_scale_reads(s, L, "attn"), ActName("mlp_out", L)]
    return reads


def gradient_reads(s: Structure) -> list[ActName]:
    """What a run with grad=True must read for `EdgeGradients`."""
    reads: set[ActName] = set()
    for L in range(s.n_layers):
        reads |= {ActName("resid_pre", L), mlp_input_site(s, L), ActName("q", L), ActName("k", L),
                  ActName("v", L), ActName("mlp_in", L)}
    reads.add(final_residual(s))
    return sorted(reads)


def refuse_unsplittable(model: ModelAdapter) -> None:
    """Refuse, before any work, a model whose receivers cannot be split (its norm outputs have no hook)."""
    try:
        model.hook_name(ActName("mlp_in", 0))
    except SiteError as err:
        raise SiteError(f"circuit discovery needs each MLP's normalised input as a hook: {err.message}",
                        code="receivers_unsplittable", remedy=err.remedy) from None


@torch.no_grad()
def sender_outputs(model: ModelAdapter, acts: dict[ActName, Tensor]) -> Tensor:
    """[B, T, n_senders, d_model]: input, then per layer each head's result and the MLP output."""
    s = model.structure
    parts = [acts[ActName("resid_pre", 0)][:, :, None]]
    for L in range(s.n_layers):
        z = acts[ActName("z", L)]
        parts.append(head_outputs(model, L, z, acts.get(ActName("ln1_post_scale", L))))
        parts.append(acts[ActName("mlp_out", L)][:, :, None])
    return torch.cat(parts, dim=2)


# ---------------------------------------------------------------------- gradients
class EdgeGradients:
    """For every prompt b of the batch: sum over runs k of w_k * sum over positions of
    delta_s . d metric / d input(r) |_k, for every sender s and receiver r, from the gradients at q, k,
    v, mlp_in and the final residual (per prompt, so that statistics can resample prompts).

    delta [B, T, n_senders, d] is fixed (the senders' corrupt - clean outputs, padding zeroed).
    A receiver reads y = norm(x), then its own projection (q_h = y W_Q[h] + b_Q[h], ...). With
    x_hat = centre(x) / sigma, sigma = sqrt(mean(centre(x)^2) + eps), the vector-Jacobian product
    of the norm for a cotangent g_y is

        d x = (u - x_hat (u . x_hat) / d) / sigma,    u = centre_LN(g_y * weight)

    (centred for LayerNorm only). For head h, g_y = g_h W[h]^T (g_h = d metric / d q_h), so
    u = g_h M_h with M_h = centre_LN(W[h]^T * weight), folded once per layer. Then

        delta_s . d x = (delta_s . g_h M_h) / sigma - (delta_s . x_hat) (g_h . M_h x_hat) / (d sigma)

    The first term is linear in g_h / sigma, so it is summed over runs in head space (d_head numbers
    per position) and contracted with delta once at the end; the second needs per run only
    delta . x_hat (per sender) and g_h . M_h x_hat (per head), where M_h x_hat = q_h - (b_norm W[h] +
    b_Q[h]) is the run's own q (k, v; for the MLP: its normalised input minus the norm's bias). No
    per-receiver copy of the residual stream is ever made.
    """

    def __init__(self, model: ModelAdapter, delta: Tensor) -> None:
        self.model = model
        self.s = model.structure
        self.layout = Layout.of(self.s)
        self.delta = delta.float()
        self._folded: dict[tuple[int, str], Tensor] = {}
        self._linear: dict[tuple[int, str], Tensor] = {}  # sum_k w_k g / sigma, per layer and kind
        self.scores = torch.zeros(delta.shape[0], self.layout.n_senders, self.layout.n_receivers, device=delta.device)

    def _fold(self, layer: int, which: str) -> Tensor:
        """M [n, d_head, d_model] (q, k, v) or [1, d_model, d_model] (mlp)."""
        key = (layer, which)
        if key not in self._folded:
            w = self.model.weights
            with torch.no_grad():
                if which == "mlp":
                    norm = w.norm(layer, "ln2")
                    M = torch.eye(self.s.d_model, device=self.delta.device)[None]
                else:
                    norm = w.norm(layer, "ln1")
                    W = {"q": w.W_Q, "k": w.W_K_kv, "v": w.W_V_kv}[which](layer)
                    M = W.detach().float().transpose(1, 2)
                if norm.weight is not None:
                    M = M * norm.weight.detach().float()
                if norm.kind == "layernorm":
                    M = M - M.mean(-1, keepdim=True)
            self._folded[key] = M.contiguous()
        return self._folded[key]

    def _constant(self, layer: int, which: str) -> Tensor:
        """What q/k/v (or the MLP's normalised input) is when x_hat = 0: b_norm W + b, [n, d_head]."""
        key = (layer, "const_" + which)
        if key not in self._folded:
            w = self.model.weights
            with torch.no_grad():
                norm = w.norm(layer, "ln2" if which == "mlp" else "ln1")
                bias = norm.bias.detach().float() if norm.bias is not None else \
                    torch.zeros(self.s.d_model, device=self.delta.device)
                if which == "mlp":
                    const = bias[None]
                else:
                    W = {"q": w.W_Q, "k": w.W_K_kv, "v": w.W_V_kv}[which](layer).detach().float()
                    b = w.b_Q(layer) if which == "q" else _kv_bias(self.model, which, layer)
                    const = torch.einsum("d,nde->ne", bias, W) + b.detach().float()
            self._folded[key] = const
        return self._folded[key]

    def _normalised(self, layer: int, which: str, x: Tensor) -> tuple[Tensor, Tensor]:
        norm = self.model.weights.norm(layer, which)
        xc = norm.center(x.float())
        sigma = (xc.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # [B, T, 1]
        return xc / sigma, sigma

    def _receivers(self, layer: int) -> list[tuple[str, Any]]:
        lay = self.layout
        return [("q", lay.q_receivers(layer)), ("k", lay.k_receivers(layer)), ("v", lay.v_receivers(layer)),
                ("mlp", slice(lay.mlp_receiver(layer), lay.mlp_receiver(layer) + 1))]

    @torch.no_grad()
    def add(self, acts: dict[ActName, Tensor], grads: dict[ActName, Tensor], weight: float = 1.0) -> None:
        """Add the gradients of one pass (acts: its q, k, v, mlp_in and pre-norm inputs) times `weight`.

        The pass may hold k runs stacked along the batch ([k * B, ...], run-major: rows j*B .. j*B+B-1
        are run j), each with its weight already in the gradient."""
        s, d = self.s, self.s.d_model
        B = self.delta.shape[0]

        def runs(t: Tensor) -> Tensor:  # [k * B, ...] -> [k, B, ...]
            return t.float().reshape(-1, B, *t.shape[1:])

        for L in range(s.n_layers):
            for which, cols in self._receivers(L):
                if which in ("q", "mlp"):  # q, k, v share the attention norm's input
                    site = ActName("resid_pre", L) if which == "q" else mlp_input_site(s, L)
                    x_hat, sigma = self._normalised(L, "ln1" if which == "q" else "ln2", runs(acts[site]))
                    e = torch.einsum("btsd,kbtd->kbts", self.delta, x_hat)  # delta_s . x_hat
                site = ActName("mlp_in" if which == "mlp" else which, L)
                g, y = runs(grads[site]), runs(acts[site])
                if which == "mlp":
                    g, y = g[..., None, :], y[..., None, :]
                g = g / sigma[..., None]  # [k, B, T, n, e]
                key = (L, which)
                self._linear[key] = self._linear.get(key, 0) + weight * g.sum(0)
                c = ((y - self._constant(L, which)) * g).sum(-1) / d  # (g_h . M_h x_hat) / (d sigma)
                self.scores[:, :, cols] -= weight * torch.einsum("kbts,kbth->bsh", e, c)
        final = runs(grads[final_residual(s)]).sum(0)
        self._linear[(-1, "logits")] = self._linear.get((-1, "logits"), 0) + weight * final

    @torch.no_grad()
    def result(self) -> Tensor:
        """[B, n_senders, n_receivers]: the sums per prompt (dense; entries that are not edges are meaningless)."""
        out = self.scores.clone()
        B, T, S, d = self.delta.shape
        lhs = self.delta.permute(0, 2, 1, 3).reshape(B, S, T * d)  # [B, S, T*d], once
        group: list[tuple[Any, Tensor]] = []  # (receiver columns, [B, T*d, n]): one product reads lhs once
        for i, ((L, which), g) in enumerate(self._linear.items()):  # for many receivers, not per q, k, v, MLP
            if which == "logits":
                cols, u = slice(self.layout.logits_receiver, self.layout.logits_receiver + 1), g.reshape(B, T * d, 1)
            else:
                cols = dict(self._receivers(L))[which]
                u = torch.einsum("bthe,hed->btdh", g, self._fold(L, which)).reshape(B, T * d, -1)  # w g M / sigma
            group.append((cols, u))
            if sum(x.shape[2] for _, x in group) >= RESULT_COLUMNS or i == len(self._linear) - 1:
                prod, at = torch.bmm(lhs, torch.cat([x for _, x in group], 2)), 0
                for c, x in group:
                    out[:, :, c] += prod[:, :, at:at + x.shape[2]]
                    at += x.shape[2]
                group.clear()
        return out


# ---------------------------------------------------------------------- recomputing receivers
def _kv_bias(model: ModelAdapter, which: str, layer: int) -> Tensor:
    full = model.weights.b_K(layer) if which == "k" else model.weights.b_V(layer)
    return full[:: model.structure.group_size]  # expanded per query head: one per key/value head


def apply_norm(norm: Norm, x: Tensor) -> Tensor:
    """`norm(x)` with torch's fused kernels (the same numbers as Norm.__call__, faster on big x)."""
    d = x.shape[-1]
    if norm.kind == "layernorm":
        return F.layer_norm(x, (d,), norm.weight, norm.bias, norm.eps)
    y = F.rms_norm(x, (d,), None, norm.eps)
    return y * norm.weight if norm.weight is not None else y


def recompute_qkv(model: ModelAdapter, layer: int, which: str, x: Tensor, heads: Tensor | None = None) -> Tensor:
    """q/k/v of `layer` from per-receiver residuals x [B, T, n, d]: one per head (query heads for q,
    key/value heads for k and v), or one per head listed in `heads`."""
    w = model.weights
    h = apply_norm(w.norm(layer, "ln1"), x)
    if which == "q":
        W, b = w.W_Q(layer), w.b_Q(layer)
    else:
        W = w.W_K_kv(layer) if which == "k" else w.W_V_kv(layer)
        b = _kv_bias(model, which, layer)
    if heads is not None:
        W, b = W[heads], b[heads]
    return torch.einsum("bpnd,nde->bpne", h, W.to(h.dtype)) + b.to(h.dtype)


@torch.no_grad()
def check_split_once(model: ModelAdapter, tokens: Tensor) -> None:
    """`check_split` once per model and weights (a later change to a parameter checks again): circuit
    operations call it while preparing, so the plan refuses an unsplittable model and a run repeats nothing."""
    stamp = tuple((id(p), p._version) for p in model.module.parameters())
    if model.module.__dict__.get("_entoscope_split_checked") == stamp:
        return
    check_split(model, tokens)
    model.module.__dict__["_entoscope_split_checked"] = stamp


# The split check's relative tolerance by the model's dtype: a recomputation in float16 / bfloat16 (8 to 11
# bits of mantissa: steps of 0.1% to 0.4%) differs from the model's own value by a few steps of the scale.
SPLIT_RTOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
SPLIT_RTOL_FULL = 1e-3


def check_split(model: ModelAdapter, tokens: Tensor, rtol: float | None = None) -> None:
    """Refuse (CheckFailedError) when recomputing q, k, v and the MLP input from the residual stream
    with the adapter's norms and weights does not give the model's own values, or when the senders'
    outputs do not add up to the final residual (up to a constant: the biases). rtol: relative to each
    value's scale; by default 1e-3, 2e-2 for a float16 / bfloat16 model (SPLIT_RTOL)."""
    if rtol is None:
        rtol = SPLIT_RTOL.get(next(model.module.parameters()).dtype, SPLIT_RTOL_FULL)
    s = model.structure
    reads = sorted(set(gradient_reads(s)) | set(sender_reads(s)))
    out = model.run(tokens[:2], reads)
    acts = out.acts
    for L in range(s.n_layers):
        x = acts[ActName("resid_pre", L)]
        for which, n in (("q", s.n_heads), ("k", s.n_kv_heads), ("v", s.n_kv_heads)):
            mine = recompute_qkv(model, L, which, x[:, :, None].expand(-1, -1, n, -1))
            _close(mine, acts[ActName(which, L)], f"{which}.{L}", rtol)
        mine = model.weights.norm(L, "ln2")(acts[mlp_input_site(s, L)])
        _close(mine, acts[ActName("mlp_in", L)], f"mlp_in.{L}", rtol)
    rest = acts[final_residual(s)] - sender_outputs(model, acts).sum(2)  # [B, T, d]: the biases
    spread = (rest - rest[:1, :1]).abs().max()
    scale = acts[final_residual(s)].abs().max().clamp(min=1e-6)
    if not spread <= rtol * scale:  # NaN fails too
        raise CheckFailedError(
            f"the senders (input, heads, MLPs) do not add up to the final residual stream: what is left "
            f"varies by {float(spread):.3g} (scale {float(scale):.3g})", code="senders_incomplete",
            remedy="this architecture writes to the residual stream through something entoscope's graph "
            "does not model; circuit discovery supports GPT-2, NeoX, Llama-like models")


def _close(mine: Tensor, theirs: Tensor, what: str, rtol: float) -> None:
    err = (mine.float() - theirs.float()).abs().max()
    scale = theirs.float().abs().max().clamp(min=1e-6)
    if not err <= rtol * scale:  # NaN fails too
        raise CheckFailedError(
            f"recomputing {what} from the residual stream with this model's norm and weights gives "
            f"{float(err):.3g} away from the model's own value (scale {float(scale):.3g})",
            code="receiver_split_mismatch",
            remedy="this architecture computes its attention inputs differently (q/k norms, shifted norm "
            "weights, ...); circuit discovery supports GPT-2, NeoX, Llama-like models")


# ---------------------------------------------------------------------- patched runs
class PatchedRun:
    """Interventions that make every receiver read its own residual: x + offset_r, with

        offset_r = sum over senders s of patched[s, r] * (corrupt_s - actual_s)

    where actual_s is sender s's output IN THIS RUN (it may itself have changed) and corrupt_s its
    output on the corrupt prompt. patched = 0 everywhere gives the clean run; patched = 1 on every
    edge gives the corrupt run. Only receivers with at least one patched edge are recomputed.

    corrupt: [B, T, n_senders, d_model]; patched: [n_senders, n_receivers] (0/1, or fractions).
    """

    def __init__(self, model: ModelAdapter, corrupt: Tensor, patched: Tensor) -> None:
        self.model = model
        self.s = model.structure
        self.layout = Layout.of(self.s)
        self.corrupt = corrupt
        self.patched = patched.to(corrupt.device, corrupt.dtype)
        self.touched = patched.ne(0).any(0).cpu()  # [n_receivers]
        # corrupt_s - actual_s, kept as each sender's output in this run is seen (actual starts at 0): the
        # offsets read it without forming the difference (a [B, T, n_senders, d] copy) at every receiver
        self.delta = corrupt.clone()
        self.x: dict[str, Tensor] = {}
        self._attn_offsets: dict[int, Tensor] = {}
        self._summed: tuple[int, Tensor | None] = (0, None)  # _total's running sum

    def interventions(self) -> list[Intervention]:
        s, lay = self.s, self.layout
        ivs = [Intervention(ActName("resid_pre", 0), self._keep_input)]
        for L in range(s.n_layers):
            ivs.append(Intervention(ActName("resid_pre", L), self._stash(f"pre{L}")))
            if not s.parallel:
                ivs.append(Intervention(ActName("resid_mid", L), self._stash(f"mid{L}")))
            for which, rec in (("q", lay.q_receivers(L)), ("k", lay.k_receivers(L)), ("v", lay.v_receivers(L))):
                if self.touched[rec].any():
                    ivs.append(Intervention(ActName(which, L), self._qkv(L, which, rec)))
            ivs.append(Intervention(ActName("z", L), self._keep_heads(L)))
            ivs += [Intervention(scale, self._keep_heads(L, scaled=True)) for scale in post_scale_reads(s, L, "attn")]
            if self.touched[lay.mlp_receiver(L)]:
                ivs.append(Intervention(ActName("mlp_in", L), self._mlp_in(L)))
            ivs.append(Intervention(ActName("mlp_out", L), self._keep_mlp(L)))
        if self.touched[lay.logits_receiver]:
            ivs.append(Intervention(final_residual(s), self._final))
        return ivs

    def run(self, tokens: Tensor) -> RunOutput:
        return self.model.run(tokens, interventions=self.interventions())

    @property
    def first_layer(self) -> int:
        """The first block with a receiver that reads a patched edge (n_layers when only the logits do)."""
        touched = self.touched.nonzero()[:, 0]
        if not len(touched):
            return self.s.n_layers
        return min(int(touched[0]) // self.layout.per_layer_receivers, self.s.n_layers)

    def logits_at(self, positions: Tensor, tokens: Tensor, clean: CleanRun | None = None) -> Tensor:
        """Logits [B, d_vocab] at `positions` of this patched run. Every receiver below `first_layer`
        reads only kept edges, so up to there the run IS the clean one: given `clean` (and a model that
        can start at a layer), the run starts at that block from the clean residual, with the senders
        below it at their clean outputs; otherwise it is a full forward."""
        from .partial import Start, logits_at, prefix_support

        if clean is None or prefix_support(self.model) == "none":
            return logits_at(self.model, positions, tokens=tokens, interventions=self.interventions())
        layer = min(self.first_layer, self.s.n_layers - 1)
        below = self.layout.senders_before_attn(layer)
        self._set_actual(slice(0, below), clean.senders[:, :, :below])
        start = Start(layer, 0, clean.resid[layer])
        return logits_at(self.model, positions, start=start, interventions=self.interventions())


    # --- the pieces
    def _offsets(self, n_read: int, receivers: Tensor) -> Tensor:
        """[B, T, len(receivers), d]: sum_s patched[s, r] (corrupt_s - actual_s) over the first n_read
        senders. When most edges are patched (a small circuit), it is computed as the sum over all
        senders minus the kept ones' share, so the work scales with the smaller of the two sets."""
        weights = self.patched[:n_read, receivers]  # [n_read, R]
        complement = 1 - weights
        n_patched, n_kept = int(weights.ne(0).sum()), int(complement.ne(0).sum())
        by_kept = n_kept < n_patched
        use = complement if by_kept else weights
        senders = use.ne(0).any(1).nonzero()[:, 0]
        if len(senders) and int(senders[-1]) - int(senders[0]) + 1 == len(senders):  # a run: a view, no copy
            first = int(senders[0])
            diff, use = self.delta[:, :, first:first + len(senders)], use[first:first + len(senders)]
        elif 4 * len(senders) < n_read:  # a few scattered senders: gathering them is cheaper than reading all
            diff, use = self.delta[:, :, senders], use[senders]
        else:  # gathering a quarter or more of [B, T, n_read, d] costs more than multiplying its zero rows
            diff = self.delta[:, :, :n_read]
        part = torch.matmul(use.T, diff)  # [R, S] @ [B, T, S, d]: batched, no permuted copy of diff
        return self._total(n_read) - part if by_kept else part

    def _total(self, n_read: int) -> Tensor:
        """sum over the first n_read senders of (corrupt_s - actual_s), [B, T, 1, d]. A receiver reads senders
        that are final in this run (the forward sets them in order), so the sum is carried on from the last
        receiver's instead of summed again."""
        done, total = self._summed
        if total is None or n_read < done:
            done, total = 0, torch.zeros_like(self.delta[:, :, :1])
        if n_read > done:
            total = total + self.delta[:, :, done:n_read].sum(2, keepdim=True)
        self._summed = (n_read, total)
        return total

    def _set_actual(self, senders: Any, value: Tensor) -> None:
        """Sender(s) `senders` output `value` in this run: their corrupt - actual."""
        self.delta[:, :, senders] = self.corrupt[:, :, senders] - value.to(self.delta.dtype)

    def _keep_input(self, x: Tensor) -> Tensor:
        self._set_actual(0, x)
        return x

    def _stash(self, key: str) -> Any:
        def fn(x: Tensor) -> Tensor:
            self.x[key] = x
            return x
        return fn

    def _keep_heads(self, layer: int, scaled: bool = False) -> Any:
        """The heads' outputs of this run, from z (under post-norms: kept until this run's post-attention
        scale is seen, `scaled`, and carried through the norm with it)."""
        post = self.s.post_norms

        def fn(x: Tensor) -> Tensor:
            if post and not scaled:
                self.x[f"z{layer}"] = x
                return x
            z, scale = (self.x.pop(f"z{layer}"), x) if post else (x, None)
            self._set_actual(self.layout.head_senders(layer), head_outputs(self.model, layer, z, scale))
            return None if scaled else x  # a scale read returns nothing: the bridge's norm keeps its own path
        return fn

    def _keep_mlp(self, layer: int) -> Any:
        def fn(out: Tensor) -> Tensor:
            self._set_actual(self.layout.mlp_sender(layer), out)
            return out
        return fn

    def _layer_offsets(self, layer: int) -> tuple[Tensor, Tensor]:
        """(offsets [B, T, n, d], their receiver indices) of the touched attention receivers of `layer`,
        computed once for its q, k and v hooks (no sender changes between them)."""
        rec = self.layout.attn_receivers(layer)
        columns = self.touched[rec].nonzero()[:, 0] + rec.start
        if layer not in self._attn_offsets:
            self._attn_offsets[layer] = self._offsets(self.layout.senders_before_attn(layer), columns)
        return self._attn_offsets[layer], columns

    def _qkv(self, layer: int, which: str, receivers: slice) -> Any:
        heads = self.touched[receivers].nonzero()[:, 0]  # only these heads read a patched edge
        wanted = heads + receivers.start

        def fn(original: Tensor) -> Tensor:
            offsets, columns = self._layer_offsets(layer)
            pick = torch.searchsorted(columns, wanted)
            x = self.x[f"pre{layer}"]
            new = recompute_qkv(self.model, layer, which, x[:, :, None] + offsets[:, :, pick.to(offsets.device)], heads)
            out = original.clone()
            out[:, :, heads.to(original.device)] = new.to(original.dtype)  # the others keep the model's value
            return out
        return fn

    def _mlp_in(self, layer: int) -> Any:
        def fn(original: Tensor) -> Tensor:
            n_read = self.layout.senders_before_mlp(layer)
            x = self.x[f"pre{layer}" if self.s.parallel else f"mid{layer}"]
            offset = self._offsets(n_read, torch.tensor([self.layout.mlp_receiver(layer)]))[:, :, 0]
            return apply_norm(self.model.weights.norm(layer, "ln2"), x + offset).to(original.dtype)
        return fn

    def _final(self, x: Tensor) -> Tensor:
        offset = self._offsets(self.layout.n_senders, torch.tensor([self.layout.logits_receiver]))[:, :, 0]
        return x + offset


@dataclass
class CleanRun:
    """What patched runs starting part-way take from the clean run: the residual entering each block
    (resid[L]: [B, T, d_model]) and every sender's output ([B, T, n_senders, d_model])."""

    resid: list[Tensor]
    senders: Tensor

    @staticmethod
    def reads(s: Structure) -> list[ActName]:
        return sorted(set(sender_reads(s)) | {ActName("resid_pre", L) for L in range(s.n_layers)})

    @staticmethod
    def of(model: ModelAdapter, acts: dict[ActName, Tensor]) -> CleanRun:
        resid = [acts[ActName("resid_pre", L)] for L in range(model.structure.n_layers)]
        return CleanRun(resid, sender_outputs(model, acts))
