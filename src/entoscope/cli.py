"""The `entoscope` command.

    entoscope info   --model demo                       structure and task scores
    entoscope report --model demo --out runs/demo       the main job: an offline HTML report
    entoscope run experiments.yaml ENTRY --model demo --out runs/
    entoscope run runs/x/manifest.json                  repeat a saved run
    entoscope lens --data '{task: ioi, n: 8}' --sites '{activation: resid_post, over: [layer, position]}'
    entoscope train-lens --model demo --data '{task: ioi, n: 256}' --out lenses/demo
    entoscope train-sae --model demo --site resid_post.1 --out sae/resid_post.1   (docs/features.md)
    entoscope patch --data '{task: ioi, n: 1000}' --executor ray --workers 4 --out runs/p [--resume]

Every operation sub-command takes each config key as --key VALUE (VALUE is read as YAML, so lists
and mappings work) plus the model options; `--plan` prints the plan and runs nothing.
Errors are one line, `entoscope: error: [code] what. Remedy: what to do` (exit 2; 130 on Ctrl-C);
`--debug` (anywhere on the line) also prints the traceback.
"""
# Help and --version are printed from cli_snapshot.json (the parser below, written down), so they import
# nothing heavy; this module itself imports only the standard library, errors.py and registry.py.

from __future__ import annotations

import argparse
import os
import sys
import traceback
import typing
import warnings
from pathlib import Path
from typing import Any

from .errors import ConfigError, EntoscopeError, EntoscopeWarning
from .heap import give_back_memory
from .registry import lookup, names

CLI_NAMES = {"lens": "lens", "parameter-lens": "parameter_lens", "head-scores": "head_scores", "patch": "patching", "probe": "probing",
             "circuit": "circuits", "dla": "dla", "ifr": "ifr", "steer": "steering",
             "interchange": "interchange", "lens-comparison": "lens_comparison",
             "coordinate-patch": "coordinate_patching", "inspect": "inspect"}

SAVED: list[str] = []  # folders this process has saved (named when Ctrl-C interrupts it)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are entoscope errors (one line, a code, a remedy)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.prog}: {message}", code="bad_arguments",
                          remedy=f"`{self.prog} --help` lists the options")


