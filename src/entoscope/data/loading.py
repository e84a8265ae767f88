"""Where a dataset comes from: a built-in task, a local JSONL/CSV file, HuggingFace `datasets`, or
inline prompts. `DataSpec` is the config form (YAML `data: {task: ioi, n: 64}`), `load_data` the
function; both give a `Dataset`.

File records use the field names of `Example`: prompt, counterfactual, answers (or answer),
wrong_answers (or wrong_answer), label, and any other fields land in `meta`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from ..config_model import ConfigModel
from ..errors import DataError
from .examples import Dataset, Example, record_fields


class DataSpec(ConfigModel):
    """One of: `task` (+ its parameters), `path` (JSONL/CSV), `hf` (a `datasets` name), `prompts`.

    task:    a built-in task (ioi, induction, facts, greater_than, repeated_tokens); n, seed and
             the task's own options go in `params` or at top level (n, seed).
    path:    a local .jsonl or .csv file of records.
    hf:      a HuggingFace `datasets` name (needs the hub or a local cache), with split and the
             field names to map: prompt_field, answer_field, label_field.
    prompts: inline prompt strings.
    limit:   keep the first `limit` examples.
    """


    task: str | None = Field(default=None, description="a built-in task: ioi, induction, facts, greater_than, "
                             "repeated_tokens, corpus")
    n: int | None = Field(default=None, description="task: the number of examples")
    seed: int | None = Field(default=None, description="task: the generator's seed")
    params: dict[str, Any] = Field(default_factory=dict, description="task: its own options (docs/demo_model.md)")
    path: str | None = Field(default=None, description="a local .jsonl or .csv file of records (docs/data.md)")
    hf: str | None = Field(default=None, description="a HuggingFace datasets name (needs the hub or a local cache)")
    split: str = Field(default="train", description="hf: the split read")
    prompt_field: str = Field(default="prompt", description="hf: the field holding the prompt")
    answer_field: str | None = Field(default=None, description="hf: the field holding the answer")
    label_field: str | None = Field(default=None, description="hf: the field holding the label")
    prompts: list[str] | None = Field(default=None, description="inline prompt strings")
    limit: int | None = Field(default=None, description="keep the first limit examples")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DataSpec:
        given = [k for k in ("task", "path", "hf", "prompts") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of task, path, hf, prompts (got {given or 'none'})")
        return self

    def task_kwargs(self) -> dict[str, Any]:
        """The task generator's keyword arguments: `params` plus n and seed where given."""
        kwargs = dict(self.params)
        for key in ("n", "seed"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return kwargs

    def check(self) -> DataSpec:
        """The checks that need no model: the task exists and takes these parameters, the file exists."""
        if self.task is not None:
            from . import tasks

            tasks.check(self.task, self.task_kwargs())
        if self.limit is not None and self.limit < 0:
            raise DataError(f"limit must be >= 0, got {self.limit}", code="data_limit_invalid",
                            remedy="give the number of examples to keep")
        if self.path is not None and not Path(self.path).expanduser().exists():
            raise DataError(f"no data file at {self.path}", code="data_file_missing", remedy="check the path")
        return self


def load_data(spec: DataSpec | Dataset | dict | str | list[Any], tokenizer: Any = None) -> Dataset:
    """A `Dataset` from a spec, a dict, a prompt, a list of prompts (texts, token-id lists, Examples or records:
    dicts with a `prompt`, read as `Dataset.from_records` reads them), or a Dataset (returned as is)."""
    if isinstance(spec, Dataset):
        return spec
    if isinstance(spec, str):
        return Dataset("prompt", (Example(spec),))
    if isinstance(spec, list):
        name = "records" if any(isinstance(p, Mapping) for p in spec) else "prompts"
        return Dataset(name, tuple(_inline(p, i) for i, p in enumerate(spec)))
    if spec is None or not isinstance(spec, (DataSpec, dict)):
        raise DataError(f"data must be a task, a file, prompts or a Dataset, not {type(spec).__name__}",
                        code="data_invalid", remedy="pass {task: ioi, n: 16}, {path: file.jsonl}, a prompt string, "
                        "a list of prompts, or an entoscope Dataset")
    if isinstance(spec, dict):
        spec = DataSpec(**spec)
    spec.check()
    data = _load(spec, tokenizer)
    if spec.limit is not None:
        data = data[: spec.limit]
    return data


def _load(spec: DataSpec, tokenizer: Any) -> Dataset:
    if spec.task is not None:
        from . import tasks

        kwargs = spec.task_kwargs()
        if tokenizer is not None and "tokenizer" not in kwargs:
            kwargs["tokenizer"] = tokenizer
        data = tasks.get(spec.task, **kwargs)
        params = {"task": spec.task, **{k: v for k, v in kwargs.items() if k != "tokenizer"}}
        return Dataset(data.name, data.examples, data.description, params)
    if spec.prompts is not None:
        return Dataset("prompts", tuple(_inline(p, i) for i, p in enumerate(spec.prompts)),
                       params={"prompts": spec.prompts})
    if spec.path is not None:
        return read_records(spec.path)
    return _load_hf(spec)


def read_records(path: str | Path) -> Dataset:
    """Examples from a .jsonl or .csv file (see the module docstring for the field names)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"no data file at {p}", code="data_file_missing", remedy="check the path")
    if p.suffix == ".jsonl":
        records = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{p}:{n} is not valid JSON ({err.msg})", code="data_file_invalid",
                                    remedy="one JSON object per line") from None
    elif p.suffix == ".csv":
        with p.open(newline="") as f:
            records = [dict(r) for r in csv.DictReader(f)]
    else:
        raise DataError(f"{p}: unknown data file type {p.suffix!r}", code="data_file_invalid",
                        remedy="use .jsonl or .csv")
    return Dataset(p.stem, tuple(_example(r, f"{p}:{i + 1}") for i, r in enumerate(records)),
                   params={"path": str(p)})


def _inline(prompt: Any, index: int) -> Example:
    """One element of a list given as data: a prompt (text or token ids), an Example, or a record (a dict with a
    prompt: read as `Dataset.from_records` reads it, so its counterfactual and answers are kept)."""
    if isinstance(prompt, Example):
        return prompt
    if isinstance(prompt, Mapping) and "prompt" not in prompt:
        raise DataError(f"prompt {index} is a dict without a 'prompt' field (fields: {', '.join(map(str, prompt))})",
                        code="record_invalid", remedy="give each record its prompt: es.Dataset.from_records([{"
                        "\"prompt\": ..., \"counterfactual\": ..., \"answer\": ..., \"wrong_answer\": ...}]) "
                        "keeps the counterfactual and answers; docs/data.md")
    try:
        if isinstance(prompt, Mapping):
            return Example.from_record(prompt, f"record {index}")
        return Example(prompt)
    except DataError as err:
        message = err.message if err.message.startswith("record ") else f"prompt {index}: {err.message}"
        raise DataError(message, code=err.code, remedy=err.remedy) from None


def _example(record: Any, where: str) -> Example:
    """One file record (a JSONL object, a CSV row): a CSV's empty cells are absent fields, a cell holding a JSON
    list (answers) or object (roles) is read as JSON, a numeric label as a number; then as in-memory records."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object", code="data_file_invalid",
                        remedy='write one object per line: {"prompt": "...", "answers": [" Mary"], ...}')
    r = dict(record)
    if r.get("prompt") in (None, ""):
        raise DataError(f"{where} has no prompt", code="data_file_invalid",
                        remedy="every record needs a 'prompt' field")
    for key in ("answers", "wrong_answers", "answer", "wrong_answer", "roles", "cf_roles"):
        value = r.get(key)
        if isinstance(value, str) and value.strip()[:1] in ("[", "{") and key not in ("answer", "wrong_answer"):
            try:
                r[key] = json.loads(value)  # a CSV cell holding a JSON list or object
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: {key} {value[:40]!r} is not valid JSON ({err.msg})",
                                code="data_file_invalid", remedy='write a JSON list (["a", "b"]) or object') from None
        if r.get(key) in ("", None) and key in r:
            r.pop(key)
    if r.get("counterfactual") == "":
        r["counterfactual"] = None
    label = r.get("label")
    if isinstance(label, str):
        r["label"] = None if label == "" else _number(label)
    try:
        return Example(**record_fields(r, where, code="data_file_invalid"))
    except DataError as err:
        message = err.message if err.message.startswith(where) else f"{where}: {err.message}"
        raise DataError(message, code=err.code, remedy=err.remedy) from None


