"""What every command checks before it starts: flag values, the provider, its outputs against its inputs."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from fp4pass import messages
from fp4pass.choices import CheckProvider, Provider, values
from fp4pass.errors import UsageError
from fp4pass.io import check_outputs

# Plot formats matplotlib's Agg backend writes (Figure.canvas.get_supported_filetypes()).
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "raw", "rgba")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def thread_count(text: str) -> int:
    """argparse type: a thread count from 1 to what this machine can start (:func:`fp4pass.convert.max_threads`:
    4 per CPU, within the user's process limit); more fails in OpenMP (or crashes) instead of helping."""
    from fp4pass.convert import check_threads

    value = positive_int(text)
    try:
        return check_threads(value, "")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def seed(text: str) -> int:
    """argparse type: a seed for numpy's generator, 0 <= seed < 2^63."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2^63)")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def plot_path(text: str) -> str:
    """argparse type: a file name whose suffix names a format matplotlib writes (.png, .pdf, .svg, ...)."""
    suffix = Path(text).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a .png file (or {', '.join('.' + f for f in PLOT_FORMATS[1:5])}, ...)")
    return text


def add_provider_arguments(p, reference: bool = False) -> None:
    """--provider and --strict; ``reference``: "reference" (onnx.reference, for the checks) is a choice too."""
    choices = values(CheckProvider) if reference else values(Provider)
    p.add_argument("--provider", choices=choices, default=Provider.AUTO.value,
                   help="auto: CUDA if onnxruntime's CUDA provider loads, else CPU (default)"
                        + ("; reference: onnx.reference (numpy, slow; runs what onnxruntime CPU cannot, "
                           "e.g. bfloat16 MatMul)" if reference else ""))
    p.add_argument("--strict", action="store_true",
                   help="with --provider cuda: exit 2 when CUDA cannot run, instead of falling back to CPU")


def add_allow_invalid(p) -> None:
    p.add_argument("--allow-invalid", action="store_true",
                   help="go on with a model the ONNX checker refuses (it is refused by default)")


def check_provider(args) -> None:
    """``--provider cuda`` where onnxruntime cannot run CUDA: a note on stderr, or exit 2 with ``--strict``."""
    if getattr(args, "provider", None) != "cuda":
        return
    from fp4pass.onnx.runtime import cuda_available

    ok, why = cuda_available()
    if ok:
        return
    if args.strict:
        raise UsageError(f"--provider cuda --strict: {why}")
    messages.warning(f"fp4pass {args.command}: warning: --provider cuda: {why}; falling back to CPU "
                     "(--strict to refuse)")


#: files of a safetensors checkpoint, which is read as a whole folder
CHECKPOINT_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json")
#: text calibration data: tokenized with a checkpoint folder's tokenizer, never fed to an ONNX graph
TEXT_DATA_SUFFIXES = (".jsonl", ".txt")


def refuse_checkpoint_file(path: str | os.PathLike | None) -> None:
    """A shard (or the index) of a safetensors checkpoint given where its folder is wanted: name the folder."""
    if path is None or os.path.isdir(path):
        return
    name = os.path.basename(os.fspath(path))
    if name.endswith(CHECKPOINT_FILE_SUFFIXES):
        folder = os.path.dirname(os.fspath(path)) or "."
        raise UsageError(f"{path}: one file of a safetensors checkpoint; give the checkpoint folder that holds "
                         f"it and its config.json ({folder})")


def refuse_text_data(flag: str, path: str | os.PathLike | None, model: str | os.PathLike) -> None:
    """Text data (.jsonl, .txt) given to an ONNX model: it takes arrays named after its graph inputs."""
    if path is None or not os.fspath(path).endswith(TEXT_DATA_SUFFIXES):
        return
    from fp4pass.onnx.loading import load

    inputs = ", ".join(v.name for v in load(model).model.graph.inputs) or "none"
    raise UsageError(f"{flag} {path}: text is calibration data for checkpoint folders (tokenized with their "
                     f"tokenizer.json); an ONNX model takes an .npz with one array per graph input ({inputs}), or "
                     "a folder of them")


def model_inputs(label: str, path: str | os.PathLike | None) -> dict[str, str]:
    """A model file and the external data files it names, labelled for :func:`fp4pass.io.check_outputs`; a
    checkpoint's shard given for the model is refused (:func:`refuse_checkpoint_file`)."""
    if path is None:
        return {}
    refuse_checkpoint_file(path)
    from fp4pass.onnx.loading import external_data_paths

    found = {label: os.fspath(path)}
    for i, data in enumerate(external_data_paths(path)):
        found[f"{label}'s external data #{i}"] = data
    return found


def check_model(args, *paths) -> None:
    """Refuse models the ONNX checker refuses, unless ``--allow-invalid`` (the file must be readable first)."""
    if getattr(args, "allow_invalid", False):
        return
    from fp4pass.onnx.loading import check_model_file, load

    for path in paths:
        if path is not None:
            load(path)  # a malformed file gets its own, more precise message first
            check_model_file(path)


def check_files(outputs: dict, inputs: dict) -> None:
    check_outputs(outputs, inputs)
