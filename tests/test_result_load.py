"""A saved run reopens: `es.Result.load(folder)` gives back the table, per-prompt table, takeaway, warnings
and manifest that `save` wrote (compared with the Result in memory), for several operations and for a
report's section folders; a folder that is not a complete run is refused with a code naming the file;
the command line prints the takeaway after the table."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

import entoscope as es
from entoscope.cli import main
from entoscope.errors import EntoscopeError


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _operations():
    ioi = {"task": "ioi", "n": 6, "seed": 3}
    return {
        "lens": (es.Lens(sites={"activation": "resid_post", "over": ["layer", "position"]}), ioi),
        "patching": (es.Patching(sites={"activation": "resid_pre", "over": ["layer", "position"],
                                        "positions": ["S2", "END"]}), ioi),
        "dla": (es.DirectLogitAttribution(), ioi),
        "head_scores": (es.HeadScores(), {"task": "induction", "n": 4}),
        "circuits": (es.Circuits(method="eap", n_edges=5, faithfulness=[0.5]), {"task": "induction", "n": 6}),
        "probing": (es.Probing(sites={"activation": "resid_post", "over": ["layer"]}), {"task": "ioi", "n": 40}),
        "ifr": (es.InformationFlowRoutes(), {"task": "ioi", "n": 3}),
    }


@pytest.mark.parametrize("name", list(_operations()))
def test_save_then_load_gives_back_the_table_per_prompt_table_takeaway_and_manifest(demo, name, tmp_path):
    op, data = _operations()[name]
    result = op.run(demo, data, quiet=True)
    folder = result.save(tmp_path / name)
    loaded = es.Result.load(folder)
    pd.testing.assert_frame_equal(loaded.table, result.table)
    if result.per_prompt is not None:
        pd.testing.assert_frame_equal(loaded.per_prompt, result.per_prompt)
    assert loaded.takeaway == result.takeaway and loaded.takeaway
    assert loaded.operation == result.operation and loaded.title == result.title
    on_disk = json.loads((folder / "manifest.json").read_text())
    assert on_disk["takeaway"] == result.takeaway  # the takeaway is in manifest.json too
    assert loaded.manifest == on_disk and on_disk["config"] == result.manifest["config"]
    assert loaded.warnings == result.warnings


def test_a_loaded_per_prompt_table_streams_in_whole_prompts(demo, tmp_path, monkeypatch):
    import entoscope.results.saved as saved

    op, data = _operations()["patching"]
    result = op.run(demo, data, quiet=True)
    loaded = es.Result.load(result.save(tmp_path / "run"))
    monkeypatch.setattr(saved, "BLOCK_ROWS", 5)  # blocks smaller than one prompt's 6 rows
    blocks = list(loaded.per_prompt_blocks())
    assert len(blocks) == 6
    for block in blocks:  # no prompt split over two blocks
        assert block["example"].nunique() == 1
    pd.testing.assert_frame_equal(pd.concat(blocks, ignore_index=True), result.per_prompt)
    head = loaded.per_prompt_head(2)
    pd.testing.assert_frame_equal(head, result.per_prompt_head(2).reset_index(drop=True))
    resaved = es.Result.load(loaded.save(tmp_path / "again"))  # a loaded result saves again
    pd.testing.assert_frame_equal(resaved.per_prompt, result.per_prompt)
    assert resaved.takeaway == result.takeaway


def test_a_reports_section_folders_load(demo, tmp_path):
    from entoscope.report.section import examples_html

    section = tmp_path / "report" / "patching"
    examples = [("heads", {"sites": {"activation": "z", "over": ["layer", "head"]}}, {"task": "ioi", "n": 4}),
                ("mlps", {"sites": {"activation": "mlp_out", "over": ["layer"]}}, {"task": "ioi", "n": 4})]
    _, results = examples_html(es.Patching, demo, examples, section, max_rows=4)
    for folder, result in ((section, results[0]), (section / "example1", results[1])):
        loaded = es.Result.load(folder)
        pd.testing.assert_frame_equal(loaded.table, result.table)
        assert loaded.takeaway == result.takeaway


def _saved(demo, tmp_path):
    r = es.DirectLogitAttribution().run(demo, {"task": "ioi", "n": 4}, quiet=True)
    return r.save(tmp_path / "run")


def _refused(folder) -> EntoscopeError:
    with pytest.raises(EntoscopeError) as err:
        es.Result.load(folder)
    return err.value


def test_a_folder_that_is_not_a_complete_run_is_refused_naming_the_file(demo, tmp_path):
    folder = _saved(demo, tmp_path)
    manifest = folder / "manifest.json"
    good = manifest.read_text()

    err = _refused(tmp_path / "nowhere")
    assert err.code == "not_a_run" and "nowhere" in err.message and err.remedy
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    err = _refused(tmp_path / "plain")
    assert err.code == "not_a_run" and "manifest.json" in err.message

    edited = json.loads(good)
    del edited["takeaway"], edited["files"]
    manifest.write_text(json.dumps(edited))
    err = _refused(folder)
    assert err.code == "manifest_invalid" and str(manifest) in err.message
    assert "takeaway" in err.message and "files" in err.message

    manifest.write_text(good[: len(good) // 2])  # cut short
    err = _refused(folder)
    assert err.code == "manifest_invalid" and str(manifest) in err.message

    manifest.write_text(json.dumps({**json.loads(good), "format_version": 99}))
    assert _refused(folder).code == "manifest_too_new"

    manifest.write_text(json.dumps({**json.loads(good), "operation": "report"}))
    assert _refused(folder).code == "manifest_is_report"

    manifest.write_text(good)
    (folder / "table.parquet").unlink()
    err = _refused(folder)
    assert err.code == "run_file_missing" and str(folder / "table.parquet") in err.message
    shutil.copy(folder / "table.csv", folder / "table.parquet")  # not Parquet
    err = _refused(folder)
    assert err.code == "run_file_missing" and "table.parquet" in err.message


def test_the_command_line_prints_the_takeaway_after_the_table(tmp_path, capsys):
    assert main(["dla", "--model", "demo", "--data", "{task: ioi, n: 4}", "--out", str(tmp_path / "run"),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    takeaway = es.Result.load(tmp_path / "run").takeaway
    assert f"takeaway: {takeaway}" in out
    assert out.index("component") < out.index("takeaway:")  # after the table
