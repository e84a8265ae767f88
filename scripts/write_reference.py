"""Write docs/reference.md from the code, and refresh the contents list of every long page in docs/.

    python scripts/write_reference.py            # write what is out of date
    python scripts/write_reference.py --check    # exit 1 (naming the files) when something is out of date

docs/reference.md holds every field of every operation and of the configs they take (name, type, default,
allowed values, meaning: the fields' `Field(description=...)`, as `help(es.Patching)` shows them), the keys of
a YAML experiment file, every command and option of the command line (`cli.build_parser()`, as `--help`
prints them), every error and warning code (the raise sites, with their meaning from docs/errors.md) and the
registered names a config may use. A page of docs/ with a `**Contents:**` paragraph gets it rewritten from its
`## ` headings. tests/test_reference.py fails while any of these files differs from what this script writes:
run it after changing a field, an option, a code, or a page's sections (the lead does after a merge).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # run from a checkout: this checkout's entoscope

DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
CONTENTS = "**Contents:**"
LONG = 150  # lines: a longer page (of two sections or more) lists its sections under its first paragraph
WIDTH = 116

# the page that explains each operation (a new operation without an entry: the first page that names its class)
PAGES = {"lens": "lens.md", "parameter_lens": "lens.md", "jacobian_lens_fit": "lens.md",
         "lens_comparison": "lens.md", "coordinate_patching": "lens.md", "patching": "patching.md",
         "probing": "probing.md", "circuits": "circuits.md", "head_scores": "circuits.md", "dla": "dla_ifr.md",
         "ifr": "dla_ifr.md", "decoder_lens": "features.md", "feature_dla": "features.md",
         "feature_graph": "features.md", "steering": "steering.md", "interchange": "interchange.md",
         "inspect": "inspect.md"}
# the registered kinds a config names by a string, and the field that takes them
KINDS = {"metric": "`metric` (`Metric.type`)", "patch": "`Patching.patch`", "pooling": "`Probing.pooling`",
         "head_pooling": "`Probing.head_pooling`", "report_section": "`entoscope report`'s sections"}
CODE_PATTERNS = (r'\bcode\s*=\s*"([a-z0-9_]+)"', r'\bcode:\s*str\s*=\s*"([a-z0-9_]+)"')


# ---------------------------------------------------------------------------------------------- markdown
def cell(text: Any) -> str:
    """Text for a table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: Any) -> str:
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def para(text: str) -> str:
    """A paragraph wrapped for the page's source (markdown joins its lines)."""
    return "\n".join(textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False))


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text, lower-case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(text: str, level: int = 2) -> list[tuple[str, str]]:
    """(heading, anchor) of the page's headings of `level`, outside code blocks (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#{1,6}) +(.*?) *#* *$", line)
        if m:
            anchor = slug(m.group(2))
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            if len(m.group(1)) == level:
                out.append((m.group(2), anchor if n == 0 else f"{anchor}-{n}"))
    return out


def contents_paragraph(text: str) -> str:
    links = [f"[{re.sub(r'[`*]', '', h)}](#{a})" for h, a in headings(text)]
    return "\n".join(textwrap.wrap(CONTENTS + " " + " · ".join(links), WIDTH, break_long_words=False,
                                   break_on_hyphens=False))


def with_contents(text: str) -> str:
    """The page with its `**Contents:**` paragraph (up to the next blank line) written from its ## headings; a page
    of more than LONG lines and two sections without one gets it after the paragraph under its title."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(CONTENTS)), None)
    if start is None:
        if len(text.splitlines()) <= LONG or len(headings(text)) < 2 or not lines[0].startswith("# "):
            return text
        first = next((i for i in range(1, len(lines)) if lines[i].strip()), len(lines))
        start = next((i for i in range(first, len(lines)) if not lines[i].strip()), len(lines))
        lines[start:start] = ["", CONTENTS]
        start += 1
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip() or lines[i].startswith(("```", "#", "|"))),
               len(lines))
    rest = lines[end:] if end < len(lines) and not lines[end].strip() else [""] + lines[end:]
    return "\n".join(lines[:start] + [contents_paragraph(text)] + rest)