def _help(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="demo", metavar="NAME",
                   help="'demo', a local HuggingFace folder, a .gguf file, or a hub name")
    g.add_argument("--backend", choices=["bridge", "hooked", "nnsight"], default="bridge",
                   help="TransformerBridge (HuggingFace's weights), HookedTransformer (transformer-lens < 4), or an "
                   "nnsight LanguageModel (HuggingFace's weights, traced by nnsight; pip install 'entoscope[nnsight]')")
    g.add_argument("--compat", action="store_true", help="bridge in compatibility mode (LayerNorm folded)")
    g.add_argument("--device", default=None, metavar="DEVICE", help="torch device: cpu, cuda, cuda:N, mps (default: cpu)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="the dtype the weights are loaded in and the model runs in")
    g.add_argument("--device-map", default=None, metavar="YAML", help="HuggingFace device_map for a model larger than "
                   "one device: auto, balanced, or '{module: device}' (needs accelerate; not with --device)")
    g.add_argument("--cache-dir", default=None, metavar="DIR", help="wrap the model in CachedModel with this directory")


def _executor_options(p: argparse.ArgumentParser) -> None:
    """--executor, --resume and one flag per field of es.Ray (generated like the operations' flags)."""
    from .executors.config import NAMES, Ray

    g = p.add_argument_group("executor (docs/scale.md)")
    g.add_argument("--executor", default=None, choices=list(NAMES), help="where the shards of prompts run "
                   "[default: in_process; a YAML entry's executor: is used when given]")
    for field, info in Ray.model_fields.items():
        if field == "type":
            continue
        default = info.get_default(call_default_factory=True)
        g.add_argument(f"--{field.replace('_', '-')}", dest=f"ex_{field}", default=None,
                       metavar="SIZE" if field == "memory" else _metavar(info.annotation),
                       help=_help((info.description or "") + f" (Ray) [default: {default!r}]"))
    g.add_argument("--resume", action="store_true", help="skip the shards already saved in --out (OUT/shards) by an "
                   "interrupted run of the same command")


def _executor(args: argparse.Namespace, entry: dict[str, Any] | None = None, where: str = "executor") -> Any:
    from .config import executor_of

    raw = ("ex_address", "ex_factory")  # host:port and module:function are taken as written, not as YAML
    overrides = {k[3:]: v if k in raw else _yaml_value(v, k[3:].replace("_", "-")) for k, v in vars(args).items()
                 if k.startswith("ex_") and v is not None}
    if getattr(args, "executor", None):
        overrides["type"] = args.executor
    elif overrides and not (entry or {}).get("executor"):
        overrides["type"] = "ray"  # --workers 4 alone means Ray
    if overrides.get("type") == "in_process" and len(overrides) > 1:
        raise ConfigError(f"--{next(k for k in overrides if k != 'type').replace('_', '-')} is a Ray option",
                          code="bad_arguments", remedy="add --executor ray, or drop the Ray options")
    return executor_of(entry or {}, where, overrides)


def _load(args: argparse.Namespace, source: dict[str, Any] | None = None) -> Any:
    from .models.loading import load_model

    name, backend, compat = args.model, args.backend, args.compat
    if source and not getattr(args, "model_given", False):
        name, backend, compat = source["name"], source["backend"], source["compat"]
    device_map = _yaml_value(args.device_map, "device-map") if getattr(args, "device_map", None) else None
    model = load_model(name, backend=backend, compat=compat, device=args.device, dtype=args.dtype,
                       device_map=device_map)
    if args.cache_dir:
        from .models.cached import CachedModel

        model = CachedModel(model, cache_dir=args.cache_dir)
    return model


def _yaml_value(text: str, key: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--{key}: {text!r} is not valid YAML ({' '.join(str(err).split())})", code="config_invalid",
                          remedy="quote mappings, e.g. --sites '{activation: resid_pre, over: [layer]}'") from None


def _data_arg(text: str | None) -> Any:
    if text is None:
        return None
    value = _yaml_value(text, "data")
    if isinstance(value, str) and not Path(value).exists() and value.replace("_", "").replace("-", "").isalpha():
        return {"task": value}  # `--data ioi`
    if isinstance(value, str) and Path(value).exists():
        return {"path": value}
    return value


def _metavar(annotation: Any) -> str:
    """A placeholder that says what a config key takes: N, FLOAT, BOOL, {a,b}, YAML, TEXT."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    if origin is not None and len(args) == 1 and origin is not list and origin is not dict:
        return _metavar(args[0])
    return {int: "N", float: "FLOAT", bool: "BOOL", str: "TEXT"}.get(annotation, "YAML")


def _op_parser(sub: Any, cli_name: str, op_name: str) -> None:
    from .config_model import own_doc

    cls = lookup("operation", op_name)
    doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else op_name
    p = sub.add_parser(cli_name, help=_help(doc), description=_help(own_doc(cls)),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(p)
    p.add_argument("--data", default=None, metavar="DATA", help="a task name, a file, or YAML: '{task: ioi, n: 16}'")
    p.add_argument("--out", default=None, metavar="DIR", help="save the result into this folder")
    p.add_argument("--overwrite", action="store_true", help="replace a run already saved in --out")
    p.add_argument("--plan", action="store_true", help="print the plan (passes, batches, peak memory, and the time estimated from one calibration forward) and run nothing else")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _executor_options(p)
    g = p.add_argument_group(f"{op_name} config (values are YAML)")
    text = getattr(cls, "text_fields", ())
    for field, info in cls.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if hasattr(default, "model_dump"):
            default = default.model_dump(exclude_defaults=True) or default.model_dump()
        said = " [required]" if info.is_required() else f" [default: {default!r}]"
        g.add_argument(f"--{field.replace('_', '-')}", dest=f"cfg_{field}", default=None,
                       metavar="SIZE" if field == "memory" else "TEXT" if field in text else _metavar(info.annotation),
                       help=_help((info.description or "") + (" (taken as written, not as YAML)" if field in text
                                                              else "") + said))
    p.set_defaults(handler=_run_op, op_name=op_name)


def _run_op(args: argparse.Namespace) -> int:
    from .config import build_operation

    entry: dict[str, Any] = {"operation": args.op_name}
    text = getattr(lookup("operation", args.op_name), "text_fields", ())  # taken as written (' Paris'), not as YAML
    for key, value in vars(args).items():
        if key.startswith("cfg_") and value is not None:
            entry[key[4:]] = value if key[4:] in text else _yaml_value(value, key[4:].replace("_", "-"))
    data = _data_arg(args.data)
    if data is not None:
        entry["data"] = data
    op, spec = build_operation(entry, where=args.op_name)
    _execute(op, spec, args, args.out, executor=_executor(args))
    return 0


def _execute(op: Any, spec: Any, args: argparse.Namespace, out: str | None, records: Any = None,
             source: dict[str, Any] | None = None, model: Any = None,
             warned: list[dict[str, str]] | None = None, executor: Any = None) -> Any:
    """Check the destination, load the model, then plan or run (and save). Returns the Result (or None)."""
    from .results.folder import check_out

    resume = bool(getattr(args, "resume", False))
    if executor is None and hasattr(args, "executor"):
        executor = _executor(args)
    if resume and not out:
        raise ConfigError("--resume needs --out: the interrupted run's shards are in OUT/shards",
                          code="resume_needs_folder", remedy="pass the same --out as the interrupted run")
    if out and not args.plan:
        check_out(out, overwrite=args.overwrite, resume=resume)  # before the model loads: nothing computed in vain
    if getattr(executor, "type", None) == "ray" and not args.plan:
        from .executors.ray_cluster import check_reachable

        check_reachable(executor)  # a cluster that does not answer: refused before the model loads
    shards_dir = _shards_dir(op, out, executor, resume, args)
    if model is None:
        _check_before_load(op, spec if records is None else None)
        model = _load(args, source)
    data = records if records is not None else spec
    if args.plan:  # the plan, and its time from one calibration forward
        print(op.calibrate(model, data, executor=executor))
        return None
    result = op.run(model, data, executor=executor, quiet=args.quiet, shards_dir=shards_dir, resume=resume)
    if warned:  # warnings raised before the run (re-running a manifest) belong in its record too
        result.warnings[:0] = warned
        result.manifest["warnings"] = result.warnings
    print(result.table.to_string(max_rows=30, max_cols=12))
    if result.takeaway:  # what the table shows, in the words the page leads with
        print(f"\ntakeaway: {result.takeaway}")
    if out:
        folder = result.save(out, overwrite=args.overwrite)
        SAVED.append(str(folder))
        print(f"saved: {folder}/index.html")
    return result


def _check_before_load(op: Any, spec: Any) -> None:
    """What a run's config can be refused for without the model: its data (the task exists and takes these
    parameters, the data file exists and parses) and its metrics' names and parameters."""
    from .data.loading import DataSpec, read_records
    from .metrics import Metric

    if isinstance(spec, DataSpec):
        spec.check()
        if spec.path is not None:
            read_records(spec.path)  # a file that does not parse is refused here, not after a model load
    for name in getattr(type(op), "model_fields", {}):
        value = getattr(op, name, None)
        if isinstance(value, Metric):
            value.function()


