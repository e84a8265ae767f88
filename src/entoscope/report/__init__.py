"""`entoscope report`: one offline page about a model — its structure, how it does the built-in tasks, and
a section per operation, each saying what it shows and what to conclude from its numbers.

The pages' one home: `report/section.py` builds a section (run, save, `Section`), `report/glossary.py`
defines every term once, `report/sections/` holds one module per section (registered with
`register("report_section", name)`), and this module assembles the summary page. Operations never import
the report; the report imports operations.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import warn
from ..evaluate import task_scores
from ..heap import give_back_memory
from ..models.adapter import adapt
from ..registry import lookup, names
from ..results.claims import split_lead, write_takeaways
from ..results.folder import writing_run
from ..results.page import anchor, ensure_plotly_js, lead_html, table_html, write_page
from . import sections as _sections  # noqa: F401  (registers the sections)
from .glossary import terms_html
from .preflight import NotRun, preflight
from .resume import RECORDS, Checkpoints, differences, refuse_other, report_key, section_of, section_value
from .section import Section
from . import sizes as _sizes

SECTION_ORDER = ["lens", "head_scores", "dla", "patching", "probing", "circuits", "ifr", "features", "steering"]
TASK_MEANING = {
    "ioi": "indirect object identification: 'When Mary and John went to the store, John gave a drink to' -> Mary",
    "facts": "a country's capital: 'The capital of France is' -> Paris",
    "greater_than": "'The war lasted from the year 1732 to the year 17' -> a year after 32 (Hanna et al. 2023)",
    "induction": "a sequence shown twice: predict the next token of the second copy",
}


def build_report(model: Any, out: str | Path, *, quick: bool = False, sections: list[str] | None = None,
                 overwrite: bool = False, quiet: bool = False, resume: bool = False, memory: Any = "auto") -> Path:
    """Write `out/index.html` (and one sub-folder per section). Returns the page path.

    The report is built in a hidden sibling folder and renamed into place when complete, so an
    interrupted report never leaves pages of two reports together; an existing report is replaced
    only with `overwrite=True`. Progress goes to stdout (`Progress`) unless `quiet` (or ENTOSCOPE_QUIET=1).
    A section the model cannot run is skipped before the first forward, and one that raises is set aside;
    the others are written either way, and the index and `manifest.json` (`not_run`) say why
    (report/preflight.py). Interrupted (Ctrl-C, a killed process), the report keeps the steps it had
    finished: the same call again reuses them, each checked first (report/resume.py); with `resume=True`
    an interrupted report of other settings is refused instead of replaced.
    `memory` is every section's memory budget above the loaded model (a size such as 12GB, or "auto": what
    the model's device has free; memory.py): a section that cannot fit it is skipped before its first forward
    (code memory_budget).
    """
    from ..memory import budget_scope, parse_size

    parse_size(memory)  # a value that is not a size is refused before anything is written
    a = adapt(model)
    final = Path(out)
    chosen = _chosen(sections)
    key = report_key(a, quick, chosen)

    def reuse(old: Path) -> bool:
        theirs = Checkpoints.stored_key(old)
        if theirs is None or theirs == key:
            return theirs is not None
        if resume:
            refuse_other(old, key, theirs, final)
        warn(f"an interrupted report of {final} was made with other settings ({differences(key, theirs)}): it is "
             "removed and this report starts anew", code="report_restarted")
        return False

    kept = []
    try:
        with writing_run(final, overwrite=overwrite, reuse=reuse,
                         keep=lambda p: Checkpoints(p, key).any_done()) as folder, a.evaluating(), \
                budget_scope(memory, a.device):
            kept.append(folder)
            _write_report(model, a, folder, quick, chosen, Checkpoints(folder, key), quiet)
    except KeyboardInterrupt:
        if kept and kept[0].is_dir():
            raise KeyboardInterrupt(f"the report's finished steps are kept (in {kept[0]}): the same command again "
                                    "(or with --resume) goes on from there") from None
        raise
    return final / "index.html"


def _chosen(sections: list[str] | None) -> list[str]:
    chosen = list(sections) if sections is not None else [s for s in SECTION_ORDER if s in names("report_section")]
    chosen += [s for s in names("report_section") if s not in chosen and sections is None]
    return chosen


class Progress:
    """The report's steps as they run: one line when a step starts and one when it ends, with its time, so a
    log shows where a long report is (flushed at once: a file, a pipe, CI). On a terminal the step lines are
    written above a progress bar naming the running step: a log captured through a terminal (`script`, a
    pseudo-terminal) still gets every finished step as a whole line. A terminal that says it is dumb
    (TERM=dumb) gets the lines alone."""

    def __init__(self, steps: int, quiet: bool = False) -> None:
        self.total, self.done = steps, 0
        self.quiet = quiet or os.environ.get("ENTOSCOPE_QUIET") == "1"
        self.bar = None
        if not self.quiet and sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps, desc="report", file=sys.stdout, leave=False)

    def _say(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        where = f"report [{self.done + 1}/{self.total}] {name}"
        start = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description(f"report: {name}")
        else:
            self._say(f"{where}: started")
        yield
        self.done += 1
        self._say(f"{where}: done in {time.perf_counter() - start:.1f} s")
        if self.bar is not None:
            self.bar.update(1)

    def reused(self, name: str) -> None:
        """A step an interrupted report had finished, taken over (its files checked)."""
        self.done += 1
        self._say(f"report [{self.done}/{self.total}] {name}: reused (finished before the interruption)")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_report(model: Any, a: Any, folder: Path, quick: bool, chosen: list[str], ck: Checkpoints,
                  quiet: bool = False) -> None:
    resumed = Checkpoints.stored_key(folder) == ck.key
    if resumed:  # an interrupted report's folder: its finished steps are checked below, the rest goes
        for path in folder.iterdir():
            if path.name in chosen or path.name == RECORDS:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    ck.start()
    ensure_plotly_js(folder)
    functions = {name: lookup("report_section", name) for name in chosen}
    done = {name: section_of(v) for name in chosen if (v := ck.load(f"section-{name}", folder / name)) is not None}
    progress = Progress(len(chosen) + 3, quiet)
    not_run: dict[str, NotRun] = {}
    try:
        with progress.step("checking every section (no forward)"):
            for name in chosen:
                refused = None if name in done else preflight(model, name, functions[name], quick)
                if refused is not None:
                    not_run[name] = refused
                    warn(refused.line(), code="report_section_skipped")
        stored = ck.load("task-scores")
        if stored is not None:
            scores = stored["scores"]
            progress.reused("task scores")
        else:
            with progress.step("task scores"):
                try:
                    scores = task_scores(model, n=32 if quick else 128)
                    ck.save("task-scores", {"scores": scores})
                except Exception as err:  # noqa: BLE001 - the sections can still be written
                    scores = {}
                    not_run["task scores"] = NotRun.of("task scores", "failed", err)
                    warn(not_run["task scores"].line(), code="report_section_failed")
        built: list[tuple[str, Section]] = []
        for name in chosen:
            if name in done:
                built.append((name, done[name]))
                progress.reused(f"section {name}")
                continue
            with progress.step(f"section {name}" + (" (skipped)" if name in not_run else "")):
                shutil.rmtree(folder / name, ignore_errors=True)  # what an interrupted run of it had written
                if name not in not_run:
                    try:
                        built.append((name, functions[name](model, folder / name, quick)))
                    except Exception as err:  # noqa: BLE001 - one section's failure keeps the others
                        not_run[name] = NotRun.of(name, "failed", err)
                        shutil.rmtree(folder / name, ignore_errors=True)
                        warn(not_run[name].line(), code="report_section_failed")
                    else:
                        ck.save(f"section-{name}", section_value(built[-1][1]), folder / name)
                if name in not_run:
                    _write_not_run(folder / name, not_run[name])
                give_back_memory()  # the next section's peak does not sit on this one's freed heap (heap.py)
        with progress.step("summary page"):
            reused = (["task scores"] if stored is not None else []) + [name for name in chosen if name in done]
            _write_summary(a, folder, quick, chosen, scores, built, list(not_run.values()), reused)
        ck.finish()
    finally:
        progress.close()


def _write_not_run(where: Path, what: NotRun) -> None:
    """The page of a section the report did not write: why, and what to do."""
    write_page(where / "index.html", f"section {what.section}: not run", [("not run", what.html())],
               js_relpath="../plotly.min.js", back="../index.html")


def _write_summary(a: Any, folder: Path, quick: bool, chosen: list[str], scores: dict[str, Any],
                   built: list[tuple[str, Section]], not_run: list[NotRun] | None = None,
                   reused: list[str] | None = None) -> None:
    from ..results.manifest import model_identity, package_versions

    not_run = not_run or []
    parts = [("at a glance", _glance(built, not_run, chosen)),
             ("the model", f"<pre>{html.escape(a.structure.describe())}</pre>"),
             ("how it does the built-in tasks", _scores_html(scores))]
    for name, sec in built:
        link = (f'<p class="more"><a href="{name}/index.html">{html.escape(sec.title)}: every figure and the whole '
                "table</a></p>") if sec.own_page else ""
        parts.append((sec.title, lead_html(sec.lead, "takeaway") + terms_html(sec.terms) + sec.body
                      + _screen_notes(a, name, quick) + link))
    if not_run:
        parts.append(("sections not run", "".join(f"<h3>{html.escape(n.section)}</h3>{n.html()}" for n in not_run)))
    (folder / "scores.json").write_text(json.dumps(scores, indent=2))
    write_takeaways(folder / "takeaways.json", [("index.html", sec.lead) for _, sec in built])  # their claims
    manifest = {"operation": "report", "quick": quick, "sections": chosen, "model": model_identity(a),
                "sizes": {"forward_macs_per_token": _sizes.forward_macs(a), "tier": _sizes.tier(a),
                          **{name: _sizes.sizes(a, name, quick) for name in chosen if name in _sizes.SIZES}},
                "screens": {name: found for name in chosen if (found := _sizes.screens(a, name, quick))},
                "versions": package_versions(), "written": [name for name, _ in built],
                "reused": list(reused or []),
                "not_run": [n.record() for n in not_run]}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str), encoding="utf-8")
    lead = (f"What {a.name} does on the built-in tasks (its structure below), and which of its components carry "
            "each task, with bootstrap intervals over prompts. Each section below starts with its conclusion; every "
            "section has its own page.")
    if not_run:
        lead += " Not run: " + "; ".join(f"{n.section} ({n.status}, {n.code})" for n in not_run) + " (see the end)."
    write_page(folder / "index.html", f"entoscope report: {a.name}", parts, js_relpath="plotly.min.js", lead=lead)


def _screen_notes(a: Any, name: str, quick: bool) -> str:
    """Where the report's time budget (or the test's resolution) left a section's screen short of the prompts
    it needs, the reason in words (report/sizes.py `screens`)."""
    limited = [s for s in _sizes.screens(a, name, quick) if "limited" in s]
    return "".join(f'<p class="note">This section screens {s["cells"]:,} cells ({html.escape(s["operation"])}) on '
                   f"{s['prompts']} prompts, fewer than its screen needs: {html.escape(s['limited'])} "
                   f"(report/sizes.py); a cell needs p &lt;= {s['needed_p']:.2g} to be a discovery on its own and the "
                   f"smallest p on {s['prompts']} prompts is {s['min_p']:.2g}.</p>" for s in limited)


def _glance(built: list[tuple[str, Section]], not_run: list[NotRun], chosen: list[str]) -> str:
    items = "".join(f'<li><a href="#{anchor(sec.title)}">{html.escape(sec.title)}</a>: '  # the lead only
                    f"{html.escape(split_lead(sec.lead)[0])}</li>" for _, sec in built)
    for n in not_run:  # a section's page says why; the task scores have none
        name = f'<a href="{html.escape(n.section)}/index.html">{html.escape(n.section)}</a>' if n.section in chosen \
            else html.escape(n.section)
        items += f"<li>{name}: not run ({n.status}, <code>{html.escape(n.code)}</code>)</li>"
    return f"<ul class=\"glance\">{items}</ul>"


def _scores_html(scores: dict[str, dict[str, Any]]) -> str:
    """Each task's figures with their 95% intervals (Wilson for accuracies, bootstrap for means), and the
    verdict each task's interval supports (evaluate.verdict)."""
    import pandas as pd

    rows, verdicts = [], []
    for task, figs in scores.items():
        if "skipped" in figs:
            rows.append({"task": task, "what": TASK_MEANING.get(task, ""), "measure": "skipped",
                         "value": None, "95% interval": str(figs.get("reason", "")), "prompts": None})
            continue
        if "verdict" in figs:
            verdicts.append(f"<li>{html.escape(task)}: {html.escape(figs['verdict'])} "
                            f"({html.escape(figs['why'])})</li>")
        for key, value in figs.items():
            if key == "n" or not isinstance(value, float) or key.endswith(("_ci_low", "_ci_high")):
                continue
            ci = f"[{figs[key + '_ci_low']:.3f}, {figs[key + '_ci_high']:.3f}]" if key + "_ci_low" in figs else ""
            rows.append({"task": task, "what": TASK_MEANING.get(task, ""), "measure": key.replace("_", " "),
                         "value": round(value, 3), "95% interval": ci, "prompts": int(figs["n"])})
    head = (f'<ul class="glance">{"".join(verdicts)}</ul><p class="note">Which tasks the model does well and badly, '
            "from each interval alone: well when its low end reaches the bar (accuracy 0.8, probability difference "
            "0.5), badly when its high end is below the floor (0.5, 0.1). Accuracies have Wilson intervals, means "
            "bootstrap intervals over prompts; a measure ending in 'sequence' reads whole answers of several "
            "tokens by teacher forcing (the others read each answer's first token).</p>") if verdicts else ""
    if not rows:
        return "<p>No task scores: see the sections not run below.</p>"
    return head + table_html(pd.DataFrame(rows), note="the task could not be built for this tokenizer")
