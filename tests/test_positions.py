"""Positions that mean what they say: on prompts of different lengths a run over `position` counts from
each prompt's end (END, END-1, ...), labels say so, and a warning is said once with its count.

The lens values are checked against the logit lens computed by hand from TransformerLens' own
`run_with_cache` on each prompt alone (no padding, no batching): unembed(ln_final(resid_post)) at the
prompt's own last token."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

import entoscope as es
from entoscope.errors import EntoscopeWarning, recording_warnings, warn
from entoscope.sites import Sites, position_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def test_end_relative_columns_are_each_prompts_own_tokens_by_hand(demo):
    data = es.tasks.ioi(n=6, seed=1)
    tokens = [demo.to_tokens(ex.prompt) for ex in data]  # BOS prepended, as entoscope does
    lengths = [t.shape[1] for t in tokens]
    assert len(set(lengths)) > 1  # prompts of different lengths
    r = es.Lens(sites=Sites(activation="resid_post", over=["layer", "position"])).run(demo, data, quiet=True)
    t = r.table
    shortest = min(lengths)
    expected = ["END"] + [f"END-{k}" for k in range(1, shortest)]
    assert set(t["position"]) == set(expected)  # the last `shortest` tokens of every prompt, from each end
    pp = r.per_prompt
    for e, (tok, ex) in enumerate(zip(tokens, data)):
        answer = demo.to_single_token(ex.answers[0])
        with torch.no_grad():
            _, cache = demo.run_with_cache(tok)
            for k in (0, 2):
                label = "END" if k == 0 else f"END-{k}"
                for layer in (0, 1):
                    x = cache[f"blocks.{layer}.hook_resid_post"][:, -1 - k]
                    probs = demo.unembed(demo.ln_final(x[:, None]))[0, 0].double().softmax(-1)
                    row = pp[(pp.example == e) & (pp.layer == layer) & (pp.position == label)].iloc[0]
                    assert row.token_position == lengths[e] - 1 - k
                    assert row.target_prob == pytest.approx(float(probs[answer]), abs=2e-5)
    # the table's END cell is the mean over prompts of each prompt's own last token
    end = pp[(pp.layer == 1) & (pp.position == "END")].sort_values("example")
    cell = t[(t.layer == 1) & (t.position == "END")].iloc[0]
    assert cell.target_prob_mean == pytest.approx(end.target_prob.mean(), rel=1e-9)
    assert "each prompt's last token (END)" in r.takeaway


def test_equal_lengths_keep_token_indices_and_labels_follow_one_spelling(demo):
    from entoscope.models.adapter import adapt

    same = Sites(activation="resid_post", over=["position"]).resolve(adapt(demo), [7, 7])
    assert [u.get("pos") for u in same.units] == list(range(7))
    assert list(same.frame()["position"]) == list(range(7))
    mixed = Sites(activation="resid_post", over=["layer", "position"], positions=[1, -1, -3])
    s = mixed.resolve(adapt(demo), [9, 12])
    assert list(s.frame()["position"].unique()) == ["1", "END", "END-2"]  # one column of labels
    assert {u.label for u in s.units} >= {"resid_post.0@1", "resid_post.0@END", "resid_post.2@END-2"}
    assert [position_text(p) for p in (0, 4, -1, -2, -10)] == ["0", "4", "END", "END-1", "END-9"]


def test_a_token_index_is_never_called_the_last_token_when_lengths_differ(demo):
    data = es.tasks.ioi(n=6, seed=1)
    r = es.Lens(sites=Sites(activation="resid_post", over=["layer", "position"], positions=[3, 13])).run(
        demo, data, quiet=True)
    assert "last token (" not in r.takeaway and "At token position 13" in r.takeaway
    from entoscope.data.examples import Dataset

    pool = list(es.tasks.greater_than(n=16, seed=3))
    n = min(demo.to_tokens(ex.prompt).shape[1] for ex in pool)
    same = Dataset("equal lengths", tuple(ex for ex in pool if demo.to_tokens(ex.prompt).shape[1] == n))
    r = es.Lens(sites=Sites(activation="resid_post", over=["layer", "position"])).run(demo, same, quiet=True)
    assert sorted(set(r.table.position)) == list(range(n))  # one length: token indices, which are the same tokens
    assert f"At the last token (position {n - 1}: every prompt has {n} tokens)" in r.takeaway


def test_a_warning_is_said_once_with_its_count():
    tag = uuid.uuid4().hex  # messages no other test has shown
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        with recording_warnings() as log:
            for _ in range(3):
                warn(f"first {tag}", code="test_code")
            warn(f"second {tag}", code="test_code")
            warn(f"third {tag}", code="test_code")
            warn(f"other {tag}", code="other_code")
        again = recording_warnings()
        with again as log2:
            warn(f"first {tag}", code="test_code")  # said already in this process: recorded, not shown again
    assert [(w["message"].split()[0], w["count"]) for w in log] == [("first", 3), ("second", 1), ("third", 1),
                                                                    ("other", 1)]
    assert log2 == [{"code": "test_code", "message": f"first {tag}", "count": 1}]
    texts = [str(w.message) for w in shown]
    assert texts == [f"[test_code] first {tag}", f"[other_code] other {tag}",
                     "[test_code] 2 more warnings of this kind in this run (result.warnings and the manifest list "
                     "them all)"]
    assert all(w.category is EntoscopeWarning for w in shown)
    with warnings.catch_warnings(), pytest.raises(EntoscopeWarning):  # the filters still rule
        warnings.simplefilter("error")
        warn(f"first {tag}", code="test_code")


@pytest.mark.slow  # the CLI (or the README's script) as a subprocess: the slow set
def test_the_readme_example_says_at_most_one_warning_line_and_quotes_its_table(tmp_path):
    """The README's ten lines run as written: patching by layer and token role (each prompt's own IO, S1, S2 and
    last token), at most one warning line, a takeaway that quotes the table's cell of largest |value| as saved,
    and the one-prompt inspection."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(import entoscope as es\n.*?)```", readme, re.S).group(1)
    assert "es.tasks.ioi(n=64)" in code and 'over=["layer", "position"]' in code and "es.inspect(" in code
    code += "\nprint('TAKEAWAY', result.takeaway)\n"
    (tmp_path / "example.py").write_text(code, encoding="utf-8")
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    warning_lines = [line for line in out.stderr.splitlines() if "Warning" in line or "warn(" in line]
    assert len(warning_lines) <= 1, warning_lines
    takeaway = next(line for line in out.stdout.splitlines() if line.startswith("TAKEAWAY"))
    table = pd.read_csv(tmp_path / "runs" / "ioi_patching" / "table.csv")
    assert set(table["position"]) == {"IO", "S1", "S2", "END"} and len(table) == 4 * table["layer"].nunique()
    top = table.loc[table["value"].abs().idxmax()]
    assert f"@{top['position']}" in takeaway and f"{top['value']:.3g}" in takeaway
