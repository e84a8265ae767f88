"""The memory budget: what a run may take above the loaded model, and the batch sizes that keep it there.

`memory` (every operation's field, `--memory`, `memory:` in YAML) is a size or "auto":

- a size: a number of bytes (`12000000000`) or a number with a unit: B, KB/MB/GB/TB (powers of 1000),
  KiB/MiB/GiB/TiB (powers of 1024), and K/M/G/T (powers of 1024, as `free -g` and docker read them);
  "12GB", "512MiB", "1.5G";
- "auto": AUTO_SHARE of what the model's device has free when the run is prepared: on the CPU Linux's
  MemAvailable (lowered to the room left under the process's cgroup limit, where it has one), on a CUDA
  device `torch.cuda.mem_get_info`. A report (or any caller) can set the budget of every operation whose
  memory is "auto" for a stretch of code with `budget_scope`.

The budget bounds the run's own memory: its peak above the loaded model (weights and libraries are there
before it starts), the quantity `Plan.peak_memory_bytes` estimates. An operation states its estimate as a
function of its batch size (`peak_of(rows)`), and `fit_rows` picks the largest batch whose estimate stays within
the budget, or refuses the run before any forward (`MemoryBudgetError`, code `memory_budget`) naming the
smallest budget that would do: the estimate at one row (and the smallest chunks).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from .errors import ConfigError

AUTO = "auto"
AUTO_SHARE = 0.9  # of the free memory: room for what the estimate does not see (the allocator's slack)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SCOPE: ContextVar[int | None] = ContextVar("entoscope_memory_scope", default=None)


class MemoryBudgetError(ConfigError):
    """A run whose smallest batch would not fit its memory budget; `smallest` is the budget (bytes) that would do."""

    code = "memory_budget"

    def __init__(self, message: str, *, smallest: int, budget: int, remedy: str = "") -> None:
        self.smallest, self.budget = int(smallest), int(budget)
        super().__init__(message, remedy=remedy)


def parse_size(value: Any, where: str = "memory") -> int | None:
    """Bytes of a size ("12GB", "512MiB", 2**30, "1.5G"), None for "auto"; anything else refused (config_invalid)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _SIZE.match(str(value))
        number, unit = (float(m.group(1)), m.group(2).lower()) if m else (math.nan, "?")
    if unit not in _UNITS or not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where}: {value!r} is not a size", code="config_invalid",
                          remedy=f"write {where} as a size such as 12GB, 512MiB or a number of bytes, or auto (the "
                          "free memory of the model's device)")
    size = int(number * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"{where}: {value!r} is less than one byte", code="config_invalid",
                          remedy="give a size such as 512MiB")
    return size


def size_text(n: float) -> str:
    """A size as a person reads it and `parse_size` reads back: "512MiB", "1.25GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{math.ceil(n / scale * 100) / 100:g}{unit}"
    return f"{int(n)}B"


def free_bytes(device: Any = "cpu") -> int | None:
    """Bytes free now on `device`: torch.cuda.mem_get_info on a CUDA device; on the CPU (and elsewhere) Linux's
    MemAvailable, lowered to the room under this process's cgroup memory limit where there is one. None where
    it cannot be read."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    available = _meminfo("MemAvailable")
    room = _cgroup_room()
    if available is None:
        return room
    return available if room is None else min(available, room)


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """The cgroup v2 limit less the cgroup's usage (None: no limit, or no cgroup v2)."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def resolve(value: Any, device: Any = "cpu") -> int:
    """The budget in bytes: the size given, else the scope's (`budget_scope`), else AUTO_SHARE of the device's
    free memory (a generous 2 GiB where it cannot be read)."""
    size = parse_size(value)
    if size is not None:
        return size
    scoped = _SCOPE.get()
    if scoped is not None:
        return scoped
    free = free_bytes(device)
    return int(AUTO_SHARE * free) if free is not None else 2 * 2**30


@contextmanager
def budget_scope(value: Any, device: Any = "cpu") -> Iterator[int | None]:
    """Inside the block, an operation whose memory is "auto" takes this budget (a size; None or "auto": no change).
    The report sets its --memory this way for every section's runs."""
    size = None if value is None else parse_size(value)
    token = _SCOPE.set(size if size is not None else _SCOPE.get())
    try:
        yield size
    finally:
        _SCOPE.reset(token)


def fit_rows(peak_of: Callable[[int], int], budget: int, most: int, *, what: str, unit: str = "prompt",
             fewer: str = "fewer or shorter prompts") -> int:
    """The largest r in 1..most with peak_of(r) <= budget (peak_of growing with r), or a MemoryBudgetError naming
    peak_of(1), the smallest budget that runs it, when even one row does not fit."""
    if peak_of(1) > budget:
        refuse(what, peak_of(1), budget, f"one {unit} per batch", fewer)
    return largest(peak_of, budget, most)


def largest(peak_of: Callable[[int], int], budget: int, most: int) -> int:
    """The largest r in 1..most with peak_of(r) <= budget (peak_of growing with r); 1 when none fits (the caller
    refuses the plan's peak then)."""
    most = max(1, int(most))
    if peak_of(most) <= budget:
        return most
    lo, hi = 1, most  # peak_of(lo) fits (or lo is 1), peak_of(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_of(mid) <= budget else (lo, mid)
    return lo


def refuse(what: str, need: int, budget: int, smallest_run: str = "its smallest batch",
           fewer: str = "fewer or shorter prompts") -> None:
    """Raise the refusal of a run that needs `need` bytes above the loaded model with `budget` given."""
    raise MemoryBudgetError(
        f"{what} needs about {size_text(need)} above the loaded model even with {smallest_run}, and its memory "
        f"budget is {size_text(budget)}", smallest=need, budget=budget,
        remedy=f"give memory: {size_text(need)} or more (the smallest budget that runs it), or {fewer}")


def check_within(what: str, need: int, budget: int, given: str = "the batch size given") -> None:
    """Refuse a run whose chosen sizes (a batch_size the user gave) need more than the budget."""
    if need > budget:
        raise MemoryBudgetError(
            f"{what} with {given} needs about {size_text(need)} above the loaded model, and its memory budget is "
            f"{size_text(budget)}", smallest=need, budget=budget,
            remedy=f"leave batch_size out (it is then chosen to fit), or give memory: {size_text(need)} or more")
