"""The front doors of the command line: what each input kind is recognised by, and which flags are its own.

A command takes its input through one of three doors: a checkpoint folder (``config.json`` + safetensors, or a
Hugging Face Hub model ID, ``org/name[@revision]``), an NVFP4 checkpoint folder (a kind of checkpoint folder:
``inspect`` validates it against the engines), or an ONNX model file (whatever is not a folder). Each command
says, once, in an :class:`Entrance` record, which of its flags belong to which door; a flag of another door
given with the input is refused with one line generated here, never silently ignored:

- a flag of the ONNX door: ``--target applies to ONNX models, not to checkpoint folders``;
- a flag of a folder door: ``--format applies to checkpoint folders; model.onnx is not one`` (``... is not a
  folder`` for an NVFP4 folder's flag given with a file);

each command may word a door's refusal its own way (``diff``: "give --data") and add a hint to one flag's.
A flag counts as given when its value differs from its parser default (``--target trt``, the default, is not
refused). Every other flag is shared by the doors of its command.

Why one record per command: the doors' flags were hand lists in each command module (five of them), each with
its own refusal loop, so a flag added to one door could be forgotten in another command's list and then be
ignored without a word. ``tests/cli/test_cmd_doors.py`` checks that every flag named here is a flag of its command
and belongs to one door only.

A Hub ID is resolved once per command (:func:`resolve`), into its snapshot folder, before the door is refined
(an NVFP4 folder is told from its files).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fp4pass.errors import UsageError


def _is_checkpoint(path, args) -> bool:
    """A folder, or a Hugging Face Hub model ID with no local path of that name."""
    from fp4pass.safetensors.hub import parse_hub_id

    return path is not None and (os.path.isdir(path) or (parse_hub_id(path) is not None and not os.path.lexists(path)))


def _is_nvfp4(path, args) -> bool:
    from fp4pass.checkpoint.validate import is_nvfp4_folder

    return is_nvfp4_folder(path, follow_symlinks=bool(getattr(args, "follow_symlinks", False)))


@dataclass(frozen=True)
class Door:
    """One kind of input. ``accepts(path, args)``: whether ``path`` comes in through this door (tried in the
    order of :data:`DOORS`; a door ``within`` another is tried once its parent took the input, on the resolved
    path). ``refusal``: the line for one of this door's flags given with another door's input (``{flag}``,
    ``{noun}``: this door's, ``{given}``: the other door's noun, ``{path}``, ``{what}``: ``one``, or the parent's
    ``kind`` when the input is not even of the parent's kind)."""

    name: str
    noun: str
    accepts: Callable[[object, object], bool]
    refusal: str
    within: Door | None = None
    kind: str = ""

    def refuse(self, flag: str, given: Door, path, wording: str | None = None) -> str:
        what = "one" if self.within is None or given is self.within else self.within.kind
        return (wording or self.refusal).format(flag=flag, noun=self.noun, given=given.noun, path=path, what=what)


CHECKPOINT_FOLDER = Door("checkpoint", "checkpoint folders", _is_checkpoint, "{flag} applies to {noun}; {path} is not "
                         "{what}", kind="a folder")
NVFP4_FOLDER = Door("nvfp4", "NVFP4 checkpoint folders", _is_nvfp4, "{flag} applies to {noun}; {path} is not {what}",
                    within=CHECKPOINT_FOLDER)
ONNX_FILE = Door("onnx", "ONNX models", lambda path, args: True, "{flag} applies to {noun}, not to {given}")
#: every door, in the order an input is tried (the ONNX file last: it takes what no folder door does)
DOORS = (CHECKPOINT_FOLDER, NVFP4_FOLDER, ONNX_FILE)


@dataclass(frozen=True)
class Entrance:
    """One command's doors. ``own``: door name -> the dest names of the flags only that door reads, in the order
    they are refused; ``wording``: door name -> this command's refusal line for that door's flags (else the
    door's own); ``hints``: dest -> words added to that flag's refusal; ``model``: the argument holding the
    input."""

    command: str
    own: Mapping[str, tuple[str, ...]]
    wording: Mapping[str, str] = field(default_factory=dict)
    hints: Mapping[str, str] = field(default_factory=dict)
    model: str = "model"

    def doors(self) -> tuple[Door, ...]:
        return tuple(d for d in DOORS if d.name in self.own)

    def door_of(self, dest: str) -> Door | None:
        return next((d for d in self.doors() if dest in self.own[d.name]), None)


_CALIBRATION_FLAGS = ("device", "seq_len", "num_samples", "trust_remote_code")  # a checkpoint folder's calibration

CONVERT = Entrance("convert", {
    "checkpoint": ("overwrite", "format", "input_scale", "max_shard_size", "allow_partial", "follow_symlinks",
                   "engine", *_CALIBRATION_FLAGS, "calib_batch_size"),
    "onnx": ("scale_form", "target", "external_data", "snr_min", "keep_unchecked", "provider", "strict",
             "allow_invalid", "inputs", "shape", "past_length"),
}, hints={"overwrite": " (an ONNX output file is replaced anyway, never an input)",
          "inputs": " (a checkpoint folder's calibration data is --calib DATA)"})
INSPECT = Entrance("inspect", {
    "checkpoint": ("follow_symlinks",),
    "nvfp4": ("engine", "strict"),
    "onnx": ("allow_invalid",),
}, wording={"onnx": "{flag} applies to {noun}, not to {given} ({path} is one)"})
CALIBRATE = Entrance("calibrate", {
    "checkpoint": _CALIBRATION_FLAGS,
    "onnx": ("provider", "strict", "activation", "allow_invalid"),
})
DIFF = Entrance("diff", {
    "checkpoint": ("data", "seq_len", "num_samples", "batch_size", "kl_max", "device", "follow_symlinks",
                   "trust_remote_code"),
    "onnx": ("inputs", "shape", "past_length", "seed", "provider", "strict", "allow_invalid", "intermediates"),
}, wording={"onnx": "{flag} applies to {noun}; {path} is a checkpoint folder (give --data)"},
    hints={"data": " (ONNX models take their inputs as --inputs DATA.npz)"}, model="original")
#: every command's doors, by command name
ENTRANCES = {e.command: e for e in (CONVERT, INSPECT, CALIBRATE, DIFF)}


def open_doors(parser, entrance: Entrance) -> None:
    """Record on ``parser`` (a command's) the defaults of its doors' flags, against which "given" is judged; a
    dest named in ``entrance`` that the parser lacks is a bug of this table, caught when the parser is built."""
    dests = {action.dest for action in parser._actions}
    named = [dest for flags in entrance.own.values() for dest in flags]
    missing = [dest for dest in named if dest not in dests]
    if missing:
        raise AssertionError(f"fp4pass {entrance.command}: no flag {missing[0]!r} for its doors")
    parser.set_defaults(door_defaults={dest: parser.get_default(dest) for dest in named})


def given(args, dest: str) -> bool:
    """Whether ``--dest`` was given: its value differs from its parser default."""
    default = getattr(args, "door_defaults", {}).get(dest)
    return getattr(args, dest, default) != default


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _foreign(owner: Door, door: Door, settled: bool) -> bool:
    """Whether ``owner``'s flags are refused to an input of ``door``: not its own nor its parent's, nor (until the
    input is ``settled``, told apart as NVFP4 or not) those of a door within it."""
    return owner is not door and owner is not door.within and (settled or owner.within is not door)


def refuse_foreign(args, entrance: Entrance, door: Door, path=None, settled: bool = True) -> None:
    """Exit 2 (:class:`UsageError`) naming the first flag given that belongs to another door than ``door``
    (:func:`_foreign`), in the order of :data:`DOORS`, then of the entrance's list."""
    path = getattr(args, entrance.model) if path is None else path
    for owner in entrance.doors():
        if not _foreign(owner, door, settled):
            continue
        for dest in entrance.own[owner.name]:
            if given(args, dest):
                line = owner.refuse(_flag(dest), door, path, entrance.wording.get(owner.name))
                raise UsageError(line + entrance.hints.get(dest, ""))


def door_of(args, entrance: Entrance, path=None) -> Door:
    """The door ``path`` (default: the command's input) comes in through, among the command's doors that lie
    within no other (a folder is told apart as NVFP4 later, by :func:`refine`, once resolved)."""
    path = getattr(args, entrance.model) if path is None else path
    return next(d for d in entrance.doors() if d.within is None and d.accepts(path, args))


def refine(args, entrance: Entrance, door: Door) -> Door:
    """The door within ``door`` that takes the (resolved) input, else ``door`` itself."""
    path = getattr(args, entrance.model)
    return next((d for d in entrance.doors() if d.within is door and d.accepts(path, args)), door)


def resolve(path, args):
    """A Hugging Face Hub model ID's snapshot folder in the local Hub cache, fetched first where needed
    (:func:`fp4pass.safetensors.hub.resolve_checkpoint`; download bars hidden under --quiet); any other path as given."""
    from fp4pass.safetensors.hub import resolve_checkpoint

    return resolve_checkpoint(path, show_progress=False if getattr(args, "quiet", False) else None)


def enter(args, entrance: Entrance) -> Door:
    """The command's input door, its Hub ID (if it is one) resolved once into ``args.<model>`` (the argument
    as given stays in ``args.given_model`` for the JSON files' provenance)."""
    door = door_of(args, entrance)
    if door is CHECKPOINT_FOLDER:
        setattr(args, entrance.model, resolve(getattr(args, entrance.model), args))
    return door
