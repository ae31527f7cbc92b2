"""The one loader of the project's TOML files: recipes, eval configs and benchmark definitions.

A file is parsed into a typed, frozen model (`Table`s that reject unknown keys); `--set key.path=value`
overrides apply on top, so precedence is defaults < file < `--set`. Every error is one line,
`FILE: key.path: problem` (`FILE (--set)` when an override caused it), phrased for the file's author.
Imports neither torch nor vLLM.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo

from m2po_cli.errors import UserError


class ConfigError(UserError):
    """A user-fixable configuration problem: `file: key.path: message`."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + message)


class Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def field(default: Any, description: str, **kw: Any) -> Any:
    return Field(default, description=description, **kw)


T = TypeVar("T", bound=Table)


FILES = "files"  # the validation context's key: whether fields that name files are checked against the disk


def checks_files(info: ValidationInfo) -> bool:
    """Whether a validator should check the files and folders its fields name (`load(files=...)`)."""
    return bool((info.context or {}).get(FILES, True))


def load(
    model: type[T],
    path: Path | None,
    overrides: Sequence[str] = (),
    *,
    default_source: str = "defaults",
    prepare: Callable[[dict[str, Any]], None] | None = None,
    before_set: Callable[[dict[str, Any], str, Any], None] | None = None,
    files: bool = True,
) -> T:
    """`path` (or only the defaults when None) with `--set` overrides, validated into `model`.

    `before_set(tree, key, value)` sees the tree before each override applies (e.g. to switch a
    table's type); `prepare` adjusts the raw tree before validation (e.g. TOML arrays into tuples).
    `files=False` skips the checks of files and folders a field names (`checks_files`): a run
    directory's recipe read on another machine. Raises ConfigError.
    """
    source = str(path) if path is not None else default_source
    tree = read_toml(path) if path is not None else {}
    via_set = f"{source} (--set)"
    overridden = []
    for text in overrides:
        key, value = parse_override(text, via_set)
        if before_set is not None:
            before_set(tree, key, value)
        set_path(tree, key, value, via_set)
        overridden.append(key)
    if prepare is not None:
        prepare(tree)
    try:
        return model.model_validate(tree, context={FILES: files})
    except ValidationError as e:
        key, msg = describe(e, model)
        hit = any(f"{key}.".startswith(f"{k}.") or f"{k}.".startswith(f"{key}.") for k in overridden)
        raise ConfigError(via_set if hit else source, key, msg) from None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), "", f"invalid TOML: {e}") from None


def parse_override(text: str, source: str = "--set") -> tuple[str, Any]:
    """`key.path=value`, where value is a TOML value, or a bare string when it does not parse."""
    key, sep, raw = (part.strip() for part in text.partition("="))
    if not sep or not re.fullmatch(r"\w+(\.\w+)*", key):
        raise ConfigError(source, text, "expected key.path=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def set_path(tree: dict[str, Any], key: str, value: Any, source: str = "--set") -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(source, key, f"{part} is not a table")
    node[leaf] = value


# --- error messages ------------------------------------------------------------------------------

_TYPE_NAMES = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "dict_type": "a table",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _show(value: Any) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def _tables(annotation: Any) -> list[type[Table]]:
    """The tables an annotation can hold: itself, the members of a union, the items of a list."""
    if isinstance(annotation, type) and issubclass(annotation, Table):
        return [annotation]
    return [t for arg in get_args(annotation) for t in _tables(arg)]


def _tag(table: type[Table]) -> Any:
    return table.model_fields["type"].default if "type" in table.model_fields else None


def _walk(root: type[Table], loc: Sequence[str | int]) -> tuple[Any, list[str]]:
    """The annotation that pydantic's error location `loc` points at, and `loc` as the file's author
    writes it: without the tags that pydantic adds for a discriminated union (loss.m2po.tau)."""
    at: Any = root
    shown: list[str] = []
    for part in loc:
        options = _tables(at)
        if isinstance(part, int):  # an item of an array
            shown.append(str(part))
            continue
        tagged = [t for t in options if len(options) > 1 and _tag(t) == part]
        if tagged:
            at = tagged[0]
            continue
        owner = next((t for t in options if part in t.model_fields), None)
        at = owner.model_fields[part].annotation if owner is not None else None
        shown.append(str(part))
    return at, shown


def _table(root: type[Table], loc: Sequence[str | int]) -> type[Table] | None:
    options = _tables(_walk(root, loc)[0])
    return options[0] if len(options) == 1 else None


def describe(err: ValidationError, root: type[Table]) -> tuple[str, str]:
    """(key.path, problem) of the first validation error, phrased for the file's author."""
    e = err.errors(include_url=False)[0]
    raw = list(e["loc"])
    at, loc = _walk(root, raw)
    key = ".".join(loc)
    kind, got = e["type"], e.get("input")
    if kind == "missing" and raw and isinstance(raw[-1], int):
        # A missing item of a fixed-length array (optim.betas.1): report the array's length.
        raw, loc, kind = raw[:-1], loc[:-1], "too_short"
        at, key = _walk(root, raw)[0], ".".join(loc)
    if kind in ("too_short", "too_long"):
        return key, f"must be an array of {len(get_args(at))} items (got {_show(got)})"
    if kind == "extra_forbidden":
        what = "table" if isinstance(got, dict) else "key"
        parent = _table(root, raw[:-1])
        known = f"; expected one of {', '.join(parent.model_fields)}" if parent is not None else ""
        return key, f"unknown {what}{known}"
    if kind == "missing":
        return key, f"required {'table' if _tables(at) else 'key'} is missing"
    if kind == "value_error":
        # Our validators name the sub-key themselves: "sub: message".
        msg = e["msg"].removeprefix("Value error, ")
        if re.match(r"^[\w.]+: ", msg):
            sub, msg = msg.split(": ", 1)
            loc = sub.split(".") if sub.split(".")[0] in root.model_fields and not loc else loc + [sub]
        return ".".join(loc), msg
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = [str(_tag(t)) for t in _tables(at)]
        choices = f"choose one of {', '.join(tags)}"
        if kind == "union_tag_not_found":
            return f"{key}.type", f"required key is missing; {choices}"
        return f"{key}.type", f"unknown {loc[-1]} type; {choices} (got {got.get('type')!r})"
    if kind in _BOUNDS:
        limit = next(iter(e["ctx"].values()))
        return key, f"must be {_BOUNDS[kind]} {limit} (got {_show(got)})"
    if kind in _TYPE_NAMES:
        return key, f"must be {_TYPE_NAMES[kind]} (got {_show(got)})"
    msg = re.sub(r"^(Input|String|Tuple|List|Value) should", "must", e["msg"])
    return key, f"{msg[0].lower()}{msg[1:]} (got {_show(got)})"


def to_toml(config: BaseModel) -> str:
    """A fully resolved config as TOML (for a recipe: what `--dry-run` prints and the run directory keeps)."""
    lines: list[str] = []

    def emit(prefix: str, table: dict[str, Any]) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            if v is not None:
                lines.append(f"{k} = {toml_value(v)}")
        for k, v in table.items():
            if isinstance(v, dict):
                emit(f"{prefix}.{k}" if prefix else k, v)

    emit("", config.model_dump(mode="python"))
    return "\n".join(lines).lstrip() + "\n"


def toml_value(v: Any) -> str:
    """One value as a TOML literal."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'
