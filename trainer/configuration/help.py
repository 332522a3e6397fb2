"""The composed config as `python train.py --help` shows it: every key with its one-line doc.

The docs come from trainer/configuration/key_docs.py (the schema that checks each key)."""

from __future__ import annotations

from typing import Any, Mapping

import yaml

from trainer.configuration.key_docs import documented_keys, group_docs, top_level_docs
from trainer.configuration.spec import BY_NAME
from trainer.configuration.usage import with_comment

DOC_COLUMN = 40


def annotated_config(config: Mapping[str, Any], choices: Mapping[str, Any]) -> str:
    """`config` (the composed job config, plain containers) as YAML lines with ``# doc`` comments;
    each group's header names its choice and the module that consumes it."""
    lines: list[str] = []
    top_docs = top_level_docs()
    for key, value in config.items():
        if key == "hydra":
            continue
        if isinstance(value, dict):
            header = top_docs.get(key) or _group_header(key, choices)
            lines.append(_line(0, f"{key}:", header))
            lines += [_key_line(item) for item in documented_keys(value, group_docs(key, value))]
        else:
            lines.append(_line(0, f"{key}: {show(value)}", top_docs.get(key, "")))
    return "\n".join(lines)


def _group_header(group: str, choices: Mapping[str, Any]) -> str:
    choice = choices.get(group)
    declared = BY_NAME.get(group)
    module, what = (declared.where, declared.chooses) if declared else ("", "")
    parts = [f"{group}={choice}" if choice else "", what, module]
    return "; ".join(part for part in parts if part)


def _key_line(item: Any) -> str:
    key, value = item.path[-1], item.value
    if isinstance(value, dict) and value:
        target = value.get("_target_")
        return _line(item.depth + 1, f"{key}:", f"builds {target}" if target else item.doc)
    return _line(item.depth + 1, f"{key}: {show(value)}", item.doc)


def _line(depth: int, text: str, doc: str) -> str:
    return with_comment("  " * depth + text, doc, DOC_COLUMN)


def show(value: Any) -> str:
    """A value as one line of YAML."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()
