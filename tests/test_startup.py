"""Starting is cheap: `import entoscope`, `entoscope --version`, `entoscope --help` and every sub-command's
`--help` import none of torch, transformers, transformer-lens, plotly, ray or pandas, and what they print is
what the real parser (built from the operations' pydantic fields) prints.

The heavy modules are read from the child process's own `sys.modules`; the help texts are compared with
`cli.build_parser()`'s, which imports every operation; versions with importlib.metadata's.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "transformer_lens", "plotly", "ray", "pandas", "numpy", "nnsight")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _loaded_after(code: str) -> tuple[str, set[str]]:
    """(stdout, the top-level modules loaded) of `code` run in a fresh interpreter."""
    probe = (f"import sys, io, contextlib\nout = io.StringIO()\n"
             f"with contextlib.redirect_stdout(out):\n    {code}\n"
             "print(out.getvalue())\nprint('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text, _, modules = proc.stdout.rpartition("MODULES ")
    return text, set(modules.split())


def _cli(*args: str) -> str:
    return (f"from entoscope.cli import main\n    try:\n        main({list(args)!r})\n"
            "    except SystemExit as done:\n        assert done.code == 0, done.code")


def _commands() -> list[str]:
    from entoscope.cli_snapshot import load

    top = next(a for a in load()["actions"] if a["kind"] == "subparsers")
    return [c["name"] for c in top["choices"]]


def test_import_entoscope_loads_nothing_heavy_and_every_public_name_resolves():
    _, modules = _loaded_after("import entoscope")
    assert not modules & set(HEAVY), modules & set(HEAVY)
    import entoscope as es
    from entoscope.circuits.ifr import InformationFlowRoutes
    from entoscope.data import tasks
    from entoscope.dictionaries.graph import FeatureGraph
    from entoscope.lens.operation import Lens

    assert set(es.__all__) <= set(dir(es))
    for name in es.__all__:
        assert getattr(es, name) is not None, name
    assert es.Lens is Lens and es.InformationFlowRoutes is InformationFlowRoutes and es.tasks is tasks
    assert es.FeatureGraph is FeatureGraph and es.errors.EntoscopeError is es.EntoscopeError
    assert es.models.loading.DEMO_DIR  # a sub-package is an attribute, as after an eager import
    with pytest.raises(AttributeError):
        es.no_such_name  # noqa: B018


@pytest.mark.parametrize("args", [["--version"], ["--help"]], ids=["version", "help"])
def test_version_and_help_load_nothing_heavy(args):
    text, modules = _loaded_after(_cli(*args))
    assert not modules & set(HEAVY), modules & set(HEAVY)
    assert ("entoscope " in text) if args == ["--version"] else ("COMMAND" in text and "report" in text)


def test_every_sub_commands_help_loads_nothing_heavy():
    commands = _commands()
    code = "from entoscope.cli import main\n    for c in " + repr(commands) + ":\n        try:\n            " \
           "main([c, '--help'])\n        except SystemExit as done:\n            assert done.code == 0, c"
    text, modules = _loaded_after(code)
    assert not modules & set(HEAVY), modules & set(HEAVY)
    assert text.count("usage: entoscope ") == len(commands)


@pytest.mark.parametrize("args", [["lens", "--bogus", "3"], ["info", "--n", "many"], ["nosuch"], ["run"]],
                         ids=["unknown-option", "not-a-number", "unknown-command", "missing-file"])
def test_a_usage_mistake_is_one_line_and_loads_nothing_heavy(args):
    code = (f"from entoscope.cli import main\n    import sys\n    err = io.StringIO()\n"
            f"    with contextlib.redirect_stderr(err):\n        status = main({args!r})\n"
            "    assert status == 2, status\n    print('ERR', err.getvalue())")
    text, modules = _loaded_after(code)
    assert not modules & set(HEAVY), modules & set(HEAVY)
    lines = text.split("ERR ", 1)[1].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("entoscope: error: [bad_arguments]"), lines


def test_the_help_printed_is_the_real_parsers_and_the_snapshot_is_current():
    from entoscope import cli
    from entoscope.cli_snapshot import load, snapshot

    real, quick = cli.build_parser(), cli.help_parser()
    assert snapshot(real) == json.loads(json.dumps(snapshot(real))) == load(), \
        "cli_snapshot.json is out of date: write it again with `python scripts/write_cli_snapshot.py`"
    assert quick.format_help() == real.format_help()
    real_sub = real._subparsers._group_actions[0].choices
    quick_sub = quick._subparsers._group_actions[0].choices
    assert list(real_sub) == list(quick_sub)
    for name in real_sub:
        assert quick_sub[name].format_help() == real_sub[name].format_help(), name


def test_every_operation_field_is_a_flag_of_its_sub_command():
    from entoscope import cli
    from entoscope.registry import lookup

    subs = cli.help_parser()._subparsers._group_actions[0].choices
    for cli_name, op_name in cli.CLI_NAMES.items():
        flags = {s for a in subs[cli_name]._actions for s in a.option_strings}
        fields = lookup("operation", op_name).model_fields
        assert {f"--{f.replace('_', '-')}" for f in fields} <= flags, cli_name


def test_a_command_line_without_a_command_is_one_line(capsys):
    from entoscope.cli import main

    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("entoscope: error: [bad_arguments]")


@pytest.mark.parametrize("dist", ["torch", "transformers", "transformer-lens", "numpy", "pydantic", "PyYAML"])
def test_installed_versions_are_importlib_metadatas(dist):
    from entoscope.versions import installed_version

    assert installed_version(dist) == md.version(dist)
    assert installed_version("no-such-distribution-here") is None


def test_every_module_that_registers_a_plug_in_is_a_builtin_module():
    """A lazily imported package registers only what registry.BUILTIN_MODULES names: importing every
    module of the package must register nothing more (else a plug-in would be missing until imported)."""
    code = (
        "import importlib, pkgutil, entoscope\n"
        "from entoscope import registry\n"
        "kinds = list(registry.BUILTIN_MODULES)\n"
        "lazy = {k: set(registry.names(k)) for k in kinds}\n"
        "for m in pkgutil.walk_packages(entoscope.__path__, 'entoscope.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(m.name)\n"
        "full = {k: set(registry.names(k)) for k in kinds}\n"
        "print({k: sorted(full[k] - lazy[k]) for k in kinds if full[k] - lazy[k]})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{}"
