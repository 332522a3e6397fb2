"""Each config key's one-line doc, read from the one place it is written.

A key is documented once, by the schema that checks it: the `Doc` of a group's dataclass field or of
a `_target_`'s annotated parameter, else the first sentence of that parameter in the callable's
Google-style ``Args:`` docstring (Lightning's Trainer, loggers and callbacks). `--help` (help.py),
the comments on the keys of conf/ and docs/' key tables (reference.py) all come from here."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from trainer.configuration.spec import BY_NAME, GROUPS, RunIdentity, TargetConfig, TopLevelKeys
from trainer.infra.errors import UserError, first_line
from trainer.infra.schema import locate_target, schema_of_callable, schema_of_dataclass

#: The top-level mappings of conf/train.yaml that are not config groups: their own doc, and the
#: dataclass that documents their keys.
TOP_LEVEL_MAPPINGS: dict[str, tuple[str, type]] = {
    "run": ("the run's identity and where runs are kept", RunIdentity),
    "target": ("time to accuracy: when the run first reaches a metric's value (trainer/callbacks/target.py)",
               TargetConfig),
}

#: What the groups say of library classes' arguments (their docstrings are silent, or the framework
#: gives them a meaning of its own); these take precedence over the docstrings.
ARGUMENT_DOCS: dict[Any, Mapping[str, str]] = {cls: docs for group in GROUPS for cls, docs in group.argument_docs.items()}


@dataclass(frozen=True)
class DocumentedKey:
    """One key of a config mapping: its dotted path below the mapping, its value and its doc."""

    path: tuple[str, ...]
    value: Any
    doc: str

    @property
    def depth(self) -> int:
        return len(self.path) - 1

    @property
    def name(self) -> str:
        return ".".join(self.path)


def top_level_docs() -> dict[str, str]:
    """Docs of the keys at the top of conf/train.yaml (the config groups excepted)."""
    return {**dataclass_docs(TopLevelKeys), **{key: doc for key, (doc, _) in TOP_LEVEL_MAPPINGS.items()}}


def group_docs(group: str, values: Mapping[str, Any]) -> dict[str, str]:
    """Docs of the keys of a group's mapping `values` (a top-level mapping such as `run`, or a config
    group) from its declaration: the signature of its `_target_` (or of the library callable whose
    arguments it holds), then the framework's own keys over them."""
    if group in TOP_LEVEL_MAPPINGS:
        return dataclass_docs(TOP_LEVEL_MAPPINGS[group][1])
    declared = BY_NAME.get(group)
    if declared is None:
        return {}
    source = declared.signature or (values.get("_target_") if declared.target else None)
    docs = {key: doc for key, doc in callable_docs(source).items() if key not in declared.hidden} if source else {}
    if declared.keys is not None:
        docs.update(dataclass_docs(declared.keys))
    docs.update(declared.docs)
    return docs


def documented_keys(values: Mapping[str, Any], docs: Mapping[str, str],
                    path: tuple[str, ...] = ()) -> Iterator[DocumentedKey]:
    """Every key of `values`, depth first, with its doc; a nested mapping with a `_target_` (a
    logger, a callback) documents its keys from that target's signature."""
    for key, value in values.items():
        yield DocumentedKey(path + (key,), value, docs.get(key, ""))
        if isinstance(value, Mapping) and value:
            yield from documented_keys(value, nested_docs(value), path + (key,))


def nested_docs(values: Mapping[str, Any]) -> dict[str, str]:
    """Docs of the keys of a mapping inside a group: those of its `_target_`, if it has one."""
    target = values.get("_target_")
    return callable_docs(target) if isinstance(target, str) else {}


def dataclass_docs(cls: type) -> dict[str, str]:
    return {name: field.doc for name, field in schema_of_dataclass(cls).fields.items()}


def callable_docs(target: Any) -> dict[str, str]:
    """``Doc`` annotations of `target`'s parameters, else its docstring's ``Args:`` entries."""
    if isinstance(target, str):
        try:
            target = locate_target("", target)
        except UserError:
            return {}  # --help must answer even for a config that would not run
    schema = schema_of_callable(target)
    from_docstring = _class_docstring_args(target) if inspect.isclass(target) else docstring_args(target)
    framework = ARGUMENT_DOCS.get(target, {})
    from_docstring.update(framework)
    docs = {name: field.doc or from_docstring.get(name, "") for name, field in schema.fields.items()}
    return {**docs, **{name: doc for name, doc in framework.items() if name not in docs}}  # passed on as **kwargs


def _class_docstring_args(cls: type) -> dict[str, str]:
    """A class documents its arguments in its own docstring or in __init__'s (Lightning: both), or,
    for arguments it passes on, in a base class's (EMAWeightAveraging: WeightAveraging's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        docs.update(docstring_args(klass))
        if "__init__" in vars(klass):
            docs.update(docstring_args(vars(klass)["__init__"]))  # its own, as klass.__init__ reads it
    return docs


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
    sentence = re.split(r"(?<=[a-z0-9)])(?<!i\.e)(?<!e\.g)\. ", first_line(text))[0].rstrip(".")
    return sentence if len(sentence) <= 110 else sentence[:107] + "..."
