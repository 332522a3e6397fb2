"""Checking plain config values against type hints, one clear line per mistake.

OmegaConf's structured configs check types, but they cannot express ranges or ``Literal``
choices, they cannot describe a ``_target_`` whose schema is the constructor's own signature, and
their messages span several lines. So this module deliberately replaces that layer: a schema is
either a dataclass (the framework's own groups) or a callable's signature (anything built from
``_target_``: data modules, models, loggers, a team's own ``nn.Module``), and every mismatch
becomes a `UserError` naming the full key."""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import importlib.util
import inspect
import math
import operator
import os
import sys
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Mapping, Optional, Union

from trainer.infra.errors import UserError, choices


@dataclass(frozen=True)
class Range:
    """A numeric bound carried in ``Annotated[float, Range(gt=0)]``."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def text(self) -> str:
        return " and ".join(f"{op} {bound}" for op, bound, _ in self._limits() if bound is not None)

    def violation(self, value: float) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        return next((f"must be {op} {bound}" for op, bound, holds in self._limits()
                     if bound is not None and not holds(value, bound)), None)

    def _limits(self) -> tuple[tuple[str, float | None, Callable[[float, float], bool]], ...]:
        return ((">", self.gt, operator.gt), (">=", self.ge, operator.ge), ("<", self.lt, operator.lt),
                ("<=", self.le, operator.le))


@dataclass(frozen=True)
class Doc:
    """A field's one-line description, carried in ``Annotated[int, Range(ge=1), Doc("...")]`` (the
    form PEP 727 proposed): the schema keeps it, `python train.py --help` shows it beside the key."""

    text: str


POSITIVE = Range(gt=0)
NON_NEGATIVE = Range(ge=0)
AT_LEAST_ONE = Range(ge=1)
FRACTION = Range(ge=0, le=1)
#: a rate or a momentum: 0 allowed, 1 not
UnitInterval = Annotated[float, Range(ge=0, lt=1)]


@dataclass(frozen=True)
class Field:
    name: str
    annotation: Any
    required: bool
    default: Any = None
    doc: str = ""


@dataclass(frozen=True)
class Schema:
    """Named fields plus whether unknown keys pass through (a ``**kwargs`` signature)."""

    fields: Mapping[str, Field]
    open: bool = False


def schema_of_dataclass(cls: type) -> Schema:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        default = f.default if f.default is not dataclasses.MISSING else None
        annotation = hints.get(f.name, Any)
        fields[f.name] = Field(f.name, annotation, required=not has_default, default=default, doc=doc_of(annotation))
    return Schema(fields)


def doc_of(annotation: Any) -> str:
    """The `Doc` text of an ``Annotated`` type, or empty."""
    if typing.get_origin(annotation) is typing.Annotated:
        return next((a.text for a in typing.get_args(annotation)[1:] if isinstance(a, Doc)), "")
    return ""


def schema_of_callable(target: Callable[..., Any], skip: tuple[str, ...] = ()) -> Schema:
    """The keyword parameters of a class constructor or a function, with their type hints."""
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return Schema({}, open=True)
    fields: dict[str, Field] = {}
    open_ = _add_parameters(fields, signature, _type_hints(fn), skip)
    if open_ and inspect.isclass(target):
        # A subclass that forwards **kwargs to its parent accepts the parent's keywords: follow
        # them up the hierarchy so a data module need not repeat its base's loader arguments.
        for base in target.__mro__[1:-1]:  # the parents, less `object` (always last)
            init = base.__dict__.get("__init__")
            if init is None:
                continue
            open_ = _add_parameters(fields, inspect.signature(init), _type_hints(init), skip, inherited=True)
            if not open_:
                break
    return Schema(fields, open=open_)


def _add_parameters(fields: dict[str, Field], signature: inspect.Signature, hints: dict[str, Any],
                    skip: tuple[str, ...], inherited: bool = False) -> bool:
    """Add keyword parameters not yet in `fields`; return whether the signature takes **kwargs.
    A parent's parameters (`inherited`) are never required: the child may pass them itself."""
    var_keyword = False
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
            continue
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            continue
        if name in skip or name == "self" or name in fields:
            continue
        required = param.default is inspect.Parameter.empty
        annotation = hints.get(name, Any)
        fields[name] = Field(name, annotation, required and not inherited, None if required else param.default,
                             doc_of(annotation))
    return var_keyword


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:
        # Libraries annotate with names imported only under TYPE_CHECKING; evaluate what we can
        # one parameter at a time and leave the rest unchecked rather than guess.
        module = sys.modules.get(getattr(fn, "__module__", ""), None)
        namespace = dict(vars(module)) if module else {}
        hints = {}
        for name, ann in getattr(fn, "__annotations__", {}).items():
            if isinstance(ann, str):
                try:
                    ann = eval(ann, namespace)  # noqa: S307 - annotations of installed code
                except Exception:
                    ann = Any
            hints[name] = ann
        return hints