def _shards_dir(op: Any, out: str | None, executor: Any, resume: bool, args: argparse.Namespace) -> Path | None:
    """OUT/shards for a sharded run that writes shards (Ray, or --resume); an old run's are cleared on --overwrite."""
    import shutil

    from .results.folder import SHARDS

    if not out or args.plan or op.not_sharded_reason():
        return None
    if not resume and getattr(executor, "type", "in_process") == "in_process":
        return None
    folder = Path(out) / SHARDS
    if args.overwrite and not resume and folder.is_dir():
        shutil.rmtree(folder)
    return folder


def _run_file(args: argparse.Namespace) -> int:
    from .config import build_operation, load_experiments

    path = Path(args.file)
    if path.suffix == ".json" or path.is_dir():
        from .rerun import rerun_manifest

        return rerun_manifest(path, args, _execute, _load)
    entries = load_experiments(path)
    chosen = args.entries or list(entries)
    for name in chosen:
        if name not in entries:
            raise ConfigError(f"{path} has no entry {name!r}", code="unknown_entry",
                              remedy=f"entries: {', '.join(entries)}")
    built = [(name, *build_operation(entries[name], where=name), _executor(args, entries[name], f"{name}.executor"))
             for name in chosen]  # every entry checked first
    failed: list[tuple[str, str]] = []
    for name, op, spec, executor in built:
        print(f"== {name}")
        try:
            _execute(op, spec, args, str(Path(args.out) / name) if args.out else None, executor=executor)
        except Exception as err:  # noqa: BLE001 - one entry's failure keeps the others (Ctrl-C still stops all)
            if len(built) == 1:
                raise
            code = err.code if isinstance(err, EntoscopeError) else "internal_error"
            text = err.one_line() if isinstance(err, EntoscopeError) else f"{type(err).__name__}: {err}"
            print(f"entoscope: error: entry {name}: {' '.join(text.split())[:400]}", file=sys.stderr)
            failed.append((name, code))
        give_back_memory()  # the next entry's peak does not sit on this one's freed heap
    if failed:
        done = [name for name, *_ in built if name not in dict(failed)]
        raise EntoscopeError(f"{len(failed)} of {len(built)} entries failed: "
                             + ", ".join(f"{n} ({c})" for n, c in failed)
                             + (f"; done: {', '.join(done)}" if done else ""), code="entries_failed",
                             remedy="read each failed entry's error line above; run it alone with "
                             f"`entoscope run {path} ENTRY` once fixed")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .evaluate import format_scores, task_scores
    from .models.adapter import adapt

    if args.n < 1:
        raise ConfigError(f"--n must be at least 1, got {args.n}", code="bad_arguments", remedy="e.g. --n 64")
    model = _load(args)
    print(adapt(model).structure.describe())
    print()
    print(format_scores(task_scores(model, n=args.n)))
    return 0


