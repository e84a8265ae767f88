"""CachedModel: the disk cache of run_with_cache.

Every test compares what the cache returns with an independent fresh computation (the unwrapped
model's own run_with_cache), or inspects the files on disk; none trusts the cache's own counters
alone. Speed is measured by benchmarks/bench_cache.py, not here.
"""

from __future__ import annotations

import copy
import json
import logging
import multiprocessing as mp
import os
import random
import struct
import threading
from pathlib import Path

import pytest
import torch

from entoscope.errors import ConfigError, UnsupportedModelError
from entoscope.models import cache_entry, cache_result
from entoscope.models.cached import CachedModel, read_entry, write_entry
from entoscope.models.fingerprint import forget, model_fingerprint

from conftest import has_hooked_transformer, needs_hooked

# One intra-op thread: results are then bit-reproducible between the calls a test compares, and
# the 2-core CI machine is not oversubscribed by the worker processes.
torch.set_num_threads(1)

HAS_HOOKED = has_hooked_transformer()
# The quick default model: a HookedTransformer where there is one, else a compat bridge.
DEFAULT = ("gpt2", "hooked", False) if HAS_HOOKED else ("gpt2", "bridge", True)
VARIANTS = [("gpt2", "bridge", False), ("gpt2", "bridge", True),
            pytest.param("gpt2", "hooked", False, marks=needs_hooked), ("llama", "bridge", False),
            pytest.param("llama", "hooked", False, marks=needs_hooked), ("neox", "bridge", True)]
NAMES = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_pattern", "blocks.0.hook_mlp_out",
         "blocks.1.hook_resid_post"]
TOKENS = torch.tensor([[0, 5, 6, 7, 8, 9], [0, 5, 6, 7, 8, 11], [0, 12, 13, 14, 15, 16]])


def _model(family: str = "gpt2", backend: str | None = None, compat: bool | None = None, seed: int = 0):
    """A tiny model; without a backend, the quick default (DEFAULT)."""
    from entoscope.models.tiny import tiny_model

    if backend is None:
        backend, compat = DEFAULT[1], DEFAULT[2] if compat is None else compat
    return tiny_model(family, backend, bool(compat), seed=seed)


@pytest.fixture(scope="module")
def quick():
    """The quick default model (see DEFAULT), shared by the tests that leave it as they found it."""
    return _model()


def _fresh(model, tokens=TOKENS, **kw):
    with torch.no_grad():
        return model.run_with_cache(tokens, **kw)


def _cached(cm, tokens=TOKENS, **kw):
    with torch.no_grad():
        return cm.run_with_cache(tokens, **kw)


