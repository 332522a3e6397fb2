"""The composed config as `python train.py --help` shows it: every key with its one-line doc.

The docs come from the schemas that check the keys: the `Doc` of a framework group's dataclass
field (trainer/configuration/spec.py), or of a `_target_`'s annotated parameter, else the first sentence of
that parameter in the callable's Google-style ``Args:`` docstring (Lightning's Trainer and
loggers, torchvision). Nothing is written twice: a key without a doc is shown without one.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Mapping

import lightning
import yaml

from trainer.configuration.spec import (
    DATACLASS_GROUPS,
    GROUP_MODULES,
    TRAINER_KEYS_OWNED_ELSEWHERE,
    TopLevelKeys,
    RunIdentity,
    TargetConfig,
    locate_target,
)
from trainer.infra.errors import UserError, first_line
from trainer.configuration.schema import schema_of_callable, schema_of_dataclass

DOC_COLUMN = 40


def annotated_config(config: Mapping[str, Any], choices: Mapping[str, Any]) -> str:
    """`config` (the composed job config, plain containers) as YAML lines with ``# doc`` comments;
    each group's header names its choice and the module that consumes it."""
    lines: list[str] = []
    top_docs = _dataclass_docs(TopLevelKeys)
    for key, value in config.items():
        if key == "hydra":
            continue
        if isinstance(value, dict):
            lines.append(_line(0, f"{key}:", _group_header(key, value, choices)))
            _append(lines, value, _docs_of(key, value), 1)
        else:
            lines.append(_line(0, f"{key}: {_show(value)}", top_docs.get(key, "")))
    return "\n".join(lines)


def _group_header(group: str, values: Mapping[str, Any], choices: Mapping[str, Any]) -> str:
    if group == "run":
        return "the run's identity and where runs are kept"
    if group == "target":
        return "time to accuracy: when the run first reaches a metric's value (trainer/callbacks/target.py)"
    choice = choices.get(group)
    module, what = GROUP_MODULES.get(group, ("", ""))
    parts = [f"{group}={choice}" if choice else "", what, module]
    return "; ".join(part for part in parts if part)


def _append(lines: list[str], values: Mapping[str, Any], docs: Mapping[str, str], depth: int) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and value:
            target = value.get("_target_")
            lines.append(_line(depth, f"{key}:", f"builds {target}" if target else docs.get(key, "")))
            _append(lines, value, _callable_docs(target) if target else {}, depth + 1)
        else:
            lines.append(_line(depth, f"{key}: {_show(value)}", docs.get(key, "")))


def _docs_of(group: str, values: Mapping[str, Any]) -> dict[str, str]:
    """Field docs of a group's schema: its dataclass, or the signature of its `_target_`."""
    if group == "run":
        return _dataclass_docs(RunIdentity)
    if group == "target":
        return _dataclass_docs(TargetConfig)
    if group in DATACLASS_GROUPS:
        schemas = DATACLASS_GROUPS[group]
        schema = schemas.get("") or schemas.get(str(values.get("name")))
        return _dataclass_docs(schema) if schema else {}
    if group == "trainer":
        docs = _callable_docs(lightning.Trainer)
        return {k: v for k, v in docs.items() if k not in TRAINER_KEYS_OWNED_ELSEWHERE}
    target = values.get("_target_")
    docs = _callable_docs(target) if target else {}
    if group == "model":
        docs["activation_checkpointing"] = ("stages (dotted module names) recomputed in backward to save "
                                            "activation memory")
    return docs


def _dataclass_docs(cls: type) -> dict[str, str]:
    return {name: field.doc for name, field in schema_of_dataclass(cls).fields.items()}


def _callable_docs(target: Any) -> dict[str, str]:
    """``Doc`` annotations of `target`'s parameters, else its docstring's ``Args:`` entries."""
    if isinstance(target, str):
        try:
            target = locate_target("", target)
        except UserError:
            return {}  # --help must answer even for a config that would not run
    schema = schema_of_callable(target)
    # A class documents its arguments in its own docstring or in __init__'s (Lightning: both).
    from_docstring = {**docstring_args(target), **docstring_args(target.__init__)} if inspect.isclass(target) \
        else docstring_args(target)
    return {name: field.doc or from_docstring.get(name, "") for name, field in schema.fields.items()}


def docstring_args(fn: Any) -> dict[str, str]:
    """The first sentence of each entry of a Google-style ``Args:`` section of `fn`'s docstring."""
    doc = inspect.getdoc(fn) or ""
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    if not match:
        return {}
    entries: dict[str, str] = {}
    current = None
    for raw in match.group(1).splitlines():
        entry = re.match(r"^ {4}(\w+)(?: \([^)]*\))?:\s*(.*)$", raw)
        if entry:
            current = entry.group(1)
            entries[current] = entry.group(2)
        elif current and raw.strip():
            entries[current] += " " + raw.strip()
        elif not raw.strip():
            current = None
    return {name: _first_sentence(text) for name, text in entries.items()}


def _first_sentence(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")
    sentence = re.split(r"(?<=[a-z0-9)])\. ", first_line(text))[0].rstrip(".")
    return sentence if len(sentence) <= 110 else sentence[:107] + "..."


def _line(depth: int, text: str, doc: str) -> str:
    text = "  " * depth + text
    if not doc:
        return text
    return f"{text:<{DOC_COLUMN}} # {doc}" if len(text) < DOC_COLUMN else f"{text}  # {doc}"


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()