def _number(text: str) -> int | float | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _load_hf(spec: DataSpec) -> Dataset:
    try:
        import datasets  # optional dependency: pip install entoscope[datasets]
    except ImportError:
        raise DataError("loading by name needs the `datasets` package", code="datasets_missing",
                        remedy="pip install datasets, or save the data as JSONL and use path:") from None
    try:
        ds = datasets.load_dataset(spec.hf, split=spec.split)
    except Exception as err:  # the datasets library raises many types for an unreachable hub
        raise DataError(f"could not load dataset {spec.hf!r} ({type(err).__name__}: {str(err)[:200]})",
                        code="dataset_unreachable",
                        remedy="on a machine with internet, save it as JSONL and pass path: file.jsonl") from None
    if spec.prompt_field not in ds.column_names:
        raise DataError(f"dataset {spec.hf!r} has no field {spec.prompt_field!r}", code="data_field_missing",
                        remedy=f"set prompt_field to one of {ds.column_names}")
    n = len(ds) if spec.limit is None else min(spec.limit, len(ds))
    examples = []
    for row in ds.select(range(n)):
        answers = (row[spec.answer_field],) if spec.answer_field else ()
        label = row[spec.label_field] if spec.label_field else None
        examples.append(Example(row[spec.prompt_field], answers=answers, label=label))
    return Dataset(spec.hf, tuple(examples), params={"hf": spec.hf, "split": spec.split})