def _bits_equal(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
        return False
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def _same(a, b) -> None:
    """Bit-for-bit equality of two (output, cache) results: same keys in the same order, same bytes."""
    (out_a, cache_a), (out_b, cache_b) = a, b
    assert type(cache_a) is type(cache_b)
    assert list(cache_a.keys()) == list(cache_b.keys())
    for k in cache_b.keys():
        assert _bits_equal(cache_a[k], cache_b[k]), k
    assert _bits_equal(out_a, out_b)


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.safetensors") if not p.name.startswith("."))


def _no_recompute(monkeypatch, model) -> None:
    """From here on the wrapped model cannot compute: whatever comes back was read from disk."""
    def boom(*a, **k):
        raise AssertionError("recomputed instead of read from the cache")
    monkeypatch.setattr(model, "run_with_cache", boom)


# ------------------------------------------------------------------------------------- read back
@pytest.mark.parametrize("family,backend,compat", VARIANTS)
def test_entry_reads_back_bit_for_bit(tmp_path, monkeypatch, family, backend, compat):
    model = _model(family, backend, compat)
    cm = CachedModel(model, tmp_path)
    fresh = _fresh(model, names_filter=NAMES)
    first = _cached(cm, names_filter=NAMES)
    _same(first, fresh)
    [entry] = _entries(tmp_path)
    _no_recompute(monkeypatch, model)
    _same(_cached(cm, names_filter=NAMES), fresh)
    # The file is plain safetensors: a stranger reads the same bytes (an alias group is stored once).
    from safetensors import safe_open

    meta, tensors, _ = read_entry(entry, entry.name[: -len(".safetensors")])
    with safe_open(str(entry), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
        assert json.loads(f.metadata()["entoscope"])["format"] == cache_entry.FORMAT_VERSION
    assert len(stored) == len({tid for _, tid in meta["keys"]}) + 1  # + the logits
    for key, tid in meta["keys"]:
        assert torch.equal(stored[tid], fresh[1][key].contiguous())
    assert cm.cache_stats()["hits"] == 1 and cm.cache_stats()["misses"] == 1


def test_name_order_and_repeats_do_not_matter(tmp_path, quick, monkeypatch):
    cm = CachedModel(quick, tmp_path)
    fresh = _fresh(quick, names_filter=NAMES)
    _cached(cm, names_filter=NAMES)
    _no_recompute(monkeypatch, quick)
    _same(_cached(cm, names_filter=list(reversed(NAMES)) + NAMES[:1]), fresh)
    _same(_cached(cm, names_filter=sorted(NAMES)), fresh)
    assert len(_entries(tmp_path)) == 1


def test_every_argument_that_changes_the_result_is_keyed(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    calls = [dict(names_filter=NAMES), dict(names_filter=NAMES, stop_at_layer=1),
             dict(names_filter=NAMES, return_type="loss"), dict(names_filter=NAMES, pos_slice=-1)]
    for kw in calls:
        _same(_cached(cm, **kw), _fresh(quick, **kw))
    _same(_cached(cm, TOKENS[:2], names_filter=NAMES), _fresh(quick, TOKENS[:2], names_filter=NAMES))
    assert len(_entries(tmp_path)) == len(calls) + 1
    for kw in calls:  # all hits now, each still equal to a fresh run
        _same(_cached(cm, **kw), _fresh(quick, **kw))
    assert len(_entries(tmp_path)) == len(calls) + 1 and cm.cache_stats()["hits"] == len(calls)


def test_return_cache_object_false_and_device(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    _cached(cm, names_filter=NAMES)
    out, cache = _cached(cm, names_filter=NAMES, return_cache_object=False, device="cpu")
    ref_out, ref_cache = _fresh(quick, names_filter=NAMES, return_cache_object=False, device="cpu")
    assert type(cache) is dict and list(cache) == list(ref_cache)
    assert torch.equal(out, ref_out) and all(torch.equal(cache[k], ref_cache[k]) for k in ref_cache)
    assert cm.cache_stats()["hits"] == 1


def test_string_input_is_keyed_on_its_tokens(tmp_path, monkeypatch):
    model = _model("gpt2", "bridge")
    cm = CachedModel(model, tmp_path)
    text = "When Mary and John went to the store"
    for kw in (dict(), dict(prepend_bos=False)):
        _same(_cached(cm, text, names_filter=NAMES, **kw), _fresh(model, text, names_filter=NAMES, **kw))
    assert len(_entries(tmp_path)) == 2
    fresh = _fresh(model, text, names_filter=NAMES, prepend_bos=False)
    _no_recompute(monkeypatch, model)
    _same(_cached(cm, text, names_filter=NAMES, prepend_bos=False), fresh)


def test_callable_filter_is_keyed_on_what_it_selects(tmp_path, monkeypatch):
    model = _model("gpt2", "bridge")
    cm = CachedModel(model, tmp_path)
    fresh = _fresh(model, names_filter=lambda n: n.endswith("hook_resid_pre"))
    _same(_cached(cm, names_filter=lambda n: n.endswith("hook_resid_pre")), fresh)
    _no_recompute(monkeypatch, model)
    _same(_cached(cm, names_filter=lambda n: "hook_resid_pre" in n), fresh)  # another lambda, same names


def test_everything_when_names_filter_is_none(tmp_path, monkeypatch):
    model = _model("gpt2", "bridge", True)
    cm = CachedModel(model, tmp_path)
    fresh = _fresh(model)
    _same(_cached(cm), fresh)
    [entry] = _entries(tmp_path)
    meta, tensors, _ = read_entry(entry, entry.name[:-12])
    assert len(tensors) < len(fresh[1].keys())  # aliases of one tensor are stored once
    _no_recompute(monkeypatch, model)
    got = _cached(cm)
    _same(got, fresh)
    # aliases still share their tensor, as in a fresh run
    assert got[1]["blocks.0.hook_in"].data_ptr() == got[1]["blocks.0.hook_resid_pre"].data_ptr()


# ------------------------------------------------------------------------------------- subsets
@pytest.mark.parametrize("family,backend,compat", [("gpt2", "bridge", False), ("gpt2", "bridge", True),
                                                   pytest.param("llama", "hooked", False, marks=needs_hooked)])
def test_subset_is_served_from_a_larger_entry(tmp_path, monkeypatch, family, backend, compat):
    model = _model(family, backend, compat)
    cm = CachedModel(model, tmp_path)
    _cached(cm)  # everything
    names = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern",
             "blocks.1.attn.hook_z", "blocks.0.hook_mlp_out", "blocks.1.hook_attn_out", "blocks.0.attn.hook_q",
             "blocks.1.attn.hook_k", "hook_embed", "blocks.1.mlp.hook_post"]
    rng = random.Random(0)
    wanted = [rng.sample(names, k) for k in (1, 1, 2, 3, 5)] + [names]
    fresh = [_fresh(model, names_filter=w) for w in wanted]
    _no_recompute(monkeypatch, model)
    for w, ref in zip(wanted, fresh):
        _same(_cached(cm, names_filter=w), ref)
    assert cm.cache_stats()["subset_hits"] == len(wanted)
    assert len(_entries(tmp_path)) == 1


@pytest.mark.filterwarnings("ignore:run_with_cache. skipped")  # the real calls on gated-off names
@pytest.mark.parametrize("first", ["everything", "every name"])
def test_subset_keys_match_a_real_call_for_every_hook_name(tmp_path, first):
    """The names a subset answer carries are exactly those a real call returns, for each hook name."""
    model = _model("gpt2", "bridge", True)
    cm = CachedModel(model, tmp_path)
    _cached(cm, names_filter=None if first == "everything" else list(model.hook_dict))
    for name in model.hook_dict:
        _same(_cached(cm, names_filter=[name]), _fresh(model, names_filter=[name]))
    assert cm.cache_stats()["subset_hits"] >= 80  # all but gated-off and never-firing names


# ------------------------------------------------------------------------------------- fingerprint
def _one_entry_per_state(cm, model, mutate) -> None:
    """A change after wrapping: new fingerprint, new entry, and the new model's exact values."""
    full = cm.verify == "full"
    before_fp = model_fingerprint(model, full=full)
    before = _cached(cm, names_filter=NAMES)
    n_before = len(_entries(cm.cache_dir))
    mutate()
    after_fp = model_fingerprint(model, full=full)
    fresh = _fresh(model, names_filter=NAMES)
    got = _cached(cm, names_filter=NAMES)
    assert after_fp != before_fp
    assert len(_entries(cm.cache_dir)) == n_before + 1
    _same(got, fresh)
    assert not torch.equal(got[0], before[0]) or got[0].dtype != before[0].dtype


def test_one_weight_deep_inside_a_matrix(tmp_path):
    model = _model("gpt2", "bridge")
    cm = CachedModel(model, tmp_path)
    w = model.original_model.transformer.h[1].mlp.c_fc.weight  # [64, 256]

    def edit():
        with torch.no_grad():
            w[40, 200] += 1.0  # far past the first 64 values
    _one_entry_per_state(cm, model, edit)


def test_edits_through_data_are_seen_in_full_verify_mode(tmp_path):
    model = _model("gpt2", "bridge")
    cm = CachedModel(model, tmp_path, verify="full")
    w = model.original_model.transformer.h[1].mlp.c_fc.weight

    def edit():
        w.data[40, 200] += 1.0  # invisible to PyTorch's version counter
    _one_entry_per_state(cm, model, edit)


def test_replaced_tensor_and_training_step(tmp_path):
    model = _model("llama", "bridge")
    cm = CachedModel(model, tmp_path)
    p = model.original_model.model.layers[0].mlp.down_proj.weight

    def replace():
        p.data = p.data.clone() * 1.5
    _one_entry_per_state(cm, model, replace)

    def step():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.zero_grad()
        model(TOKENS).float().pow(2).mean().backward()
        opt.step()
    _one_entry_per_state(cm, model, step)


@pytest.mark.parametrize("backend", ["bridge", pytest.param("hooked", marks=needs_hooked)])
def test_buffer_change(tmp_path, backend):
    model = _model("llama", backend)
    cm = CachedModel(model, tmp_path)
    if backend == "hooked":
        buf = model.blocks[0].attn.rotary_sin
        index = (5, 3)
    else:
        buf = model.original_model.model.rotary_emb.inv_freq
        index = (3,)

    def edit():
        with torch.no_grad():
            buf[index] += 0.5
    _one_entry_per_state(cm, model, edit)


def test_compat_mode_and_dtype_after_wrapping(tmp_path):
    model = _model("gpt2", "bridge")
    cm = CachedModel(model, tmp_path)
    _one_entry_per_state(cm, model, lambda: model.enable_compatibility_mode(disable_warnings=True))
    assert cm.to(torch.float64) is cm
    assert next(model.parameters()).dtype == torch.float64
    fresh = _fresh(model, names_filter=NAMES)
    _same(_cached(cm, names_filter=NAMES), fresh)
    assert fresh[0].dtype == torch.float64 and len(_entries(tmp_path)) == 3


@needs_hooked
def test_class_and_weights_are_in_the_fingerprint():
    bridge, hooked_ = _model("gpt2", "bridge"), _model("gpt2", "hooked")
    other_seed = _model("gpt2", "bridge", seed=1)
    twin = _model("gpt2", "bridge")
    fps = {model_fingerprint(m) for m in (bridge, hooked_, other_seed)}
    assert len(fps) == 3
    assert model_fingerprint(twin) == model_fingerprint(bridge)  # same model, same fingerprint
    forget(twin)
    assert model_fingerprint(twin) == model_fingerprint(bridge)  # recomputed from scratch


@needs_hooked
def test_bridge_and_hooked_never_share_entries(tmp_path):
    bridge, hooked_ = _model("gpt2", "bridge", True), _model("gpt2", "hooked")
    a, b = CachedModel(bridge, tmp_path), CachedModel(hooked_, tmp_path)
    _cached(a, names_filter=NAMES)
    _same(_cached(b, names_filter=NAMES), _fresh(hooked_, names_filter=NAMES))
    assert b.cache_stats()["misses"] == 1 and len(_entries(tmp_path)) == 2


# ------------------------------------------------------------------------------------- bypasses
def test_hooks_bypass_the_cache(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    _cached(cm, names_filter=NAMES)

    def zero(x, hook):
        return torch.zeros_like(x)
    with quick.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", zero)]):
        fresh = _fresh(quick, names_filter=NAMES)
        got = _cached(cm, names_filter=NAMES)
    _same(got, fresh)
    assert torch.all(got[1]["blocks.0.hook_resid_pre"] == 0)
    quick.blocks[1].mlp.register_forward_hook(lambda mod, i, o: o * 2)  # a plain torch hook
    try:
        _same(_cached(cm, names_filter=NAMES), _fresh(quick, names_filter=NAMES))
    finally:
        quick.blocks[1].mlp._forward_hooks.clear()
    assert cm.cache_stats()["bypass_reasons"] == {"hooks": 2}
    assert len(_entries(tmp_path)) == 1
    _same(_cached(cm, names_filter=NAMES), _fresh(quick, names_filter=NAMES))  # hooks gone: a hit
    assert cm.cache_stats()["hits"] == 1


def test_patched_runs_and_backward_passes_are_never_cached(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    with torch.no_grad():
        cm.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x * 0)])
    assert not tmp_path.exists() or not _entries(tmp_path)
    out, cache = cm.run_with_cache(TOKENS, names_filter=NAMES, incl_bwd=True, return_type="loss")
    assert any(k.endswith("_grad") for k in cache.keys())
    assert not tmp_path.exists() or not _entries(tmp_path)
    assert cm.cache_stats()["bypass_reasons"] == {"incl_bwd": 1}


def test_grad_enabled_calls_are_cached_and_detached_alike_on_hit_and_miss(tmp_path, quick):
    """The seed's own example: run_with_cache with gradients on and parameters that require grad."""
    flags = [p.requires_grad for p in quick.parameters()]
    quick.requires_grad_(True)
    try:
        _grad_calls_cached(tmp_path, quick)
    finally:
        for p, flag in zip(quick.parameters(), flags):
            p.requires_grad_(flag)


def _grad_calls_cached(tmp_path, quick):
    assert torch.is_grad_enabled()
    cm = CachedModel(quick, tmp_path)
    miss = cm.run_with_cache(TOKENS, names_filter=NAMES)
    hit = cm.run_with_cache(TOKENS, names_filter=NAMES)
    assert cm.cache_stats()["misses"] == 1 and cm.cache_stats()["hits"] == 1
    for out, cache in (miss, hit):  # the same, whatever the cache's state
        assert out.grad_fn is None and not out.requires_grad
        assert all(not t.requires_grad for t in cache.values())
    with torch.no_grad():
        fresh_out, fresh_cache = quick.run_with_cache(TOKENS, names_filter=NAMES)
    assert torch.equal(hit[0], fresh_out) and torch.equal(miss[0], fresh_out)
    assert all(torch.equal(hit[1][k], fresh_cache[k]) for k in fresh_cache.keys())
    old = CachedModel(quick, tmp_path / "old", grad="bypass")  # the opt-out keeps the live graph
    out, _ = old.run_with_cache(TOKENS, names_filter=NAMES)
    assert out.grad_fn is not None and old.cache_stats()["bypass_reasons"] == {"grad": 1}
    with pytest.raises(ConfigError):
        CachedModel(quick, tmp_path, grad="sometimes")


def test_cache_dir_none_never_touches_the_disk(tmp_path, quick, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    cm = CachedModel(quick, cache_dir=None)
    for _ in range(2):
        _same(_cached(cm, names_filter=NAMES), _fresh(quick, names_filter=NAMES))
    assert list(tmp_path.iterdir()) == [] and opened == []


def test_wrapper_forwards_and_returns_itself(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    assert cm.to("cpu") is cm and cm.eval() is cm and cm.train(False) is cm and cm.cpu() is cm
    assert cm.requires_grad_(False) is cm
    assert cm.cfg is quick.cfg and cm.blocks is quick.blocks
    from entoscope.models import adapt

    assert model_fingerprint(cm) == model_fingerprint(quick) == model_fingerprint(adapt(cm))
    with torch.no_grad():
        assert torch.equal(cm(TOKENS), quick(TOKENS))
    cm.some_user_attribute = 3
    assert quick.some_user_attribute == 3
    del cm.some_user_attribute
    quick.requires_grad_(True)
    with pytest.raises(UnsupportedModelError):
        CachedModel(cm, tmp_path)
    with pytest.raises(UnsupportedModelError):
        CachedModel(torch.nn.Linear(2, 2), tmp_path)


def test_adapter_reads_through_the_cache(tmp_path, monkeypatch):
    from entoscope.models import adapt

    model = _model("gpt2", "bridge")
    cm = CachedModel(model, tmp_path)
    ref = adapt(model).run(TOKENS, read=["resid_pre.1", "z.0", "attn_in.1"])
    adapter = adapt(cm)
    adapter.run(TOKENS, read=["resid_pre.1", "z.0", "attn_in.1"])
    _no_recompute(monkeypatch, model)
    got = adapter.run(TOKENS, read=["resid_pre.1", "z.0", "attn_in.1"])
    assert torch.equal(got.logits, ref.logits)
    assert all(torch.equal(got.acts[k], ref.acts[k]) for k in ref.acts)


# ------------------------------------------------------------------------------------- row dedupe
def test_alike_rows_are_stored_once_and_read_back_full_width(tmp_path, quick, monkeypatch):
    wide = TOKENS[:1].repeat(6, 1)  # one prompt, as wide as its patched runs
    on, off = CachedModel(quick, tmp_path / "on"), CachedModel(quick, tmp_path / "off", dedupe_rows=False)
    fresh = _fresh(quick, wide, names_filter=NAMES)
    _cached(on, wide, names_filter=NAMES)
    _cached(off, wide, names_filter=NAMES)
    [e_on], [e_off] = _entries(tmp_path / "on"), _entries(tmp_path / "off")
    from safetensors import safe_open

    with safe_open(str(e_on), "pt") as f:
        assert {f.get_slice(k).get_shape()[0] for k in f.keys()} == {1}
    with safe_open(str(e_off), "pt") as f:
        assert {f.get_slice(k).get_shape()[0] for k in f.keys()} == {6}
    assert e_on.stat().st_size < e_off.stat().st_size / 4
    _no_recompute(monkeypatch, quick)
    got = _cached(on, wide, names_filter=NAMES)
    _same(got, fresh)
    assert got[0].shape[0] == 6 and got[0].is_contiguous()


def test_rows_that_differ_in_any_bit_are_all_kept(tmp_path, quick, monkeypatch):
    """A backend that rounds the copies apart: the entry reads back exactly what it computed."""
    wide = TOKENS[:1].repeat(4, 1)
    real = quick.run_with_cache

    def rounding_apart(*a, **k):
        out, cache = real(*a, **k)
        x = cache["blocks.1.hook_resid_post"]
        x[2, 3, 7] = torch.nextafter(x[2, 3, 7], torch.tensor(float("inf")))  # one ulp, one row
        y = cache["blocks.0.hook_mlp_out"]
        y[1, 0, 0] = -0.0 if y[1, 0, 0] == 0 else y[1, 0, 0]
        y[:, 0, 1] = 0.0
        y[3, 0, 1] = -0.0  # equal as numbers, different bits
        return out, cache
    monkeypatch.setattr(quick, "run_with_cache", rounding_apart)
    cm = CachedModel(quick, tmp_path)
    computed = _cached(cm, wide, names_filter=NAMES)
    _no_recompute(monkeypatch, quick)
    got = _cached(cm, wide, names_filter=NAMES)
    _same(got, computed)
    assert torch.signbit(got[1]["blocks.0.hook_mlp_out"][3, 0, 1])
    assert not torch.signbit(got[1]["blocks.0.hook_mlp_out"][2, 0, 1])


def test_rows_alike_compares_bits():
    rows_alike = cache_result._rows_alike
    assert rows_alike(torch.tensor([[1.0, float("nan")], [1.0, float("nan")]]))
    assert not rows_alike(torch.tensor([[0.0, 1.0], [-0.0, 1.0]]))
    assert not rows_alike(torch.ones(1, 3)) and not rows_alike(torch.tensor(1.0))
    assert rows_alike(torch.ones(3, 0, 2)) is False


# ------------------------------------------------------------------------------------- damage
def _damage_and_recompute(tmp_path, quick, caplog, damage) -> None:
    cm = CachedModel(quick, tmp_path)
    fresh = _fresh(quick, names_filter=NAMES)
    _cached(cm, names_filter=NAMES)
    [entry] = _entries(tmp_path)
    good = entry.read_bytes()
    entry.write_bytes(damage(good))
    with caplog.at_level(logging.WARNING, logger="entoscope.cache"):
        got = _cached(cm, names_filter=NAMES)
    _same(got, fresh)
    assert "recomputing" in caplog.text
    assert cm.cache_stats()["corrupt"] == 1 and cm.cache_stats()["misses"] == 2
    assert entry.read_bytes() == good  # rewritten, whole
    caplog.clear()


def test_truncated_entry_is_recomputed(tmp_path, quick, caplog):
    _damage_and_recompute(tmp_path, quick, caplog, lambda b: b[: len(b) // 2])


def test_random_bytes_entry_is_recomputed(tmp_path, quick, caplog):
    _damage_and_recompute(tmp_path, quick, caplog, lambda b: random.Random(1).randbytes(len(b)))


def test_flipped_bit_in_a_tensor_is_recomputed(tmp_path, quick, caplog):
    def flip(b: bytes) -> bytes:
        b = bytearray(b)
        b[-100] ^= 0x10
        return bytes(b)
    _damage_and_recompute(tmp_path, quick, caplog, flip)


def test_tiny_and_empty_files_are_recomputed(tmp_path, quick, caplog):
    _damage_and_recompute(tmp_path / "a", quick, caplog, lambda b: b"")
    _damage_and_recompute(tmp_path / "b", quick, caplog, lambda b: struct.pack("<Q", 1 << 40) + b"{}")


def test_entry_from_an_older_format_is_recomputed(tmp_path, quick, caplog, monkeypatch):
    fresh = _fresh(quick, names_filter=NAMES)
    monkeypatch.setattr(cache_entry, "FORMAT_VERSION", 0)  # a release that stored entries differently
    _cached(CachedModel(quick, tmp_path), names_filter=NAMES)
    [old] = _entries(tmp_path)
    monkeypatch.setattr(cache_entry, "FORMAT_VERSION", 1)
    cm = CachedModel(quick, tmp_path)
    _same(_cached(cm, names_filter=NAMES), fresh)
    assert cm.cache_stats()["misses"] == 1 and len(_entries(tmp_path)) == 2  # never looked up
    # and an old-format file found at the current name is not misread
    [new] = [p for p in _entries(tmp_path) if p != old]
    monkeypatch.setattr(cache_entry, "FORMAT_VERSION", 0)
    meta, tensors, _ = read_entry(old, old.name[:-12])
    write_entry(new, tensors, dict(meta, digest=new.name[:-12]))
    monkeypatch.setattr(cache_entry, "FORMAT_VERSION", 1)
    with caplog.at_level(logging.WARNING, logger="entoscope.cache"):
        _same(_cached(cm, names_filter=NAMES), fresh)
    assert "format 0" in caplog.text and cm.cache_stats()["misses"] == 2


def test_stats_count_bytes_on_disk(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    _cached(cm, names_filter=NAMES)
    _cached(cm, names_filter=NAMES)
    stats = cm.cache_stats()
    size = sum(p.stat().st_size for p in _entries(tmp_path))
    assert stats["bytes_written"] == size == stats["bytes_read"] == stats["disk_bytes"]
    assert stats["entries"] == 1 and stats["hits"] == 1 and stats["misses"] == 1


# ------------------------------------------------------------------------------------- concurrency
def test_threads_writing_one_path(tmp_path):
    path = tmp_path / "m" / "x-y.safetensors"
    payloads = [{"o0": torch.full((64, 1024), float(i))} for i in range(6)]
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for _ in range(15):
                write_entry(path, payloads[i], {"format": cache_entry.FORMAT_VERSION, "digest": "x-y"})
        except BaseException as err:  # pragma: no cover - the assertion reports it
            errors.append(err)

    def reader() -> None:
        try:
            for _ in range(60):
                if path.exists():
                    _, t, _ = read_entry(path, "x-y")
                    v = t["o0"][0, 0].item()
                    assert torch.equal(t["o0"], payloads[int(v)]["o0"])
        except BaseException as err:  # pragma: no cover
            errors.append(err)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)] + \
        [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_threads_with_their_own_models_share_entries(tmp_path, quick):
    fresh = [_fresh(quick, TOKENS[i:i + 2], names_filter=NAMES) for i in range(2)]
    models = [copy.deepcopy(quick) for _ in range(4)]
    errors: list[BaseException] = []

    def work(model) -> None:
        try:
            cm = CachedModel(model, tmp_path)
            for r in range(6):
                i = r % 2
                _same(_cached(cm, TOKENS[i:i + 2], names_filter=NAMES), fresh[i])
        except BaseException as err:  # pragma: no cover
            errors.append(err)
    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(_entries(tmp_path)) == 2


def _hammer(cache_dir: str, worker: int, barrier, queue) -> None:
    """One of 8 processes: same model, same keys; every value read is checked against its own run."""
    torch.set_num_threads(1)
    try:
        model = _model()
        cm = CachedModel(model, cache_dir)
        keys = [(TOKENS[i:i + 2], names) for i in range(2) for names in (NAMES, None)]
        expected = [_fresh(model, t, names_filter=n) for t, n in keys]
        folder = cm.cache_folder
        rng = random.Random(worker)
        barrier.wait()
        checked = 0
        for r in range(12):
            k = rng.randrange(len(keys))
            if worker % 2 and r % 3 == 2:  # some processes delete entries, so writes keep racing reads
                for p in folder.glob("*.safetensors"):
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass
            _same(_cached(cm, keys[k][0], names_filter=keys[k][1]), expected[k])
            checked += 1
        stats = cm.cache_stats()
        queue.put((worker, checked, stats["hits"] + stats["subset_hits"], stats["corrupt"], None))
    except BaseException as err:  # pragma: no cover - reported to the parent
        queue.put((worker, 0, 0, 0, f"{type(err).__name__}: {err}"))


@pytest.mark.slow
def test_eight_processes_hammering_the_same_keys(tmp_path, quick):
    # forkserver: each worker starts from a clean process that imported torch and TransformerLens
    # once (spawn semantics: no inherited threads or locks), without paying 8 imports on 2 cores.
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "transformer_lens", "transformers.models.gpt2.modeling_gpt2",
                                    "entoscope.models.tiny", "entoscope.models.hooked_config",
                                    "entoscope.models.cached"])
    barrier, queue = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), w, barrier, queue)) for w in range(8)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [r[4] for r in results] == [None] * 8, results
    assert sum(r[1] for r in results) == 8 * 12 and sum(r[2] for r in results) > 0
    assert sum(r[3] for r in results) == 0  # no reader ever saw a torn or foreign file
    files = list(tmp_path.rglob("*"))
    assert not [f for f in files if f.name.endswith(".tmp")]
    cm = CachedModel(quick, tmp_path)
    for entry in _entries(tmp_path):  # every entry left is valid, and holds the right values
        meta, tensors, _ = read_entry(entry, entry.name[:-12])
        assert meta["model"] == model_fingerprint(quick)
    keys = [(TOKENS[i:i + 2], names) for i in range(2) for names in (NAMES, None)]
    for t, n in keys:
        _same(_cached(cm, t, names_filter=n), _fresh(quick, t, names_filter=n))


def test_cache_stats_skips_an_entry_removed_after_the_listing(tmp_path, quick, monkeypatch):
    import entoscope.models.cached as cached_module

    cm = CachedModel(quick, tmp_path)
    _cached(cm, names_filter=NAMES)
    real = list(os.scandir(cm.cache_folder))
    real_bytes = sum(e.stat().st_size for e in real if e.name.endswith(".safetensors"))

    class Gone:  # listed, then deleted by another process before stat()
        name = "0" * 32 + "-gone.safetensors"

        def stat(self):
            raise FileNotFoundError(self.name)

    monkeypatch.setattr(cached_module.os, "scandir", lambda folder: real + [Gone()])
    stats = cm.cache_stats()
    assert stats["entries"] == 1 and stats["disk_bytes"] == real_bytes


def test_stale_temp_files_of_dead_writers_are_swept_and_counted(tmp_path, quick):
    cm = CachedModel(quick, tmp_path)
    _cached(cm, names_filter=NAMES)
    folder = cm.cache_folder
    dead = 2 ** 22 + 12345  # above any pid this machine hands out (pid_max is at most 2**22)
    old = os.path.getmtime(next(folder.glob("*.safetensors"))) - 2 * cache_entry.STALE_AFTER_S
    stale = folder / f".x.safetensors.{cache_entry._HOST}.{dead}.1.abc123.tmp"
    mine = folder / f".y.safetensors.{cache_entry._HOST}.{os.getpid()}.1.abc123.tmp"  # a live writer
    fresh = folder / f".z.safetensors.{cache_entry._HOST}.{dead}.1.abc124.tmp"  # too young to be sure
    legacy = folder / f".w.safetensors.{dead}.1.abc125.tmp"  # the name format before hosts were recorded
    for f in (stale, mine, fresh, legacy):
        f.write_bytes(b"\0" * 1000)
    for f in (stale, mine, legacy):
        os.utime(f, (old, old))
    stats = cm.cache_stats()
    assert not stale.exists() and not legacy.exists() and mine.exists() and fresh.exists()
    assert stats["stale_temps_removed"] == 2 and stats["temp_files"] == 2
    assert stats["entries"] == 1  # the entry itself is untouched
