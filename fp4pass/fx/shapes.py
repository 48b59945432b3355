"""Input shapes against what a ``torch.export.ExportedProgram`` was traced for: one clear error, before running.

``torch.export.export(model, args)`` fixes every dim of every input unless ``dynamic_shapes`` marks it
dynamic (``torch.export.Dim``); running the program at another size then fails inside torch with
``AssertionError: Guard failed: input_ids.size()[1] == 32``, after any earlier batch has run.
:func:`check_inputs` compares the inputs with the program's user-input placeholders first:

- a static dim (an int in the placeholder's fake value) must be equal;
- a dynamic dim (a ``SymInt``) must lie in its ``range_constraints`` range;
- the rank must be equal.

A mismatch is a :class:`~fp4pass.errors.ShapeError` that names the input, the dim, both sizes, and shows how
to export that dim as dynamic. :func:`guard_error` turns torch's own guard failure (a relation between dims
that the per-dim check cannot see) into the same kind of error.

:func:`input_problem` finds data that fits the shapes but not the model: an input with no elements, and for
an input read as token ids by an ``aten.embedding`` (directly or through view ops), a float dtype or an id
outside ``[0, vocabulary)``.
"""

from __future__ import annotations

import re

import torch
from torch.utils import _pytree as pytree

from fp4pass.errors import ShapeError

__all__ = ["check_inputs", "guard_error", "dynamic_hint", "input_problem"]

_GUARD = re.compile(r"Guard failed: (.*)")


def dynamic_hint(name: str, dim: int) -> str:
    """How to export input ``name``'s dim ``dim`` as dynamic."""
    label = "batch" if dim == 0 else "seq" if dim == 1 else f"d{dim}"
    return (f"export it as dynamic: torch.export.export(model, args, dynamic_shapes={{{name!r}: "
            f"{{{dim}: torch.export.Dim({label!r})}}}}) (docs/fx.md, dynamic shapes)")


def _user_placeholders(program) -> list[torch.fx.Node]:
    from torch.export.graph_signature import InputKind

    kinds = {spec.arg.name: spec.kind for spec in program.graph_signature.input_specs if hasattr(spec.arg, "name")}
    return [n for n in program.graph.nodes if n.op == "placeholder" and kinds.get(n.name) == InputKind.USER_INPUT]


def _flat_inputs(program, args: tuple, kwargs: dict) -> list | None:
    """The inputs in the order of the program's user inputs, or None when they cannot be lined up."""
    spec = getattr(program.call_spec, "in_spec", None)
    if kwargs and spec is not None and len(spec.children_specs) == 2:
        keys = spec.children_specs[1].context or []
        if set(keys) == set(kwargs):
            kwargs = {k: kwargs[k] for k in keys}
    flat, flat_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if spec is not None and flat_spec != spec:
        return None
    return flat


def check_inputs(program, args: tuple, kwargs: dict, what: str) -> None:
    """ShapeError naming ``what`` (e.g. "calibration batch #3"), the input and the dim, when the inputs do not
    fit the shapes ``program`` (an ExportedProgram) was exported for; nothing for another kind of model."""
    if not isinstance(program, torch.export.ExportedProgram):
        return
    placeholders = _user_placeholders(program)
    flat = _flat_inputs(program, args, kwargs)
    if flat is None or len(flat) != len(placeholders):
        return  # torch's own input check says what does not fit the signature
    ranges = program.range_constraints
    for node, value in zip(placeholders, flat):
        fake = node.meta.get("val")
        if not isinstance(fake, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if value.dim() != fake.dim():
            raise ShapeError(f"{what}: input {node.name!r} has {value.dim()} dims {list(value.shape)}; the program "
                             f"was exported with {fake.dim()}")
        for dim, (expected, got) in enumerate(zip(fake.shape, value.shape)):
            if isinstance(expected, int):
                if expected != got:
                    raise ShapeError(f"{what}: input {node.name!r} dim {dim} is {got}, but the program was exported "
                                     f"with that dim fixed at {expected}; {dynamic_hint(node.name, dim)}")
                continue
            symbol = getattr(expected, "node", None)
            bounds = ranges.get(getattr(symbol, "expr", None)) if symbol is not None else None
            if bounds is None:
                continue
            low, high = _bound(bounds.lower), _bound(bounds.upper)
            if (low is not None and got < low) or (high is not None and got > high):
                span = f"[{0 if low is None else low}, {'inf' if high is None else high}]"
                raise ShapeError(f"{what}: input {node.name!r} dim {dim} is {got}, outside the range {span} the "
                                 "program was exported for (torch.export.Dim min/max)")


def _bound(value) -> int | None:
    """A range end as an int, None when unbounded (sympy's infinities)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def guard_error(exc: BaseException, what: str) -> ShapeError | None:
    """The ShapeError for torch's ``Guard failed: ...`` assertion (a dim fixed or related at export), or None
    for any other exception."""
    match = _GUARD.search(str(exc))
    if not isinstance(exc, (AssertionError, RuntimeError)) or match is None:
        return None
    condition = match.group(1).strip().splitlines()[0]
    fixed = re.match(r"(\w+)\.size\(\)\[(\d+)\] == (\d+)$", condition)
    hint = dynamic_hint(fixed.group(1), int(fixed.group(2))) if fixed else \
        "export the dims that vary with torch.export.Dim (docs/fx.md, dynamic shapes)"
    return ShapeError(f"{what}: the inputs break a shape the program was exported with ({condition}); {hint}")


_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "contiguous", "clone", "alias",
          "expand", "slice", "select"}


def _vocabularies(program) -> dict[str, int]:
    """User input name -> the row count of the embedding table that reads it as indices."""
    out: dict[str, int] = {}
    for node in _user_placeholders(program):
        stack = [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                if user.op != "call_function":
                    continue
                name = getattr(user.target, "_opname", getattr(user.target, "__name__", ""))
                if name == "embedding" and len(user.args) > 1 and user.args[1] is current:
                    table = user.args[0].meta.get("val") if isinstance(user.args[0], torch.fx.Node) else None
                    if isinstance(table, torch.Tensor) and isinstance(table.shape[0], int):
                        out[node.name] = min(out.get(node.name, table.shape[0]), table.shape[0])
                elif name in _VIEWS and user.args and user.args[0] is current:
                    stack.append(user)
    return out


def input_problem(program, args: tuple, kwargs: dict) -> str | None:
    """What is wrong with the values of the inputs (module docstring), or None."""
    if not isinstance(program, torch.export.ExportedProgram):
        flat = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        empty = next((v for v in flat if v.numel() == 0), None)
        return None if empty is None else f"an input has no elements (shape {list(empty.shape)})"
    placeholders = _user_placeholders(program)
    flat = _flat_inputs(program, args, kwargs)
    if flat is None or len(flat) != len(placeholders):
        return None
    vocab = _vocabularies(program)
    for node, value in zip(placeholders, flat):
        if not isinstance(value, torch.Tensor):
            continue
        if value.numel() == 0:
            return f"input {node.name!r} has no elements (shape {list(value.shape)})"
        if node.name not in vocab:
            continue
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return f"input {node.name!r} is {value.dtype}; it holds token ids, which are integers (int64)"
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= vocab[node.name]:
            bad = low if low < 0 else high
            return (f"input {node.name!r} holds token id {bad}, outside the vocabulary [0, {vocab[node.name]}) of "
                    "the embedding that reads it")
    return None