def check_mapping(prefix: str, values: Mapping[str, Any], schema: Schema, what: str) -> dict[str, Any]:
    """Check `values` against `schema`; return them with defaults filled in.
    `prefix` is the full key of the mapping (``data``), `what` names the schema in messages
    (``DigitsDataModule``)."""
    result: dict[str, Any] = {}
    for key, value in values.items():
        full_key = f"{prefix}.{key}" if prefix else str(key)
        field = schema.fields.get(key)
        if field is None:
            if schema.open:
                result[key] = value
                continue
            raise UserError(full_key, f"unknown key for {what}", choices(sorted(schema.fields)))
        check_value(full_key, value, field.annotation)
        result[key] = value
    for name, field in schema.fields.items():
        if name in result:
            continue
        if field.required:
            full_key = f"{prefix}.{name}" if prefix else name
            raise UserError(full_key, f"missing (required by {what})", describe(field.annotation))
        result[name] = field.default
    return result


def check_value(full_key: str, value: Any, annotation: Any) -> None:
    if not matches(value, annotation):
        raise UserError(full_key, f"{_show(value)} is not {describe(annotation)}")
    matched, bounds = _matched(annotation, value)
    for bound in bounds:
        problem = bound.violation(value)
        if problem:
            raise UserError(full_key, f"{_show(value)} {problem}")
    if isinstance(value, (list, tuple)):
        for i, (item, item_annotation) in enumerate(zip(value, _item_annotations(matched, value))):
            check_value(f"{full_key}[{i}]", item, item_annotation)


