"""Where a traced graph keeps its weights, and how a pass reads, adds and removes them.

Two holders, one interface (:class:`GraphConstants`):

1. :class:`ModuleConstants` - a ``torch.fx.GraphModule`` (``symbolic_trace``, ``ExportedProgram.module()``):
   a weight is a ``get_attr`` node whose target names a tensor attribute of the module or a submodule.
2. :class:`ProgramConstants` - a ``torch.export.ExportedProgram``: parameters, buffers and tensor constants
   are lifted to placeholders; ``graph_signature.input_specs`` maps each placeholder to its ``state_dict``
   (or ``constants``) entry. New tensors become persistent buffers, their placeholders placed after the
   existing lifted inputs (before the user inputs, as the signature requires), each with a fake value from
   the program's fake mode so that the result can be saved with ``torch.export.save`` and re-exported.
   The input program is not modified: the holder works on a copy of its graph module.

``add(name, tensor)`` registers a tensor under a dotted name (the module path of the weight it belongs to)
and returns the node that reads it; ``drop(node)`` removes a node that nothing reads any more and, when no
other node reads the same tensor, the tensor itself; ``result()`` gives back the same kind as came in.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.fx

from fp4pass.errors import UsageError

__all__ = ["GraphConstants", "ModuleConstants", "ProgramConstants", "constants_of", "copy_graph_module",
           "program_module"]


def copy_graph_module(gm: torch.fx.GraphModule, memo: dict | None = None) -> torch.fx.GraphModule:
    """A deep copy of ``gm`` whose nodes keep ``gm``'s names.

    torch.fx's copy gives each node a fresh name from its namespace, which renames a node named after a Python
    builtin: ``torch.export`` names the placeholder of ``forward(self, input)`` (``nn.Sequential``'s) ``input``,
    the copy would call it ``input_1``, and the program's graph signature, or a calibration target found on the
    original graph, would no longer name it. ``memo`` is ``copy.deepcopy``'s (tensors to share, not copy).
    """
    with warnings.catch_warnings():  # torch's own pytree specs warn about their deprecated LeafSpec on copy
        warnings.simplefilter("ignore", FutureWarning)
        copied = copy.deepcopy(gm, memo)
    renamed = False
    for original, node in zip(gm.graph.nodes, copied.graph.nodes):
        if node.name != original.name:
            node.name = original.name  # as torch.export names its placeholders: set, not drawn from the namespace
            renamed = True
    if renamed:
        copied.recompile()
    return copied


def program_module(program) -> torch.fx.GraphModule:
    """``program.module()`` (weights as attributes, runnable) whose inputs keep the program's names.

    ``module()`` renames an input named after a Python builtin (``input`` -> ``input_1``); a calibration target
    or a diff row found on the program's graph names the program's node, so the names are set back: the
    module's placeholders are the program's user inputs, in the signature's order.
    """
    from torch.export.graph_signature import InputKind

    module = program.module()
    names = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(names) != len(placeholders) or all(n.name == name for n, name in zip(placeholders, names)):
        return module
    taken = {n.name for n in module.graph.nodes} - {n.name for n in placeholders}
    if taken & set(names):
        return module  # a program's name already held by another node: keep torch's
    for node, name in zip(placeholders, names):
        node.name = name
    module.recompile()
    return module


class GraphConstants:
    """The interface both holders implement (see the module docstring)."""

    kind: str
    graph_module: torch.fx.GraphModule

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def tensor(self, node: torch.fx.Node) -> tuple[str, torch.Tensor] | None:
        """(name, tensor) when ``node`` reads a stored tensor, else None."""
        raise NotImplementedError

    def describe(self, node) -> str:
        """What ``node`` is, for a message saying why it is not a stored tensor."""
        if not isinstance(node, torch.fx.Node):
            return f"a {type(node).__name__} argument"
        if node.op == "placeholder":
            return f"graph input {node.name!r}"
        target = getattr(node.target, "__name__", str(node.target))
        return f"computed in the graph by {target} ({node.name})"

    def add(self, name: str, tensor: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
        raise NotImplementedError

    def drop(self, node: torch.fx.Node) -> None:
        raise NotImplementedError

    def result(self):
        raise NotImplementedError


def _set_path(root: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as buffer ``name`` (dotted), creating empty submodules on the way."""
    *path, attr = name.split(".")
    owner = root
    for part in path:
        child = getattr(owner, part, None)
        if not isinstance(child, torch.nn.Module):
            child = torch.nn.Module()
            owner.add_module(part, child)
        owner = child
    if hasattr(owner, attr) and attr not in owner._buffers:
        raise UsageError(f"cannot add buffer {name!r}: the module already has an attribute of that name")
    owner.register_buffer(attr, tensor)


def _del_path(root: torch.nn.Module, name: str) -> None:
    *path, attr = name.split(".")
    owner = root
    for part in path:
        owner = getattr(owner, part)
    for store in (owner._buffers, owner._parameters):
        store.pop(attr, None)
    if attr in owner.__dict__:
        delattr(owner, attr)


class ModuleConstants(GraphConstants):
    """Weights of a GraphModule: ``get_attr`` nodes (rewritten in place)."""

    kind = "GraphModule"

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph_module = gm

    def tensor(self, node):
        if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
            return None
        obj = self.graph_module
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
        return (node.target, obj) if isinstance(obj, torch.Tensor) else None

    def unique_name(self, name: str) -> str:
        out, i = name, 1
        while _has_path(self.graph_module, out):
            out, i = f"{name}_{i}", i + 1
        return out

    def add(self, name, tensor, before):
        name = self.unique_name(name)
        _set_path(self.graph_module, name, tensor)
        with self.graph.inserting_before(before):
            return self.graph.get_attr(name)

    def drop(self, node):
        if node.users:
            return
        target = node.target if node.op == "get_attr" else None
        self.graph.erase_node(node)
        if target is not None and not any(n.op == "get_attr" and n.target == target for n in self.graph.nodes):
            _del_path(self.graph_module, target)

    def result(self):
        self.graph.lint()
        self.graph_module.recompile()
        return self.graph_module


def _has_path(root: torch.nn.Module, name: str) -> bool:
    obj = root
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


class ProgramConstants(GraphConstants):
    """Weights of an ExportedProgram: lifted placeholders (works on a copy; ``result()`` is a new program)."""

    kind = "ExportedProgram"

    def __init__(self, program) -> None:
        from torch._guards import detect_fake_mode
        from torch.export.graph_signature import InputKind

        self._kinds = InputKind
        self.program = program
        self.graph_module = copy_graph_module(program.graph_module)
        self.specs = list(program.graph_signature.input_specs)
        self.state_dict = dict(program.state_dict)
        self.constants = dict(program.constants)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self._by_name = {spec.arg.name: spec for spec in self.specs if hasattr(spec.arg, "name")}
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
        self._taken = {*self.state_dict, *self.constants, *(s.target for s in self.specs if s.target)}

    def _lifted(self, spec) -> bool:
        kinds = self._kinds
        return spec.kind in (kinds.PARAMETER, kinds.BUFFER, kinds.CONSTANT_TENSOR)

    def tensor(self, node):
        if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
            return None
        spec = self._by_name.get(node.name)
        if spec is None or not self._lifted(spec):
            return None
        value = self.state_dict.get(spec.target, self.constants.get(spec.target))
        return (spec.target, value) if isinstance(value, torch.Tensor) else None

    def describe(self, node):
        if isinstance(node, torch.fx.Node) and node.op == "placeholder":
            spec = self._by_name.get(node.name)
            if spec is not None and spec.kind == self._kinds.USER_INPUT:
                return f"user input {node.name!r}"
            if spec is not None and spec.kind == self._kinds.BUFFER and not spec.persistent:
                return f"non-persistent buffer {spec.target!r}"
        return super().describe(node)

    def unique_name(self, name: str) -> str:
        out, i = name, 1
        while out in self._taken:
            out, i = f"{name}_{i}", i + 1
        return out

    def add(self, name, tensor, before):
        from torch.export.graph_signature import InputSpec, TensorArgument

        name = self.unique_name(name)
        self._taken.add(name)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        lifted = [n for n in placeholders if self._lifted(self._by_name[n.name])]
        anchor = lifted[-1] if lifted else None
        if anchor is None:
            ctx = self.graph.inserting_before(placeholders[0] if placeholders else None)
        else:
            ctx = self.graph.inserting_after(anchor)
        with ctx:
            node = self.graph.placeholder("b_" + name.replace(".", "_"))
        if self.fake_mode is not None:
            node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        spec = InputSpec(kind=self._kinds.BUFFER, arg=TensorArgument(name=node.name), target=name, persistent=True)
        index = self.specs.index(self._by_name[anchor.name]) + 1 if anchor is not None else 0
        self.specs.insert(index, spec)
        self._by_name[node.name] = spec
        self.state_dict[name] = tensor
        return node

    def drop(self, node):
        if node.users:
            return
        spec = self._by_name.pop(node.name, None) if node.op == "placeholder" else None
        self.graph.erase_node(node)
        if spec is None:
            return
        self.specs.remove(spec)
        if spec.target is not None and not any(s.target == spec.target for s in self.specs):
            self.state_dict.pop(spec.target, None)
            self.constants.pop(spec.target, None)

    def _output_specs(self):
        from torch.export.graph_signature import OutputSpec, TensorArgument

        (output,) = [n for n in self.graph.nodes if n.op == "output"]
        args = torch.fx.node.map_arg(output.args[0], lambda n: n)
        flat = list(args) if isinstance(args, (list, tuple)) else [args]
        specs = []
        for spec, arg in zip(self.program.graph_signature.output_specs, flat):
            if isinstance(spec.arg, TensorArgument) and isinstance(arg, torch.fx.Node):
                spec = OutputSpec(kind=spec.kind, arg=TensorArgument(name=arg.name), target=spec.target)
            specs.append(spec)
        return specs

    def result(self):
        from torch.export.graph_signature import ExportGraphSignature

        self.graph.lint()
        self.graph_module.recompile()
        signature = ExportGraphSignature(input_specs=self.specs, output_specs=self._output_specs())
        with warnings.catch_warnings():  # as in __init__: torch copies its module call graph
            warnings.simplefilter("ignore", FutureWarning)
            return self.program._update(self.graph_module, signature, state_dict=self.state_dict,
                                        constants=self.constants)


def constants_of(model) -> GraphConstants:
    """The holder for ``model`` (an ExportedProgram or a GraphModule); a UsageError for anything else."""
    if isinstance(model, torch.export.ExportedProgram):
        return ProgramConstants(model)
    if isinstance(model, torch.fx.GraphModule):
        return ModuleConstants(model)
    raise UsageError(
        f"fp4pass.fx.convert takes a torch.export.ExportedProgram or a torch.fx.GraphModule, not "
        f"{type(model).__name__}; trace it first: torch.export.export(model, example_args)"
    )
