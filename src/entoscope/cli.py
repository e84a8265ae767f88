"""The `entoscope` command.

    entoscope info   --model demo                       structure and task scores
    entoscope report --model demo --out runs/demo       the main job: an offline HTML report
    entoscope run experiments.yaml ENTRY --model demo --out runs/
    entoscope run runs/x/manifest.json                  repeat a saved run
    entoscope lens --data '{task: ioi, n: 8}' --sites '{activation: resid_post, over: [layer, position]}'
    entoscope train-lens --model demo --data '{task: ioi, n: 256}' --out lenses/demo
    entoscope train-sae --model demo --site resid_post.1 --out sae/resid_post.1   (docs/features.md)

Every operation sub-command takes each config key as --key VALUE (VALUE is read as YAML, so lists
and mappings work) plus the model options; `--plan` prints the plan and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, EntoscopeError
from .registry import lookup, names

CLI_NAMES = {"lens": "lens", "parameter-lens": "parameter_lens", "head-scores": "head_scores", "patch": "patching", "probe": "probing",
             "circuit": "circuits", "dla": "dla", "ifr": "ifr"}


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="demo", help="'demo', a local HuggingFace folder, or a hub name")
    g.add_argument("--backend", choices=["bridge", "hooked"], default="bridge",
                   help="TransformerBridge (HuggingFace's weights) or HookedTransformer (transformer-lens < 4)")
    g.add_argument("--compat", action="store_true", help="bridge in compatibility mode (LayerNorm folded)")
    g.add_argument("--device", default=None, help="torch device (default: cpu)")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--cache-dir", default=None, help="wrap the model in CachedModel with this directory")


def _load(args: argparse.Namespace, source: dict[str, Any] | None = None) -> Any:
    from .models.loading import load_model

    name, backend, compat = args.model, args.backend, args.compat
    if source and not getattr(args, "model_given", False):
        name, backend, compat = source["name"], source["backend"], source["compat"]
    model = load_model(name, backend=backend, compat=compat, device=args.device, dtype=args.dtype)
    if args.cache_dir:
        from .models.cached import CachedModel

        model = CachedModel(model, cache_dir=args.cache_dir)
    return model


def _yaml_value(text: str, key: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--{key}: {text!r} is not valid YAML ({err})", code="config_invalid",
                          remedy="quote mappings, e.g. --sites '{activation: resid_pre, over: [layer]}'") from None


def _data_arg(text: str | None) -> Any:
    if text is None:
        return None
    value = _yaml_value(text, "data")
    if isinstance(value, str) and not Path(value).exists() and value.replace("_", "").isalpha():
        return {"task": value}  # `--data ioi`
    if isinstance(value, str) and Path(value).exists():
        return {"path": value}
    return value


def _op_parser(sub: Any, cli_name: str, op_name: str) -> None:
    cls = lookup("operation", op_name)
    doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else op_name
    p = sub.add_parser(cli_name, help=doc, description=cls.__doc__)
    _model_options(p)
    p.add_argument("--data", default=None, help="a task name, a file, or YAML: '{task: ioi, n: 16}'")
    p.add_argument("--out", default=None, help="save the result into this folder")
    p.add_argument("--plan", action="store_true", help="print the plan and run nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group(f"{op_name} config (values are YAML)")
    for field, info in cls.model_fields.items():
        g.add_argument(f"--{field.replace('_', '-')}", dest=f"cfg_{field}", default=None,
                       help=(info.description or "") + f" [default: {info.get_default(call_default_factory=True)!r}]")
    p.set_defaults(handler=_run_op, op_name=op_name)


def _run_op(args: argparse.Namespace) -> int:
    from .config import build_operation

    entry: dict[str, Any] = {"operation": args.op_name}
    for key, value in vars(args).items():
        if key.startswith("cfg_") and value is not None:
            entry[key[4:]] = _yaml_value(value, key[4:].replace("_", "-"))
    data = _data_arg(args.data)
    if data is not None:
        entry["data"] = data
    op, spec = build_operation(entry, where=args.op_name)
    return _execute(op, spec, args, args.out)


def _execute(op: Any, spec: Any, args: argparse.Namespace, out: str | None, records: Any = None,
             source: dict[str, Any] | None = None) -> int:
    model = _load(args, source)
    data = records if records is not None else spec
    if args.plan:
        print(op.plan(model, data))
        return 0
    result = op.run(model, data, quiet=args.quiet)
    print(result.table.to_string(max_rows=30, max_cols=12))
    if out:
        folder = result.save(out)
        print(f"saved: {folder}/index.html")
    return 0


def _run_file(args: argparse.Namespace) -> int:
    from .config import build_operation, load_experiments

    path = Path(args.file)
    if path.suffix == ".json":
        manifest = json.loads(path.read_text())
        if "config" not in manifest or "operation" not in manifest:
            raise ConfigError(f"{path} is not an entoscope manifest", code="config_invalid",
                              remedy="give manifest.json from a saved run, or a YAML experiment file")
        op, _ = build_operation({"operation": manifest["operation"], **manifest["config"]}, where=str(path))
        records = None
        if manifest.get("data"):
            from .data.examples import Dataset

            d = manifest["data"]
            records = Dataset.from_records(d["name"], d["records"], params=d.get("spec", {}))
        out = args.out
        return _execute(op, None, args, out, records=records, source=manifest.get("model", {}).get("source"))
    entries = load_experiments(path)
    chosen = args.entries or list(entries)
    for name in chosen:
        if name not in entries:
            raise ConfigError(f"{path} has no entry {name!r}", code="unknown_entry",
                              remedy=f"entries: {', '.join(entries)}")
    for name in chosen:
        op, spec = build_operation(entries[name], where=name)
        print(f"== {name}")
        _execute(op, spec, args, str(Path(args.out) / name) if args.out else None)
    return 0


def _info(args: argparse.Namespace) -> int:
    from .evaluate import format_scores, task_scores
    from .models.adapter import adapt

    model = _load(args)
    print(adapt(model).structure.describe())
    print()
    print(format_scores(task_scores(model, n=args.n)))
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import build_report

    page = build_report(_load(args), args.out, quick=args.quick)
    print(f"report: {page}")
    return 0


def _train_lens(args: argparse.Namespace) -> int:
    from .data.loading import load_data
    from .lens import TunedLens

    model = _load(args)
    data = load_data(_data_arg(args.data), tokenizer=getattr(model, "tokenizer", None))
    lens = TunedLens.for_model(model)
    losses = lens.fit(model, data, steps=args.steps, lr=args.lr, quiet=args.quiet)
    lens.save(args.out)
    print(f"trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {args.out}")
    return 0


def _train_sae(args: argparse.Namespace) -> int:
    from .dictionaries import command

    return command.run(args, _load(args), _data_arg(args.data))


def build_parser() -> argparse.ArgumentParser:
    from . import circuits, lens, patching, probing  # noqa: F401  (register the operations)

    p = argparse.ArgumentParser(prog="entoscope", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("info", help="print a model's structure and its built-in task scores")
    _model_options(q)
    q.add_argument("--n", type=int, default=64, help="prompts per task")
    q.set_defaults(handler=_info)
    q = sub.add_parser("report", help="write an offline HTML report about a model (the main job)")
    _model_options(q)
    q.add_argument("--out", default="runs/report", help="folder of the report")
    q.add_argument("--quick", action="store_true", help="fewer prompts per section")
    q.set_defaults(handler=_report)
    q = sub.add_parser("run", help="run entries of a YAML experiment file, or repeat a saved manifest.json")
    q.add_argument("file")
    q.add_argument("entries", nargs="*", help="entry names (default: all)")
    _model_options(q)
    q.add_argument("--out", default=None, help="folder for results (one sub-folder per entry)")
    q.add_argument("--plan", action="store_true")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(handler=_run_file)
    q = sub.add_parser("train-lens", help="train tuned-lens translators and save them")
    _model_options(q)
    q.add_argument("--data", required=True, help="a task name, a file, or YAML")
    q.add_argument("--steps", type=int, default=300)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--out", required=True)
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(handler=_train_lens)
    from .dictionaries import command as sae_command

    q = sub.add_parser("train-sae", help="train a sparse autoencoder or transcoder and save it (SAELens format)",
                       description=sae_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(q)
    sae_command.add_options(q)
    q.set_defaults(handler=_train_sae)
    for cli_name, op_name in CLI_NAMES.items():
        if op_name in names("operation"):
            _op_parser(sub, cli_name, op_name)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.model_given = any(a == "--model" or a.startswith("--model=") for a in argv)
    if os.environ.get("ENTOSCOPE_DEBUG") == "1":
        return int(args.handler(args) or 0)
    try:
        return int(args.handler(args) or 0)
    except EntoscopeError as err:
        print(f"entoscope: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