def _matched(annotation: Any, value: Any) -> tuple[Any, list[Range]]:
    """What `value` (known to match `annotation`) matched: the type inside ``Annotated``, a union's
    first member it matches; and the ranges that apply to it on the way there."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        inner, bounds = _matched(args[0], value)
        return inner, [a for a in args[1:] if isinstance(a, Range)] + bounds
    if origin is Union or origin is types.UnionType:
        return _matched(next(arg for arg in args if matches(value, arg)), value)
    return annotation, []


def _item_annotations(annotation: Any, value: list[Any] | tuple[Any, ...]) -> list[Any]:
    """The annotation of each element of a list `value` of the (matched) `annotation`."""
    args = typing.get_args(annotation)
    if not args:
        return []
    if typing.get_origin(annotation) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return list(args)
    return [args[0]] * len(value)


def matches(value: Any, annotation: Any) -> bool:
    if annotation is Any or annotation is inspect.Parameter.empty or isinstance(annotation, (str, typing.TypeVar, typing.ForwardRef)):
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return matches(value, args[0])
    if origin is Union or origin is types.UnionType:
        return any(matches(value, arg) for arg in args)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if annotation is None or annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (os.PathLike,) or (inspect.isclass(annotation) and issubclass(annotation, os.PathLike)):
        return isinstance(value, str)
    sequence_types = (list, tuple, collections.abc.Sequence, collections.abc.Iterable, collections.abc.MutableSequence)
    if annotation in sequence_types or origin in sequence_types:
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args:
            if len(args) == 2 and args[1] is Ellipsis:
                return all(matches(v, args[0]) for v in value)
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
        return all(matches(v, args[0]) for v in value) if args else True
    mapping_types = (dict, collections.abc.Mapping, collections.abc.MutableMapping)
    if annotation in mapping_types or origin in mapping_types:
        if not isinstance(value, dict):
            return False
        if args:
            return all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
        return True
    if isinstance(value, dict) and "_target_" in value:
        return True  # a nested object Hydra will instantiate; its own constructor checks it
    if inspect.isclass(annotation):
        return isinstance(value, annotation)
    return True  # Callable, Protocol and the like cannot come from YAML; leave them to the callee


def describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any or annotation is inspect.Parameter.empty:
        return "any value"
    if origin is typing.Annotated:
        bounds = [b for b in args[1:] if isinstance(b, Range)]
        return " ".join([describe(args[0])] + [b.text() for b in bounds])
    if origin is Union or origin is types.UnionType:
        return " or ".join(dict.fromkeys(describe(arg) for arg in args))
    if origin is Literal:
        return "one of " + choices(_show(a) for a in args)
    if annotation is None or annotation is type(None):
        return "null"
    if annotation in (bool, int, float, str):
        return {"bool": "true/false", "int": "an integer", "float": "a number", "str": "a string"}[annotation.__name__]
    if origin in (list, tuple, collections.abc.Sequence) or annotation in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} ({', '.join(describe(a) for a in args)})"
        return f"a list of {describe(args[0])}" if args else "a list"
    if origin in (dict, collections.abc.Mapping) or annotation is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# --- a config group, as its room declares it ----------------------------------------------------

@dataclass(frozen=True)
class ConfigGroup:
    """A config group as the module that owns it declares it (``GROUP = ConfigGroup(...)``): the one
    schema style of every group. Its keys are the fields of a dataclass (`keys`: the framework's
    own), the constructor arguments of the `_target_` a choice names (`target`), or both (the
    optimizer: the batch rules are the framework's, the rest is torch's or timm's); `validate` turns
    a choice's plain values into what the run reads, and raises `UserError` naming the full key."""

    name: str
    #: The module that owns the group (its schema, rules and builder): ``trainer.groups.optimizer``.
    module: str
    #: What a choice of the group chooses, in a few words (--help, docs/architecture.md).
    chooses: str
    validate: Optional[Callable[[dict[str, Any]], Any]]
    keys: Optional[type] = None
    #: Whether a choice names a `_target_` whose constructor takes (the rest of) its keys.
    target: bool = False
    #: A callable whose signature documents the keys when no `_target_` names one (the Trainer).
    signature: Optional[Callable[..., Any]] = None
    #: Docs of keys the framework adds to the group that neither the dataclass nor a target documents.
    docs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Docs the framework gives the arguments of library classes the group builds, where their
    #: docstrings are silent or the framework gives them a meaning of its own: {class: {argument: doc}}.
    argument_docs: Mapping[Any, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    #: Arguments of `signature` that are not this group's keys (the framework sets them elsewhere).
    hidden: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """The owning module as a path in the checkout: ``trainer/groups/precision.py``, or a folder."""
        found = importlib.util.find_spec(self.module)
        package = found is not None and found.submodule_search_locations is not None
        return self.module.replace(".", "/") + ("/" if package else ".py")


def check_keys(prefix: str, values: Mapping[str, Any], cls: type, **extra: Any) -> Any:
    """`values` checked against the dataclass `cls` (with `extra` fields given as they are), the
    instance's own `check(prefix)` run, lists of a tuple field made tuples."""
    checked = check_mapping(prefix, values, schema_of_dataclass(cls), f"{prefix} ({cls.__name__})")
    for name, field in schema_of_dataclass(cls).fields.items():
        if isinstance(checked.get(name), list) and _is_tuple(field.annotation):
            checked[name] = tuple(checked[name])
    instance = cls(**checked, **extra)
    check = getattr(instance, "check", None)
    if check:
        check(prefix)
    return instance


def _is_tuple(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_tuple(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return any(_is_tuple(arg) for arg in typing.get_args(annotation))
    return origin is tuple or annotation is tuple


def check_target(prefix: str, values: Mapping[str, Any], skip: tuple[str, ...] = (),
                 also: Optional[Schema] = None, filled_from: str = "",
                 bounds: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """A `_target_` mapping checked against the target's signature: only what the person wrote
    (defaults stay the callee's), plus Hydra's keys. `skip`: arguments the framework fills in
    (`filled_from` says from what), refused in the config; `also`: the framework's own keys beside
    the target's (checked by the caller), accepted here and named among the allowed keys; `bounds`:
    tighter annotations for some arguments than the signature's."""
    target_path = values.get("_target_")
    if not isinstance(target_path, str) or not target_path:
        raise UserError(f"{prefix}._target_", "missing", "the import path of a class or function (pkg.module.Name)")
    target = locate_target(prefix, target_path)
    kwargs = {k: v for k, v in values.items() if not (k.startswith("_") and k.endswith("_"))}
    for name in skip:
        if name in kwargs and (also is None or name not in also.fields):
            raise UserError(f"{prefix}.{name}", f"is filled in by the framework{filled_from}", "remove the key")
    schema = schema_of_callable(target, skip=skip)
    if bounds:  # tighter than the signature's own types (a constructor that checks only when it runs)
        schema = Schema({name: dataclasses.replace(f, annotation=bounds.get(name, f.annotation))
                         for name, f in schema.fields.items()}, open=schema.open)
    if also is not None:
        optional = {name: dataclasses.replace(f, required=False) for name, f in also.fields.items()}
        schema = Schema({**optional, **schema.fields}, open=schema.open)
    checked = check_mapping(prefix, kwargs, schema, target_path)
    out = {k: v for k, v in values.items() if k.startswith("_") and k.endswith("_")}
    out.update({k: checked[k] for k in kwargs})
    return out


def locate_target(prefix: str, path: str) -> Any:
    """Import `path` (``pkg.module.Name``); a failure names the key and the missing part."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as ex:
            if ex.name and (module_name == ex.name or module_name.startswith(ex.name + ".")):
                continue  # this prefix is not a module; try a shorter one
            reason = f"importing '{module_name}' failed: {ex}"
            break
        except Exception as ex:  # noqa: BLE001 - the person's module failed to import
            reason = f"importing '{module_name}' failed: {type(ex).__name__}: {ex}"
            break
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                reason = f"'{module_name}' has no attribute '{attribute}'"
                break
            obj = getattr(obj, attribute)
            module_name = f"{module_name}.{attribute}"
        else:
            return obj
        break
    else:
        reason = f"no module named '{parts[0]}'"
    raise UserError(f"{prefix}._target_", f"cannot import '{path}': {reason}",
                    "an importable class or function (pkg.module.Name)")