# ---------------------------------------------------------------------------------------------- fields
def yaml_text(value: Any) -> str:
    """A default as YAML writes it in flow style (null, true, [a, b], {k: v})."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        plain = value and not re.search(r"[:#\[\]{},&*!|>'\"%@`]|^[-?\s]|\s$", value) and \
            value.lower() not in ("null", "true", "false", "yes", "no", "on", "off", "~")
        return value if plain and not re.fullmatch(r"[-+.\d_e]+", value) else repr(value)
    return repr(value)


def config_classes(roots: list[type]) -> list[type]:
    """The config classes the roots' fields take, depth first, each once (the operations themselves left out)."""
    import typing

    from pydantic import BaseModel

    found: list[type] = []

    def walk(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.append(annotation)
                for info in annotation.model_fields.values():
                    walk(info.annotation)
            return
        for arg in typing.get_args(annotation):
            walk(arg)

    for root in roots:
        for info in root.model_fields.values():
            walk(info.annotation)
    return [c for c in found if c not in roots]


def type_cell(annotation: Any, anchors: dict[type, str]) -> str:
    """The type, Literal values replaced by their type (the values go in `allowed`), configs linked."""
    import typing

    from entoscope.config_model import literal_values, type_text

    text = type_text(annotation)
    values = literal_values(annotation)
    if values:
        kinds = sorted({type(v).__name__ for v in values if v is not None})
        text = re.sub(r"Literal\[[^\]]*\]", " | ".join(kinds), text)
    for cls in _classes_in(annotation, typing):
        if cls in anchors:
            text = re.sub(rf"\b{cls.__name__}\b", f"[{cls.__name__}](#{anchors[cls]})", text)
    return cell(text)


def _classes_in(annotation: Any, typing: Any) -> list[type]:
    if isinstance(annotation, type):
        return [annotation]
    return [c for a in typing.get_args(annotation) for c in _classes_in(a, typing)]


def field_rows(cls: type, anchors: dict[type, str], first: list[str] | None = None) -> list[list[str]]:
    from entoscope.config_model import allowed_text, default_of

    names = list(cls.model_fields)
    if first is not None:  # the class's own fields first, then the ones every operation has
        names = [n for n in names if n not in first] + [n for n in names if n in first]
    rows = []
    for name in names:
        info = cls.model_fields[name]
        default = default_of(info)
        rows.append([code(name), type_cell(info.annotation, anchors),
                     "required" if default is ... else code(yaml_text(default)), cell(allowed_text(info)),
                     cell(info.description or "**no meaning yet: add Field(description=...)**")])
    return rows


FIELD_HEADER = ["field", "type", "default", "allowed", "meaning"]


# ---------------------------------------------------------------------------------------------- sections
def operations_section(anchors: dict[type, str]) -> tuple[list[str], list[type]]:
    import entoscope as es
    from entoscope.cli import CLI_NAMES
    from entoscope.config_model import own_doc
    from entoscope.operation import Operation
    from entoscope.registry import lookup, names

    exported = {getattr(es, n): n for n in es.__all__ if n[:1].isupper()}
    commands = {op: cmd for cmd, op in CLI_NAMES.items()}
    ops = [lookup("operation", n) for n in names("operation")]
    ops.sort(key=lambda c: exported.get(c, c.__name__))
    common = list(Operation.model_fields)
    overview, body = [], []
    for cls in ops:
        name = cls.name
        python = f"es.{exported[cls]}" if cls in exported else f"{cls.__module__}.{cls.__name__}"
        page = _page_of(name, cls)
        command = f"`entoscope {commands[name]}`" if name in commands else "—"
        doc = (own_doc(cls).strip().splitlines() or [""])[0]
        overview.append([f"[`{python}`](#{anchors[cls]})", code(name), command,
                         f"[{page}]({page})" if page else "—", cell(doc)])
        body += ["", f"### {cls.__name__}", "",
                 f"`{python}` · YAML `operation: {name}`" + (f" · {command}" if name in commands else "")
                 + (f" · [{page}]({page})" if page else "") + ". " + cell(doc), ""]
        body += table(FIELD_HEADER, field_rows(cls, anchors, common))
    intro = ["## Operations", "",
             para("Each operation's fields are its config: keyword arguments in Python, keys of a YAML entry, "
                  "`--flags` of its command (values read as YAML). The last six fields of each table "
                  "(`batch_size` ... `confirm`) every operation has."), ""]
    return intro + table(["Python", "YAML `operation:`", "command", "page", "what it does"], overview) + body, ops


def _page_of(name: str, cls: type) -> str:
    if name in PAGES and (DOCS / PAGES[name]).exists():
        return PAGES[name]
    for page in sorted(DOCS.glob("*.md")):
        if page.name != REFERENCE.name and f"es.{cls.__name__}" in page.read_text(encoding="utf-8"):
            return page.name
    return ""


def configs_section(configs: list[type], anchors: dict[type, str]) -> list[str]:
    from entoscope.config_model import own_doc

    out = ["## Configs the fields take", "",
           para("A field of one of these types takes a mapping of its fields in YAML and on the command line "
                "(`--sites '{activation: resid_pre, over: [layer]}'`), or the object in Python (`es.Sites(...)`).")]
    for cls in configs:
        doc = (own_doc(cls).strip().splitlines() or [""])[0]
        out += ["", f"### {cls.__name__}", "", f"`{cls.__module__}.{cls.__name__}`. {cell(doc)}", ""]
        out += table(FIELD_HEADER, field_rows(cls, anchors))
    return out


def yaml_section(anchors: dict[type, str]) -> list[str]:
    from entoscope.data.loading import DataSpec
    from entoscope.executors.config import InProcess, Ray
    from entoscope.registry import names

    rows = [[code("operation"), "the operation's YAML name, one of: " + ", ".join(names("operation"))],
            [code("data"), f"the prompts: a [DataSpec](#{anchors[DataSpec]}) mapping (`{{task: ioi, n: 64}}`, "
             "`{path: my.jsonl}`), or a prompt or a list of prompts"],
            [code("executor"), f"where it runs: `in_process` (default, [InProcess](#{anchors[InProcess]})) or a "
             f"[Ray](#{anchors[Ray]}) mapping (`{{type: ray, workers: 4}}`)"],
            ["any field of the operation", "as in its table under [Operations](#operations)"]]
    return ["## YAML experiment files", "",
            para("A file maps entry names to entries (`entoscope run FILE [ENTRY ...]`); `${VAR}` and "
                 "`${VAR:-default}` are read from the environment; an unknown key, a missing one or a wrong type is "
                 "refused with its path (`ioi_resid.sites.over[1]`, code `config_invalid`). The keys of an entry:"),
            ""] + \
        table(["key", "meaning"], rows)


def cli_section() -> list[str]:
    from entoscope.cli import build_parser

    parser = build_parser()
    sub = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = ["## Command line", "",
           para("`entoscope COMMAND --help` prints the same; every value of an operation's option is read as YAML. "
                "An option's default is the one its field has when the option is left out."), "",
           "### entoscope", "", cell(parser.description.strip().splitlines()[0]), ""]
    out += table(["option", "value", "default", "meaning"], _option_rows(parser))
    for name, child in sub.choices.items():
        out += ["", f"### entoscope {name}", "", cell(helps.get(name) or ""), ""]
        out += table(["option", "group", "value", "default", "meaning"], _option_rows(child, groups=True))
    return out


def _option_rows(p: argparse.ArgumentParser, groups: bool = False) -> list[list[str]]:
    rows = []
    for group in p._action_groups:
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            help_text = action.help or ""
            default = re.search(r"\[default: (.*)\]\s*$", help_text)
            meaning = help_text[:default.start()] if default else help_text
            meaning = meaning.replace("%%", "%").strip()
            if isinstance(action, argparse._VersionAction):
                value, shown = "", "—"
            elif action.nargs == 0:
                value, shown = "", "off (a switch)"
            else:
                value = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else (action.metavar or "")
                value = value or action.dest.upper()
                if action.nargs == "*":
                    value += " ..."
                required = action.required and action.nargs not in ("*", "?")
                shown = default.group(1) if default else ("required" if required else
                                                          ("—" if action.default in (None, []) else str(action.default)))
            name = ", ".join(action.option_strings) or action.dest
            row = [code(name), code(value) if value else "", code(shown) if shown not in ("—", "off (a switch)", "required")
                   else shown, cell(meaning)]
            if groups:
                row.insert(1, cell(group.title or ""))
            rows.append(row)
    return rows


def documented_codes() -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """code -> (docs/errors.md section, meaning) of the codes the tables of docs/errors.md name in their first cell,
    and of every code the page mentions (the first row or line: a warning named beside a refusal)."""
    out: dict[str, tuple[str, str]] = {}
    mentioned: dict[str, tuple[str, str]] = {}
    section = ""
    for line in (DOCS / "errors.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("| `"):
            for c in re.findall(r"`([a-z0-9_<>]+)`", cells[0]):
                out.setdefault(c, (section, " | ".join(cells[1:]).replace("\\|", "|")))
        for c in re.findall(r"`([a-z0-9_<>]+)`", line):
            mentioned.setdefault(c, (section, (" | ".join(cells[1:]) if line.startswith("| ") else line)
                                     .replace("\\|", "|")))
    return out, mentioned


def codes_in_source() -> dict[str, str]:
    """code -> the first module (under src/entoscope) that raises or warns with it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "entoscope").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern in CODE_PATTERNS:
            for c in re.findall(pattern, text):
                found.setdefault(c, str(path.relative_to(ROOT / "src" / "entoscope")))
    return found


def errors_section() -> list[str]:
    from entoscope import errors

    classes = {cls.code: cls for cls in vars(errors).values()
               if isinstance(cls, type) and issubclass(cls, errors.EntoscopeError)}
    (documented, mentioned), raised = documented_codes(), codes_in_source()
    errors_text = (DOCS / "errors.md").read_text(encoding="utf-8")
    anchors = {h: a for h, a in headings(errors_text)}
    rows = []
    for c in sorted(set(documented) | set(raised)):
        section, meaning = documented.get(c) or mentioned.get(c) or ("", "")
        if c in classes:  # a class's default code: the class says what it is
            section, meaning = section or "Refusal codes", meaning or \
                f"`{classes[c].__name__}`: {(classes[c].__doc__ or '').strip().splitlines()[0]}"
        where = f"[{section}](errors.md#{anchors[section]})" if section in anchors else "[errors](errors.md)"
        rows.append([code(c), where, cell(meaning or "not yet in docs/errors.md"),
                     code(raised[c]) if c in raised else "—"])
    return ["## Error and warning codes", "",
            para("Every code a refusal (`err.code`, `[code]` on the command line) or a recorded warning carries: "
                 "those raised in the source and those docs/errors.md lists (`unknown_<kind>` stands for "
                 "`unknown_metric`, `unknown_patch`, ...), with the section of docs/errors.md that explains it and "
                 "the module that first raises it."), ""] + table(["code", "docs/errors.md", "meaning", "raised in"], rows)


def names_section() -> list[str]:
    from entoscope.data.tasks import TASKS
    from entoscope.registry import names

    rows = [[code(kind), where, ", ".join(code(n) for n in names(kind))] for kind, where in KINDS.items()]
    rows.append([code("task"), "`data: {task: ...}` (docs/demo_model.md)", ", ".join(code(n) for n in TASKS)])
    return ["## Registered names", "",
            para("The names a config takes as a string. Your own function joins them with "
                 "`@es.register(kind, name)` and then works from YAML and the command line like a built-in."), ""] + \
        table(["kind", "taken by", "names"], rows)


def reference_text() -> str:
    from entoscope.data.loading import DataSpec
    from entoscope.executors.config import InProcess, Ray
    from entoscope.registry import lookup, names

    ops = [lookup("operation", n) for n in names("operation")]
    configs = config_classes(ops)
    configs += [c for c in (DataSpec, InProcess, Ray) if c not in configs]
    anchors = {cls: slug(cls.__name__) for cls in ops + configs}
    ops_lines, _ = operations_section(anchors)
    lines = [
        "# Reference: every field, option, YAML key and code",
        "",
        para("This page answers: what does this field, option or code mean, and what type, default and values does "
             "it take? It is written from the code by `python scripts/write_reference.py` (a test fails when it is "
             "out of date): the meanings are the fields' `Field(description=...)` and the options' help, so Python "
             "and the command line say the same:"),
        "",
        "```python",
        "import entoscope as es",
        'print(es.Patching.model_fields["method"].description)   # one field\'s meaning, as in the table below',
        "help(es.Patching)                                       # every field: type, default, meaning",
        "```",
        "",
        "```bash",
        "entoscope patch --help                                  # every option, with the same meanings",
        "```",
        "",
        "",
        CONTENTS,
        "",
        *ops_lines, "",
        *configs_section(configs, anchors), "",
        *yaml_section(anchors), "",
        *cli_section(), "",
        *errors_section(), "",
        *names_section(), "",
    ]
    return with_contents("\n".join(lines))


def pages() -> dict[Path, str]:
    """Every file this script writes, with the text it writes."""
    out = {REFERENCE: reference_text()}
    for page in sorted(DOCS.glob("*.md")):
        if page != REFERENCE:
            text = page.read_text(encoding="utf-8")
            if with_contents(text) != text:
                out[page] = with_contents(text)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files out of date")
    args = ap.parse_args(argv)
    written = pages()
    stale = [p for p, text in written.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    for path in stale:
        if args.check:
            print(f"out of date: {path.relative_to(ROOT)}")
        else:
            path.write_text(written[path], encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
