"""The refusals of ``rfmem mcp``'s tools, as tool errors that name the tool's own argument:
a :class:`~rfmem_fast.serving.Memory` call's refusal (``text``, ``id``, ``items[i]``,
``ids[i]``; an id the user does not hold is "no memory with id"), a text checked up front
with the Memory's own words, and the arguments that fail a tool's schema, one short clause
each instead of pydantic's report (:func:`_argument_errors`).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, TypeVar

from .mcp_sdk import ToolError, ValidationError
from .validate import _check_text

T = TypeVar("T")


_ITEM_REF = re.compile(r"items\[(\d+)\](?:\.id)?")


def _bulk_tool_errors(fn: Callable[[], T], ids: list[str], arg: str) -> T:
    """Run a bulk Memory call for the scoped user; its refusals become tool errors naming
    the tool's argument ``arg`` (``items[i]`` or ``ids[i]``). An id the user does not hold
    (or an unknown user) is "no memory with id", as for one item."""
    try:
        return fn()
    except KeyError as exc:
        i = getattr(exc, "index", None)
        if i is not None:
            raise ToolError(f"{arg}[{i}]: no memory with id {ids[i]!r} (nothing was changed; list_memories or "
                            "search_memories show the ids)") from None
        raise ToolError(str(exc.args[0]) if exc.args else "not found") from None
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if arg != "items":  # delete_memories(ids): items[i].id is ids[i]
            msg = _ITEM_REF.sub(lambda m: f"{arg}[{m.group(1)}]", msg)
        raise ToolError(f"{msg} (nothing was changed)") from None


def _not_found(item_id: Any) -> ToolError:
    return ToolError(f"id: no memory with id {item_id!r} (list_memories or search_memories show the ids)")


def _check_text_arg(text: str, name: str, what: str = "text") -> None:
    """A text argument checked up front by the Memory's own check (blank, lone
    surrogates, length: :func:`rfmem_fast.serving.validate._check_text`), its message as a
    tool error, so a tool refuses a text with the words of Python and HTTP."""
    try:
        _check_text(text, name, what=what)
    except (TypeError, ValueError) as exc:
        raise ToolError(str(exc)) from None


_ARG_NAME = re.compile(r"^(texts|ids)(\[0\])?(?![\w\[])")


def _tool_errors(fn: Callable[[], T], item_id: Any = None, rename: Mapping[str, str] | None = None) -> T:
    """Run a Memory call, its refusals turned into tool errors naming the argument.

    ``rename`` maps the Memory argument a message starts with (``texts`` / ``ids``,
    ``[0]`` included) to the tool's own (``text`` / ``id``) for one-item tools."""
    try:
        return fn()
    except KeyError as exc:
        if item_id is not None:
            raise _not_found(item_id) from None
        raise ToolError(str(exc.args[0]) if exc.args else "not found") from None
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if rename:
            msg = _ARG_NAME.sub(lambda m: rename.get(m.group(1), m.group(0)), msg, count=1)
        raise ToolError(msg) from None


#: the JSON type of an argument's value, as an argument error names it
_JSON_TYPES = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"), (list, "a list"),
               (dict, "an object"), (type(None), "null"))
#: pydantic errors about the value's type: the message adds the type sent
_TYPE_ERRORS = frozenset(("int_type", "int_parsing", "string_type", "float_type", "bool_type", "list_type",
                          "dict_type", "int_from_float", "model_type"))


def _json_type(v: Any) -> str:
    """The JSON type of a parsed argument value, with its article ("a string", "null")."""
    return next((name for t, name in _JSON_TYPES if isinstance(v, t)), type(v).__name__)


def _loc(loc: tuple) -> str:
    """A pydantic error location as the argument's path (``texts[1]``, ``items[0].text``),
    without the tags pydantic puts between a union's branches (``list[constrained-str]``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
    return out or "arguments"


def _argument_errors(exc: ValidationError, arguments: Mapping[str, Any]) -> str:
    """The arguments a tool refused, one short clause each: ``k: input should be greater
    than or equal to 1``, ``texts[0]: input should be a valid string (got an integer)``,
    ``query: required``; for an argument of several accepted shapes (a text or a list of
    texts), the errors of the shape the value was sent in."""
    by_arg: dict[Any, list[dict]] = {}
    for err in exc.errors(include_url=False):
        by_arg.setdefault(err["loc"][0] if err["loc"] else None, []).append(err)
    clauses: list[str] = []
    for arg, errs in by_arg.items():
        tags = {e["loc"][1] for e in errs if len(e["loc"]) > 1 and isinstance(e["loc"][1], str)
                and not e["loc"][1].isidentifier()}
        if len(tags) > 1:  # a union: the branch of the value's own shape (a list, or not)
            sent_list = isinstance(arguments.get(arg), list)
            same = [e for e in errs if len(e["loc"]) > 1 and e["loc"][1] in tags
                    and str(e["loc"][1]).startswith("list[") == sent_list]
            errs = same or errs
        for e in errs:
            kind = e.get("type")
            if kind == "missing":
                text = "required"
            elif kind == "extra_forbidden":
                text = "not a field this tool takes"
            else:
                msg = str(e.get("msg", "invalid"))
                text = msg[:1].lower() + msg[1:]
                if kind in _TYPE_ERRORS:
                    text += f" (got {_json_type(e.get('input'))})"
            clause = f"{_loc(tuple(e['loc']))}: {text}"
            if clause not in clauses:
                clauses.append(clause)
    return "; ".join(clauses)
