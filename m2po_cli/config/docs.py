"""The recipe reference (`docs/recipes.md`), rendered from the schema in `m2po_cli/config/`.

One section per table, one row per key with its type, default, description and range; the `[loss]`
table gets one sub-section per loss type. Regenerate with

    python -m m2po_cli.config.docs > docs/recipes.md

(a test fails when the file and the schema disagree).
"""

from __future__ import annotations

import sys
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from m2po_cli.config import Recipe, Table
from m2po_cli.config.tables import toml_value

INTRO = """\
<!-- Generated from m2po_cli/config/ by `python -m m2po_cli.config.docs > docs/recipes.md`; do not edit. -->

# Recipe reference

A recipe is a TOML file, one table per section below: `m2po train RECIPE.toml`. Each value comes from,
in increasing precedence, the default listed here, the recipe file, and `--set key.path=value` on the
command line (the value is read as TOML, or as a bare string when it does not parse:
`--set optim.lr=1e-4 --set run.name=lr-1e-4`). Unknown tables and keys are errors, as are values of
the wrong type or out of range; each error is one line naming the file, the key path and the value,
e.g. `recipes/quickstart.toml: loss.tau: must be > 0.0 (got -1.0)`, or `recipes/quickstart.toml (--set): ...`
when an override is at fault. `m2po train RECIPE --dry-run` prints the fully resolved recipe; the run
directory keeps the same text.
"""

CROSS_CHECKS = """\
## Checks across tables

- `rollout.n` must be at least 2 when `algorithm.normalize_std` is true (a group of one has no std).
- `train.mini_batch_prompts` must divide `rollout.prompts_per_step`; the quotient is the number of
  optimizer updates per rollout batch.
- `staleness.s` must be a multiple of the updates per rollout batch: the staleness FIFO holds
  K = s / updates batches.
"""

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="))
_SCALARS = {bool: "bool", int: "int", float: "float", str: "string"}
_LONG = 40  # defaults longer than this are shown below the table, not in it


def render() -> str:
    """The whole reference, as markdown."""
    parts = [INTRO]
    for name, info in Recipe.model_fields.items():
        parts.extend(_sections(name, info))
    parts.append(CROSS_CHECKS)
    return "\n".join(parts)


def _sections(path: str, info: FieldInfo) -> list[str]:
    """The section of the table at `path` and those of its sub-tables."""
    ann = info.annotation
    head = f"## `[{path}]`\n\n{info.description}"
    if isinstance(ann, type):
        subtables = [(k, f) for k, f in ann.model_fields.items() if _is_table(f.annotation)]
        out = [f"{head}{_required(info)}\n\n{_table(ann)}"]
        for key, sub in subtables:
            out.extend(_sections(f"{path}.{key}", sub))
        return out
    # A union of tables told apart by their `type` key (the losses).
    out = [f'{head} Default: `type = "{info.default.type}"`.\n']
    for table in get_args(ann):
        tag = table.model_fields["type"]
        out.append(f'### `type = "{tag.default}"`\n\n{tag.description}\n\n{_table(table, skip="type")}')
    return out


def _required(info: FieldInfo) -> str:
    return " Required." if info.default is PydanticUndefined else ""


def _table(table: type[Table], skip: str = "") -> str:
    rows = ["| key | type | default | description | constraints |", "|---|---|---|---|---|"]
    notes: list[str] = []
    for key, info in table.model_fields.items():
        if key == skip or _is_table(info.annotation):
            continue
        default = _default(info)
        if len(default) > _LONG:
            notes.append(f"Default of `{key}`:\n\n```toml\n{key} = {default[1:-1]}\n```\n")
            default = "see below"
        cells = [f"`{key}`", _type(info.annotation), default, info.description or "", _constraints(info)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if len(rows) == 2:
        return "No other keys.\n"
    return "\n".join(rows) + "\n" + "".join(f"\n{n}" for n in notes)


def _is_table(ann: Any) -> bool:
    if isinstance(ann, type) and issubclass(ann, Table):
        return True
    return _is_union(ann) and all(_is_table(a) for a in get_args(ann))


def _is_union(ann: Any) -> bool:
    return get_origin(ann) in (Union, types.UnionType)


def _type(ann: Any) -> str:
    if ann in _SCALARS:
        return _SCALARS[ann]
    if get_origin(ann) is Literal:
        return ", ".join(f"`{toml_value(v)}`" for v in get_args(ann))
    if get_origin(ann) is tuple:
        items = get_args(ann)
        return f"array of {len(items)} {_type(items[0])}s"
    if get_origin(ann) is list:
        return f"array of {_type(get_args(ann)[0])}s"
    if _is_union(ann):
        inner = [a for a in get_args(ann) if a is not type(None)]
        return " or ".join(_type(a) for a in inner) + (
            " (optional)" if len(inner) < len(get_args(ann)) else ""
        )
    raise TypeError(f"no documentation rule for the annotation {ann!r}")


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined:
        return "required"
    if info.default is None:
        return "unset"
    return f"`{toml_value(info.default)}`"


def _constraints(info: FieldInfo) -> str:
    found = []
    for meta in info.metadata:
        for attr, symbol in _BOUNDS:
            if getattr(meta, attr, None) is not None:
                found.append(f"{symbol} {getattr(meta, attr)}")
    return ", ".join(found)


if __name__ == "__main__":
    sys.stdout.write(render())