def _report(args: argparse.Namespace) -> int:
    import json

    from .report import build_report
    from .results.folder import check_out

    from .memory import parse_size

    check_out(args.out, overwrite=args.overwrite)
    parse_size(args.memory, "--memory")  # refused before the model loads
    page = build_report(_load(args), args.out, quick=args.quick, overwrite=args.overwrite, resume=args.resume,
                        memory=args.memory)
    SAVED.append(str(Path(args.out)))
    print(f"report: {page}")
    failed = [n for n in json.loads((Path(args.out) / "manifest.json").read_text())["not_run"] if n["status"] == "failed"]
    if failed:  # the other sections are written; the exit status says the report is not whole
        raise EntoscopeError(f"{len(failed)} section(s) failed while they ran: {', '.join(n['section'] for n in failed)} "
                             f"(the others are written in {args.out})", code="report_sections_failed",
                             remedy="read the failed sections' pages (or the index's 'sections not run') for each error")
    return 0


def _train_lens(args: argparse.Namespace) -> int:
    from .data.loading import DataSpec, load_data
    from .lens import TunedLens
    from .results.folder import JACOBIAN_LENS, TUNED_LENS, check_out, writing_run

    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}", code="bad_steps",
                          remedy="train for at least one step, e.g. --steps 300")
    if not 0 < args.lr < float("inf"):
        raise ConfigError(f"--lr must be a finite number > 0, got {args.lr}", code="bad_lr", remedy="e.g. --lr 1e-3")
    output = JACOBIAN_LENS if args.method == "jacobian" else TUNED_LENS
    check_out(args.out, overwrite=args.overwrite, output=output)
    data_arg = _data_arg(args.data)
    if isinstance(data_arg, dict):
        _check_before_load(None, DataSpec(**data_arg))
    model = _load(args)
    data = load_data(data_arg, tokenizer=getattr(model, "tokenizer", None))
    if args.method == "jacobian":  # the sharded fit (--executor ray runs its shards on workers)
        from .lens import JacobianLens

        jl = JacobianLens.fit(model, data, skip_first=args.skip_first, max_length=args.max_length,
                              corpus=args.corpus, quiet=args.quiet, executor=_executor(args))
        with writing_run(args.out, overwrite=args.overwrite, output=output) as partial:
            jl.save(partial)
        SAVED.append(args.out)
        print(jl.fit_result.takeaway + f" Saved {args.out}")
        return 0
    lens = TunedLens.for_model(model)
    losses = lens.fit(model, data, steps=args.steps, lr=args.lr, quiet=args.quiet, executor=_executor(args))
    with writing_run(args.out, overwrite=args.overwrite, output=TUNED_LENS) as partial:
        lens.save(partial)
    SAVED.append(args.out)
    print(f"trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {args.out}")
    return 0


