"""`entoscope run runs/x/manifest.json`: repeat a saved run, on the same model, and say how it compares.

Refused before any work: a file that is not a manifest (or one edited by hand so that what a re-run
reads no longer holds: records without a prompt, a count that disagrees with them, a load source
without a backend; `manifest_invalid`, naming the field), a manifest of a newer format, a run whose
model has no load source (built in Python) unless `--model` names one, and a model whose weights
differ from the recorded fingerprint unless `--allow-model-change` (then a recorded warning). The
repeat is saved (into `--out`, or a new sibling folder `<run>-rerun-N`), and the new table is
compared with the saved one: the largest absolute difference over the numeric columns.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .errors import ConfigError, DataError, warn


def read_manifest(path: Path) -> dict[str, Any]:
    """A run's manifest.json, checked for shape and format version."""
    from .results.manifest import FORMAT_VERSION

    file = path / "manifest.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no manifest at {file}", code="config_file_missing",
                          remedy="give the manifest.json of a saved run (or the run's folder)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file} is not valid JSON ({err})", code="manifest_invalid",
                          remedy="give the manifest.json an entoscope run wrote, unedited") from None
    if isinstance(manifest, dict) and manifest.get("operation") == "report":
        raise ConfigError(f"{file} is the manifest of a report, which is not re-run from its manifest",
                          code="manifest_is_report", remedy="run `entoscope report --model ... --out ...` again")
    if not isinstance(manifest, dict) or not {"operation", "config"} <= set(manifest):
        raise ConfigError(f"{file} is not an entoscope manifest (no operation and config)", code="manifest_invalid",
                          remedy="give manifest.json from a saved run, or a YAML experiment file")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ConfigError(f"{file} has no format_version", code="manifest_invalid",
                          remedy="give the manifest.json an entoscope run wrote, unedited")
    if version > FORMAT_VERSION:
        raise ConfigError(f"{file} was written in manifest format {version}; this entoscope reads up to format "
                          f"{FORMAT_VERSION}", code="manifest_too_new",
                          remedy="upgrade entoscope (pip install -U entoscope) to re-run it")
    problem = manifest_problem(manifest)
    if problem:
        raise ConfigError(f"{file}: {problem}", code="manifest_invalid",
                          remedy="give the manifest.json an entoscope run wrote, unedited (or repair that field)")
    return manifest


def manifest_problem(manifest: dict[str, Any]) -> str:
    """What is wrong with the parts of a manifest a re-run reads ('' if nothing): the operation and
    config, the data's records, the model's load source and fingerprint."""
    if not isinstance(manifest["operation"], str) or not isinstance(manifest["config"], dict):
        return "operation must be a name and config a mapping"
    data = manifest.get("data")
    if data is not None:
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            return "data has no list of records (data.records)"
        if not isinstance(data.get("name"), str) or not isinstance(data.get("spec", {}), dict):
            return "data.name must be text and data.spec a mapping"
        bad = next((i for i, r in enumerate(data["records"]) if not isinstance(r, dict) or "prompt" not in r), None)
        if bad is not None:
            return f"data.records[{bad}] is not a record with a prompt"
        n = data.get("n")
        if n is not None and n != len(data["records"]):
            return f"data.n is {n!r} but data.records holds {len(data['records'])} records"
    model = manifest.get("model")
    if model is not None and not isinstance(model, dict):
        return "model must be a mapping"
    model = model or {}
    source, fingerprint = model.get("source"), model.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        return "model.fingerprint must be text"
    if source is not None:
        ok = isinstance(source, dict) and isinstance(source.get("name"), str) and \
            source.get("backend") in ("bridge", "hooked", "nnsight") and isinstance(source.get("compat"), bool)
        if not ok:
            return "model.source must give the model's name, backend (bridge, hooked or nnsight) and compat"
    return ""


def _destination(run_folder: Path) -> Path:
    n = 1
    while (run_folder.parent / f"{run_folder.name}-rerun-{n}").exists():
        n += 1
    return run_folder.parent / f"{run_folder.name}-rerun-{n}"


def rerun_manifest(path: Path, args: argparse.Namespace, execute: Callable[..., Any],
                   load: Callable[..., Any]) -> int:
    from .config import build_operation
    from .data.examples import Dataset
    from .models.fingerprint import model_fingerprint
    from .results.folder import check_out

    manifest = read_manifest(path)
    run_folder = path if path.is_dir() else path.parent
    op, _ = build_operation({"operation": manifest["operation"], **manifest["config"]}, where=str(path))
    records = None
    if manifest.get("data"):
        d = manifest["data"]
        try:
            records = Dataset.from_records(d["name"], d["records"], params=d.get("spec", {}))
        except (DataError, TypeError, ValueError) as err:
            raise ConfigError(f"{path}: data.records: {getattr(err, 'message', err)}", code="manifest_invalid",
                              remedy="give the manifest.json an entoscope run wrote, unedited (or repair that "
                              "record)") from None
    recorded = manifest.get("model") or {}
    source = recorded.get("source")
    if source is None and not args.model_given:
        raise ConfigError(f"the run in {run_folder} used a model built in Python: the manifest records no way to "
                          "load it again", code="manifest_no_model_source",
                          remedy="pass --model (a folder or hub name) to re-run it on that model")
    out = args.out or (None if args.plan else str(_destination(run_folder)))
    if out and not args.plan:
        check_out(out, overwrite=args.overwrite, resume=bool(getattr(args, "resume", False)))
    model = load(args, source)
    now, then = model_fingerprint(model), recorded.get("fingerprint")
    warned: list[dict[str, str]] = []
    if then and now != then:
        what = (f"the model's weights differ from the run's (fingerprint {now[:12]} now, {then[:12]} recorded): the "
                "folder's contents changed, or another model was named")
        if not args.allow_model_change:
            raise ConfigError(what, code="model_changed",
                              remedy="pass --allow-model-change to re-run on this model anyway (the new manifest "
                              "records its fingerprint)")
        warned.append({"code": "model_changed", "message": what + "; re-run anyway (--allow-model-change)"})
        warn(warned[-1]["message"], code="model_changed")
    result = execute(op, None, args, out, records=records, model=model, warned=warned)
    if result is not None:
        print(compare_tables(result.table, run_folder))
    return 0


def compare_tables(new: pd.DataFrame, run_folder: Path) -> str:
    """One line: how the re-run's table compares with the table saved in `run_folder`."""
    saved = run_folder / "table.parquet"
    if not saved.exists():
        return f"no saved table in {run_folder} to compare with"
    old = pd.read_parquet(saved)
    if len(old) != len(new):
        return f"compared with the saved table: {len(new)} rows now, {len(old)} saved (the runs differ in shape)"
    cols = [c for c in new.columns if c in old.columns and pd.api.types.is_numeric_dtype(new[c])
            and pd.api.types.is_numeric_dtype(old[c]) and not pd.api.types.is_bool_dtype(new[c])]
    if not cols:
        return "compared with the saved table: no numeric column in common"
    a = new[cols].to_numpy(dtype=float, na_value=np.nan)
    b = old[cols].to_numpy(dtype=float, na_value=np.nan)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    worst = np.nanmax(np.where(np.isnan(diff), np.inf, diff), axis=0)
    i = int(np.argmax(worst))
    return (f"compared with the saved table: max |difference| {worst[i]:.3g} (column {cols[i]}) over {len(new)} rows "
            f"and {len(cols)} numeric columns")
