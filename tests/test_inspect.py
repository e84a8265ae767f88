"""`es.inspect` on every model kind and family, against numbers it does not compute: transformers' own eager
attention weights and logits (a fresh HuggingFace model with the same seed), runs patched by hand with forward
hooks written here, and the operations it stands beside on the same prompt (es.Lens, es.DirectLogitAttribution).
Also: the saved folder reads back, the refusals, the command line (text options taken as written)."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

import entoscope as es
from entoscope.data import Dataset, Example
from entoscope.errors import EntoscopeError
from entoscope.models import adapt
from entoscope.models.tiny import FAMILIES, GEMMA_FAMILIES, tiny_hf_model

from conftest import get_tiny, has_hooked_transformer

PROMPT = "When Mary and John went to the store, John gave a drink to"
CF = "When Mary and John went to the store, Mary gave a drink to"


def _has_nnsight() -> bool:
    try:
        import nnsight  # noqa: F401
        return True
    except ImportError:
        return False


KINDS = [(f, b, c) for f in FAMILIES + GEMMA_FAMILIES
         for b, c in (("bridge", False), ("bridge", True), ("hooked", False), ("nnsight", False))
         if not (b == "hooked" and (f in GEMMA_FAMILIES or not has_hooked_transformer()))
         and not (b == "nnsight" and not _has_nnsight())]
IDS = [f"{f}-{b}{'-compat' if c else ''}" for f, b, c in KINDS]
_RUNS: dict = {}


def inspected(variant, **kw):
    """es.inspect of PROMPT (answer ' Mary', wrong ' John', the counterfactual) on the variant, made once."""
    key = (variant, tuple(sorted(kw.items())))
    if key not in _RUNS:
        args = {"answer": " Mary", "wrong": " John", "counterfactual": CF, **kw}
        _RUNS[key] = es.inspect(get_tiny(*variant), PROMPT, **{k: v for k, v in args.items() if v is not None})
    return _RUNS[key]


def hf_reference(family, tokens):
    """transformers' own forward of the same weights (same seed), eager attention: (logits [T, V], attentions)."""
    hf = tiny_hf_model(family)
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_attentions=True)
    return out.logits[0].double(), [a[0] for a in out.attentions]


def hf_blocks(hf, family):
    """transformers' own decoder blocks of the tiny model."""
    if family == "gpt2":
        return hf.transformer.h
    if family == "neox":
        return hf.gpt_neox.layers
    return hf.model.layers


