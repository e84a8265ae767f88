"""The three edits a run makes at a site, and at which positions.

With v the direction (or v / |v| with normalize), v^ = v / |v|, c the coefficient, m = 1 at a steered
position and 0 elsewhere (x is the activation at each position):

    add           x <- x + c m v                           activation addition (Turner et al. 2023; CAA,
                                                           Panickssery et al. 2023): c = 1 adds v once
    set           x <- x + m (c |v| - x.v^) v^             the component along v^ clamped to c |v| (c = 1:
                                                           the direction's own length; c = 0: removed)
    project_out   x <- x - c m (x.v^) v^                   directional ablation (Arditi et al. 2024) at c = 1;
                                                           c is the share of the component removed

So c = 0 leaves the activation unchanged under add and project_out (those conditions are the unsteered
run itself and are not run again), and where m = 0 every edit leaves x bit for bit as it was.

Positions (`positions` in the config):
    all              every position (during generation, the new tokens' too)
    last, last:K     the prompt's last token / last K tokens
    generated        only the tokens generated after the prompt (continuations; the next-token metrics
                     read at the prompt are the unsteered ones)
    [3, -2, S2, END+1]   token indices (negative: from each prompt's end) and roles (data/roles.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, SiteError
from ..sites import resolve_positions, role_ref



@dataclass
class PositionRule:
    kind: str  # all | generated | last | codes
    last: int = 1  # last:K
    given: list[int | str] = field(default_factory=list)  # what the config lists (kind "codes")
    codes: dict[str, list[int]] = field(default_factory=dict)  # per row set: position codes (roles resolved)

    @classmethod
    def parse(cls, positions: str | list[int | str]) -> PositionRule:
        if isinstance(positions, list):
            if not positions:
                raise ConfigError("positions is an empty list: nothing would be steered", code="steering_positions",
                                  remedy="give positions (all, last, last:K, generated, or a list of indices "
                                  "and roles)")
            return cls("codes", given=list(positions))
        text = positions.strip()
        if text in ("all", "generated", "last"):
            return cls(text)
        if text.startswith("last:") and text[5:].isdigit() and int(text[5:]) >= 1:
            return cls("last", last=int(text[5:]))
        raise ConfigError(f"positions {positions!r} is not a position rule", code="steering_positions",
                          remedy="use all, last, last:K (K >= 1), generated, or a list such as [-1, S2, END]")

    @property
    def steers_prompt(self) -> bool:
        return self.kind != "generated"

    @property
    def steers_generated(self) -> bool:
        return self.kind in ("all", "generated")

    def resolve(self, set_name: str, roles: Any, lengths: list[int]) -> None:
        """Turn the listed positions into codes for one row set, refusing one some prompt lacks."""
        if self.kind != "codes":
            return
        codes = []
        for p in self.given:
            codes.append(int(p) if isinstance(p, int) else role_ref(str(p), roles, "positions"))
        L = torch.tensor(lengths)
        role_rows = None if roles is None else roles.positions
        for code, given in zip(codes, self.given):
            at = resolve_positions(torch.full_like(L, code), L, role_rows)
            bad = ((at < 0) | (at >= L)).nonzero().flatten()
            if len(bad):
                e = int(bad[0])
                raise SiteError(f"position {given!r} is not a token of prompt {e} of the {set_name} rows "
                                f"({lengths[e]} tokens)", code="steering_positions",
                                remedy="use positions every prompt has (negative indices count from each end), "
                                "a role every prompt marks, or positions: all / last")
        self.codes[set_name] = codes

    def mask(self, set_name: str, lengths: Tensor, roles: Tensor | None, width: int,
             prompt_lengths: Tensor | None = None) -> Tensor:
        """[B, width] 1.0 where a row is steered. `prompt_lengths` (generation): positions from there on are the
        generated tokens; `lengths` are then the current lengths."""
        B = len(lengths)
        t = torch.arange(width)[None, :]
        plen = lengths if prompt_lengths is None else prompt_lengths
        prompt = t < plen[:, None]
        if self.kind == "all":
            m = torch.ones(B, width, dtype=torch.bool)
        elif self.kind == "generated":
            m = ~prompt
        elif self.kind == "last":
            m = prompt & (t >= (plen - self.last).clamp(min=0)[:, None])
        else:
            m = torch.zeros(B, width, dtype=torch.bool)
            for code in self.codes[set_name]:
                at = resolve_positions(torch.full_like(plen, code), plen, roles)
                m[torch.arange(B), at] = True
        if prompt_lengths is not None and self.kind in ("last", "codes"):
            m &= prompt
        return m.float()


def make_edit(mode: str, coef: Tensor, vectors: Tensor, mask: Tensor, head: int | None) -> Callable[[Tensor], Tensor]:
    """The intervention function of one batched run: row r gets coefficient coef[r], vector vectors[r] ([R, width])
    at the positions of mask[r] ([R, T]). See the module docstring for the three modes."""
    norms = vectors.double().norm(dim=-1)
    units = (vectors.double() / norms[:, None]).to(vectors.dtype)

    def fn(x: Tensor) -> Tensor:
        target = x[:, :, head] if head is not None else x
        m = mask.to(x.device, x.dtype)[:, : target.shape[1], None]
        c = coef.to(x.device, x.dtype)[:, None, None]
        if mode == "add":
            new = target + (c * m) * vectors.to(x.device, x.dtype)[:, None, :]
        else:
            u = units.to(x.device, x.dtype)[:, None, :]
            proj = (target * u).sum(-1, keepdim=True)
            if mode == "set":
                new = target + m * (c * norms.to(x.device, x.dtype)[:, None, None] - proj) * u
            else:
                new = target - (c * m) * proj * u
        if head is None:
            return new
        x = x.clone()
        x[:, :, head] = new
        return x
    return fn


def is_identity(mode: str, coefficient: float) -> bool:
    """Whether the edit changes nothing at any position (then the condition is the unsteered run)."""
    return mode in ("add", "project_out") and coefficient == 0.0