def _version() -> str:
    from . import __version__
    from .versions import installed_version

    parts = []
    for pkg in ("transformer-lens", "torch", "transformers"):
        version = installed_version(pkg)
        parts.append(f"{pkg} {version}" if version else f"{pkg} not installed")
    return f"entoscope {__version__} ({', '.join(parts)})"


def _train_sae(args: argparse.Namespace) -> int:
    from .dictionaries import command

    command.check_args(args)  # before the model loads
    return command.run(args, _load(args), _data_arg(args.data))


def build_parser() -> argparse.ArgumentParser:
    """The real parser: every sub-command, with one flag per field of each operation (imports them all)."""
    p = _Parser(prog="entoscope", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (anywhere on the line)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    q = sub.add_parser("info", help="print a model's structure and its built-in task scores")
    _model_options(q)
    q.add_argument("--n", type=int, default=64, metavar="N", help="prompts per task")
    q.set_defaults(handler=_info)
    q = sub.add_parser("report", help="write an offline HTML report about a model (the main job)")
    _model_options(q)
    q.add_argument("--out", default="runs/report", metavar="DIR", help="folder of the report")
    q.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    q.add_argument("--quick", action="store_true", help="fewer prompts per section")
    q.add_argument("--resume", action="store_true",
                   help="go on with the interrupted report into --out: the sections it finished are reused (their "
                   "files checked first); refused if it was made with other settings (the same command without "
                   "--resume also reuses them, but replaces an interrupted report of other settings)")
    q.add_argument("--memory", default="auto", metavar="SIZE",
                   help="memory each section may take above the loaded model (12GB, 512MiB; auto: 90%% of what the "
                   "model's device has free); a section that cannot fit is skipped before its first forward")
    q.set_defaults(handler=_report)
    q = sub.add_parser("run", help="run entries of a YAML experiment file, or repeat a saved manifest.json")
    q.add_argument("file", metavar="FILE", help="a YAML experiment file, or a saved run's manifest.json (or its folder)")
    q.add_argument("entries", nargs="*", metavar="ENTRY", help="entry names (default: all)")
    _model_options(q)
    q.add_argument("--out", default=None, metavar="DIR", help="folder for results (one sub-folder per entry)")
    q.add_argument("--overwrite", action="store_true", help="replace runs already saved there")
    q.add_argument("--allow-model-change", action="store_true",
                   help="re-run a manifest although the model's weights differ from the recorded fingerprint")
    q.add_argument("--plan", action="store_true", help="print the plan (passes, batches, peak memory, and the time estimated from one calibration forward) and run nothing else")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    _executor_options(q)
    q.set_defaults(handler=_run_file)
    q = sub.add_parser("train-lens", help="train tuned-lens translators (or fit a Jacobian lens) and save them")
    _model_options(q)
    q.add_argument("--method", choices=("tuned", "jacobian"), default="tuned",
                   help="tuned: translators (Belrose et al. 2023); jacobian: the Jacobian lens (Gurnee et al. 2026)")
    q.add_argument("--skip-first", type=int, default=16, metavar="N",
                   help="jacobian: leading positions left out of the average")
    q.add_argument("--max-length", type=int, default=128, metavar="N", help="jacobian: prompts cut to N tokens")
    q.add_argument("--corpus", default=None, metavar="NAME",
                   help="jacobian: the corpus name the lens records (lenses fitted on parts of one corpus merge only "
                   "when their names agree); default the data's name")
    q.add_argument("--data", required=True, metavar="DATA", help="a task name, a file, or YAML")
    q.add_argument("--steps", type=int, default=300, metavar="N", help="optimiser steps (>= 1)")
    q.add_argument("--lr", type=float, default=1e-3, metavar="FLOAT", help="Adam learning rate")
    q.add_argument("--out", required=True, metavar="DIR", help="folder for the translators")
    q.add_argument("--overwrite", action="store_true", help="replace a tuned lens already saved in --out")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    _executor_options(q)  # where the training data is collected (--resume has no effect here)
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


def help_parser() -> argparse.ArgumentParser:
    """The parser that prints help and the version, and refuses a usage mistake (an unknown option, a missing
    value) at once: build_parser()'s, rebuilt from cli_snapshot.json. A command line it accepts is parsed
    again by build_parser(), which imports every operation."""
    from .cli_snapshot import load, parser_from_snapshot

    return parser_from_snapshot(load(), prog="entoscope", version=_version(), parser_class=_Parser)


def _only_help(argv: list[str]) -> bool:
    """Whether this command line only asks for help or the version (or nothing: a usage error)."""
    return not argv or any(a in ("-h", "--help", "--version") for a in argv)


def _show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    if isinstance(message, EntoscopeWarning):
        print(f"entoscope: warning: {' '.join(str(message).split())}", file=sys.stderr)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def _interrupted(kept: str = "") -> str:
    """What Ctrl-C leaves: the folders saved before it, and what the interrupted command kept (`kept`: the
    KeyboardInterrupt's own words, e.g. a report's finished steps)."""
    if kept:
        return f"interrupted; {kept}" + (f"; saved before the interrupt: {', '.join(SAVED)}" if SAVED else "")
    if SAVED:
        return f"interrupted; saved before the interrupt: {', '.join(SAVED)}; nothing else was saved"
    return "interrupted; nothing was saved"


def _idle_threads_sleep() -> None:
    """Let torch's OpenMP threads sleep when idle instead of spinning (OMP_WAIT_POLICY=PASSIVE, unless set),
    read when torch loads. Spinning threads on a machine whose cores other jobs share made the demo report
    ten times slower (docs/speed.md); the threads and their split of the work are the same, so are
    the numbers."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _idle_threads_sleep()
    debug = "--debug" in argv or os.environ.get("ENTOSCOPE_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    SAVED.clear()
    warnings.showwarning = _show_warning
    try:
        if _only_help(argv):
            args = help_parser().parse_args(argv)
        else:
            help_parser().parse_args(argv)  # a usage mistake is refused here, before every operation is imported
            args = build_parser().parse_args(argv)
        args.model_given = any(a == "--model" or a.startswith("--model=") for a in argv)
        return int(args.handler(args) or 0)
    except KeyboardInterrupt as err:
        if debug:
            traceback.print_exc()
        print(f"entoscope: {_interrupted(str(err))}", file=sys.stderr)
        return 130
    except EntoscopeError as err:
        if debug:
            traceback.print_exc()
        print(f"entoscope: error: {err.one_line()}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `entoscope ... | head`
        return 0
    except Exception as err:  # noqa: BLE001 - the command line never shows a raw traceback
        if debug:
            traceback.print_exc()
        text = " ".join(str(err).split())[:300]
        print(f"entoscope: error: [internal_error] {type(err).__name__}: {text}. Remedy: this is a bug in "
              "entoscope or a case it does not check yet; rerun with --debug for the traceback and report it",
              file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = _default_showwarning


if __name__ == "__main__":
    sys.exit(main())