def page_weights(result) -> np.ndarray:
    """The attention the page's view draws: its embedded JSON decoded ([L, H, T(T+1)/2] float32)."""
    from entoscope.inspection.page import attention_html

    body = attention_html(result)
    payload = re.search(r'<script type="application/json" id="[^"]+">(.*?)</script>', body, re.S).group(1)
    data = json.loads(payload.replace("<\\/", "</"))
    flat = np.frombuffer(base64.b64decode(data["attention"]), dtype="<f4")
    T = data["T"]
    return flat.reshape(data["n_layers"], data["n_heads"], T * (T + 1) // 2), data


@pytest.mark.parametrize("variant", KINDS, ids=IDS)
def test_the_attention_view_is_the_models_eager_attention(variant):
    family = variant[0]
    r = inspected(variant)
    tokens = [int(t) for t in r.table["token_id"]]
    _, attentions = hf_reference(family, tokens)
    T = len(tokens)
    q, k = np.tril_indices(T)
    drawn, data = page_weights(r)
    table = r.attention
    assert len(table) == len(attentions) * attentions[0].shape[0] * len(q)
    for L, ref in enumerate(attentions):
        ref = ref.float().numpy()  # [H, T, T]
        assert np.abs(np.triu(ref, 1)).max() == 0  # causal: nothing above the diagonal, which the table leaves out
        rows = table[table["layer"] == L].sort_values(["head", "query_pos", "key_pos"])
        got = np.zeros_like(ref)
        got[rows["head"].to_numpy(), rows["query_pos"].to_numpy(), rows["key_pos"].to_numpy()] = rows["weight"]
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(drawn[L], ref[:, q, k], atol=2e-5, rtol=1e-4)
    assert data["tokens"] == r.tokens and data["n_heads"] == attentions[0].shape[0]


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_gemma_sliding_windows_are_in_the_view(family):
    """Layer 0 of the tiny Gemma models sees only its last 4 keys: the view is told so, and its weights (the
    model's own) are 0 outside the window."""
    r = inspected((family, "bridge", False))
    drawn, data = page_weights(r)
    assert data["window"] == {"size": 4, "layers": [0]}
    T = data["T"]
    q, k = np.tril_indices(T)
    outside = (q - k) >= 4
    assert outside.any() and np.abs(drawn[0][:, outside]).max() == 0
    assert np.abs(drawn[1][:, outside]).max() > 0  # the full-attention layer reaches back further
    from entoscope.inspection.page import attention_html

    assert "outside the sliding window" in attention_html(r)


@pytest.mark.parametrize("variant", KINDS, ids=IDS)
def test_predictions_are_the_models_own_softmax(variant):
    r = inspected(variant)
    tokens = [int(t) for t in r.table["token_id"]]
    logits, _ = hf_reference(variant[0], tokens)
    probs = logits.softmax(-1)
    top_p, top_i = probs.topk(5, dim=-1)
    np.testing.assert_allclose(r.table[[f"top{i}_prob" for i in range(1, 6)]].to_numpy(float), top_p.numpy(),
                               atol=1e-5, rtol=1e-4)
    vocab = adapt(get_tiny(*variant)).vocab_strings()
    assert r.table["top1_token"].tolist() == [vocab[int(i)] for i in top_i[:, 0]]
    mary, john = (adapt(get_tiny(*variant)).token_id(t) for t in (" Mary", " John"))
    last = r.table.iloc[-1]
    assert last["answer_rank"] == int((logits[-1] > logits[-1, mary]).sum())
    assert last["logit_diff"] == pytest.approx(float(logits[-1, mary] - logits[-1, john]), abs=1e-4, rel=1e-4)


@pytest.mark.parametrize("variant", [v for v in KINDS if v[0] != "gemma2"], ids=[i for v, i in zip(KINDS, IDS)
                                                                                 if v[0] != "gemma2"])
def test_dla_rows_sum_to_the_models_logit_difference(variant):
    r = inspected(variant)
    tokens = [int(t) for t in r.table["token_id"]]
    logits, _ = hf_reference(variant[0], tokens)
    a = adapt(get_tiny(*variant))
    diff = float(logits[-1, a.token_id(" Mary")] - logits[-1, a.token_id(" John")])
    assert r.dla["contribution"].sum() == pytest.approx(diff, abs=2e-4, rel=2e-4)
    s = a.structure
    assert (r.dla["kind"] == "head").sum() == s.n_layers * s.n_heads and (r.dla["kind"] == "mlp").sum() == s.n_layers
    # the same rows as the DLA operation's on this prompt (one example)
    data = Dataset("one", (Example(PROMPT, answers=(" Mary",), wrong_answers=(" John",)),))
    op = es.DirectLogitAttribution(stats={"n_boot": 0}).run(get_tiny(*variant), data, quiet=True)
    theirs = op.per_prompt.set_index("component")["contribution"]
    mine = r.dla.set_index("component")["contribution"].drop("constant")
    pd.testing.assert_series_equal(mine.sort_index(), theirs.sort_index(), check_exact=False, rtol=1e-9, atol=1e-9)


def test_gemma2_has_no_dla_and_says_why():
    """Gemma 2's logits pass a tanh soft cap: no sum of parts is the logit, so DLA is left out with a warning."""
    r = inspected(("gemma2", "bridge", False))
    assert r.dla is None and "dla" not in r.tables
    assert [w["code"] for w in r.warnings] == ["logit_softcap"]
    assert r.patching is not None and len(r.lens)


@pytest.mark.parametrize("variant", [v for v in KINDS if v[1] != "bridge" or not v[2]][:6] +
                         [("gemma3", "bridge", False)], ids=lambda v: f"{v[0]}-{v[1]}")
def test_the_lens_grid_equals_es_lens_on_the_same_prompt(variant):
    r = inspected(variant)
    data = Dataset("one", (Example(PROMPT, answers=(" Mary",)),))
    lens = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]), top_k=5,
                   stats={"n_boot": 0}).run(get_tiny(*variant), data, quiet=True).per_prompt
    mine = r.lens.sort_values(["layer", "position"]).reset_index(drop=True)
    theirs = lens.sort_values(["layer", "position"]).reset_index(drop=True)
    assert len(mine) == len(theirs) == r.extra["structure"]["n_layers"] * len(r.tokens)
    assert mine["site"].tolist() == theirs["site"].tolist()
    for i in range(1, 6):
        assert mine[f"top{i}_token"].tolist() == theirs[f"top{i}_token"].tolist()
        np.testing.assert_allclose(mine[f"top{i}_prob"], theirs[f"top{i}_prob"], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(mine["answer_rank"], theirs["target_rank"])
    np.testing.assert_allclose(mine["answer_prob"], theirs["target_prob"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mine["kl_to_final"], theirs["kl_to_final"], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("variant", [("gpt2", "bridge", False), ("llama", "bridge", False), ("neox", "bridge", True),
                                     ("gemma3", "bridge", False)]
                         + ([("llama", "nnsight", False)] if _has_nnsight() else []), ids=lambda v: f"{v[0]}-{v[1]}")
def test_patching_cells_equal_runs_patched_by_hand(variant):
    """Each cell: the counterfactual run by transformers with block L's input at position p replaced (a forward
    pre-hook written here) by the prompt's run's, read as the logit difference."""
    family = variant[0]
    r = inspected(variant)
    a = adapt(get_tiny(*variant))
    clean, corrupt = a.tokenize(PROMPT), a.tokenize(CF)
    mary, john = a.token_id(" Mary"), a.token_id(" John")
    hf = tiny_hf_model(family)
    with torch.no_grad():
        states = hf(torch.tensor([clean]), output_hidden_states=True).hidden_states  # [L + 1] inputs of each block

    def patched(layer, pos):
        def hook(module, args, kwargs):
            h = (args[0] if args else kwargs["hidden_states"]).clone()
            h[:, pos] = states[layer][:, pos]
            return ((h,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
        handle = hf_blocks(hf, family)[layer].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                out = hf(torch.tensor([corrupt])).logits[0, -1].double()
        finally:
            handle.remove()
        return float(out[mary] - out[john])

    table = r.patching
    assert len(table) == a.structure.n_layers * len(clean)
    for row in table.itertuples():
        assert row.patched == pytest.approx(patched(row.layer, row.position), abs=2e-4, rel=2e-4), row.site
    terms = r.extra["patching_terms"]
    with torch.no_grad():
        c = hf(torch.tensor([clean])).logits[0, -1].double()
        k = hf(torch.tensor([corrupt])).logits[0, -1].double()
    assert terms["clean"] == pytest.approx(float(c[mary] - c[john]), abs=2e-4)
    assert terms["corrupt"] == pytest.approx(float(k[mary] - k[john]), abs=2e-4)
    norm = (table["patched"] - terms["corrupt"]) / (terms["clean"] - terms["corrupt"])
    np.testing.assert_allclose(table["normalized"], norm, rtol=1e-9)


def test_without_an_answer_patching_reads_the_models_own_predictions():
    variant = ("gpt2", "bridge", False)
    r = es.inspect(get_tiny(*variant), PROMPT, counterfactual=CF)
    a = adapt(get_tiny(*variant))
    hf = tiny_hf_model("gpt2")
    with torch.no_grad():
        c = hf(torch.tensor([a.tokenize(PROMPT)])).logits[0, -1].double()
        k = hf(torch.tensor([a.tokenize(CF)])).logits[0, -1].double()
    top_c, top_k = int(c.argmax()), int(k.argmax())
    terms = r.extra["patching_terms"]
    vocab = a.vocab_strings()
    assert terms["derived"] and terms["answer"] == vocab[top_c]
    if top_k != top_c:
        assert terms["wrong"] == vocab[top_k] and terms["clean"] == pytest.approx(float(c[top_c] - c[top_k]), abs=2e-4)
    assert r.dla is None and "answer" not in r.table


def test_every_model_kind_saves_and_reads_back(tiny, tmp_path):
    r = es.inspect(tiny, PROMPT, answer=" Mary", wrong=" John", counterfactual=CF)
    r.save(tmp_path / "run")
    back = es.Result.load(tmp_path / "run")
    assert set(back.tables) == {"lens", "attention", "dla", "patching"}
    for name, frame in r.tables.items():
        pd.testing.assert_frame_equal(back.tables[name], frame, check_exact=True)
    pd.testing.assert_frame_equal(back.table, r.table, check_exact=True)
    assert back.takeaway == r.takeaway and "The answer ' Mary'" in r.takeaway
    page = (tmp_path / "run" / "index.html").read_text()
    assert "window.entoscopeInspect" in page and "cdn" not in page.lower()


def test_in_a_notebook_the_view_is_inline_and_plotly_travels_once(monkeypatch):
    from entoscope.results import notebook

    monkeypatch.setattr(notebook, "_SENT", [False])  # a fresh kernel session
    r = inspected(("gpt2", "bridge", False))
    first, second = r._repr_html_(), r._repr_html_()
    assert first.count("* plotly.js v") == 1 and "* plotly.js v" not in second
    assert 'class="esi-root"' in second and "window.entoscopeInspect(" in second and "Plotly.newPlot" in second
    monkeypatch.setattr(notebook, "EVERY_OUTPUT", True)
    assert "* plotly.js v" in r._repr_html_()


def test_a_tuned_and_a_jacobian_lens_grid_equal_es_lens(tmp_path):
    model = get_tiny("gpt2", "bridge", False)
    fit = Dataset("fit", tuple(Example(p) for p in (PROMPT, CF, "The capital of France is Paris.")))
    tuned = es.TunedLens.for_model(model)
    tuned.fit(model, fit, steps=3, quiet=True)
    tuned.save(tmp_path / "tuned")
    es.JacobianLens.fit(model, fit, skip_first=1, quiet=True).save(tmp_path / "jacobian")
    data = Dataset("one", (Example(PROMPT, answers=(" Mary",)),))
    for method, path, key in (("tuned", tmp_path / "tuned", "translators"),
                              ("jacobian", tmp_path / "jacobian", "lens")):
        r = es.inspect(model, PROMPT, answer=" Mary", lens=str(path))
        mine = r.tables[f"{method}_lens"].sort_values(["layer", "position"]).reset_index(drop=True)
        theirs = es.Lens(method=method, **{key: str(path)}, sites=es.Sites(activation="resid_post",
                         over=["layer", "position"]), stats={"n_boot": 0}).run(model, data, quiet=True).per_prompt
        theirs = theirs.sort_values(["layer", "position"]).reset_index(drop=True)
        assert len(mine) == len(theirs) > 0
        assert mine["top1_token"].tolist() == theirs["top1_token"].tolist()
        np.testing.assert_allclose(mine["top1_prob"], theirs["top1_prob"], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(mine["answer_rank"], theirs["target_rank"])
        assert f"{method} lens" in "".join(t for t, _ in r.page_sections()).replace("Jacobian", "jacobian")


@pytest.mark.parametrize("kwargs, code", [
    ({"wrong": " John"}, "wrong_without_answer"),
    ({"counterfactual": "When Mary and John went to the shop"}, "lengths_differ"),
    ({"answer": " Maryland", "answer_scoring": "single"}, "multi_token_answer"),
    ({"lens": "/nonexistent/lens"}, "lens_not_found"),
])
def test_bad_input_is_refused_before_any_run(kwargs, code, tmp_path):
    model = get_tiny("gpt2", "bridge", False)
    args = {"prompt": PROMPT, **kwargs}
    with pytest.raises(EntoscopeError) as err:
        es.Inspect(**args).plan(model)
    assert err.value.code == code


def test_a_prompt_whose_attention_view_is_too_large_is_refused(monkeypatch):
    import entoscope.inspection.operation as operation

    model = get_tiny("gpt2", "bridge", False)  # 2 layers x 4 heads; the prompt's 29 tokens: 8 x 435 weights
    monkeypatch.setattr(operation, "MAX_ATTENTION", 8 * 435 - 1)
    with pytest.raises(EntoscopeError) as err:
        es.Inspect(prompt=PROMPT).plan(model)
    assert err.value.code == "inspect_prompt_too_long" and "3,480 weights" in str(err.value)
    monkeypatch.setattr(operation, "MAX_ATTENTION", 8 * 435)
    es.Inspect(prompt=PROMPT).plan(model)


def test_a_folder_that_is_no_lens_and_data_are_refused(tmp_path):
    model = get_tiny("gpt2", "bridge", False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EntoscopeError) as err:
        es.inspect(model, PROMPT, lens=str(tmp_path / "empty"))
    assert err.value.code == "lens_unknown"
    with pytest.raises(EntoscopeError) as err:
        es.Inspect(prompt=PROMPT).run(model, [PROMPT])
    assert err.value.code == "inspect_takes_no_data"
    with pytest.raises(EntoscopeError) as err:
        es.Inspect()
    assert err.value.code == "config_invalid" and "prompt" in str(err.value)


def test_the_command_line_takes_text_as_written(tmp_path, capsys):
    from entoscope.cli import main

    out = tmp_path / "run"
    code = main(["inspect", "--model", "demo", "--prompt", "When Mary and John went to the store, John gave a drink to",
                 "--answer", " Mary", "--wrong", " John", "--counterfactual",
                 "When Mary and John went to the store, Mary gave a drink to", "--out", str(out), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "takeaway: " in printed and "saved: " in printed
    table = pd.read_parquet(out / "table.parquet")
    assert table["answer"].iloc[-1] == " Mary" and table["wrong"].iloc[-1] == " John"  # the leading space kept
    for name in ("lens", "attention", "dla", "patching"):
        assert (out / f"{name}.csv").is_file() and (out / f"{name}.parquet").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["answer"] == " Mary" and manifest["tables"] == ["attention", "dla", "lens", "patching"]


@pytest.mark.real
def test_real_models_attention_dla_and_lens(real_folder):
    """SmolLM2-135M and Gemma 3 270M: the attention view is transformers' eager attention, the DLA rows sum to
    transformers' own logit difference, and the lens grid is es.Lens's on the same prompt."""
    from transformers import AutoModelForCausalLM

    prompt = "The Eiffel Tower is in Paris, and the Louvre is also located in the city of"
    model = es.load_model(str(real_folder))
    r = es.inspect(model, prompt, answer=" Paris", wrong=" Moscow")
    hf = AutoModelForCausalLM.from_pretrained(str(real_folder), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = [int(t) for t in r.table["token_id"]]
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_attentions=True)
    drawn, data = page_weights(r)
    q, k = np.tril_indices(len(tokens))
    for L, ref in enumerate(out.attentions):
        np.testing.assert_allclose(drawn[L], ref[0].float().numpy()[:, q, k], atol=1e-4)
    a = adapt(model)
    last = out.logits[0, -1].double()
    diff = float(last[a.token_id(" Paris")] - last[a.token_id(" Moscow")])
    assert r.dla["contribution"].sum() == pytest.approx(diff, abs=1e-3, rel=1e-3)
    data = Dataset("one", (Example(prompt, answers=(" Paris",)),))
    lens = es.Lens(sites=es.Sites(activation="resid_post", over=["layer", "position"]), top_k=5,
                   stats={"n_boot": 0}).run(model, data, quiet=True).per_prompt
    mine = r.lens.sort_values(["layer", "position"]).reset_index(drop=True)
    theirs = lens.sort_values(["layer", "position"]).reset_index(drop=True)
    assert mine["top1_token"].tolist() == theirs["top1_token"].tolist()
    # the same maths on matrices of other shapes (layers x positions at once, against the lens's chunks of sites):
    # float32 sums of 640 products rounded apart by up to 1e-4 on Gemma 3's large logits
    np.testing.assert_allclose(mine["top1_prob"], theirs["top1_prob"], rtol=1e-3, atol=1e-5)
    # ranks: equal where they are small; among tens of thousands of tokens within float32 rounding of the
    # answer's logit, one or two may fall either side (12,202 against 12,203 on Gemma 3)
    np.testing.assert_allclose(mine["answer_rank"], theirs["target_rank"], rtol=1e-4, atol=0)
