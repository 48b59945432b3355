"""load_gpt_oss on broken checkpoints: every bad config.json field or safetensors header is one ModelError that
names the file (and the field or tensor), never transformers' or safetensors' own exception; a layer count
larger than the checkpoint's is refused before any layer is built."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fp4pass.fx  # noqa: E402
from fp4pass.errors import ModelError  # noqa: E402
from fp4pass.examples.gpt_oss_tiny import build_tiny_gpt_oss  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("ckpt") / "two", config={"num_hidden_layers": 2})


def _copy(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(base, out)
    return out


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(edit(config)))


def _set(key, value):
    def edit(config):
        config[key] = value
        return config
    return edit


@pytest.mark.parametrize("edit, words", [
    (_set("num_attention_heads", 0), "num_attention_heads is 0"),             # was ZeroDivisionError
    (_set("num_key_value_heads", "2"), "num_key_value_heads is '2'"),        # was TypeError
    (_set("hidden_size", 1.5), "hidden_size is 1.5"),
    (_set("num_local_experts", True), "num_local_experts is True"),
    (_set("num_experts_per_tok", 9), "num_experts_per_tok 9 is more than num_local_experts 4"),
    (_set("intermediate_size", 48), "intermediate_size 48 is not a multiple of 32"),
    (_set("num_key_value_heads", 3), "not a multiple of num_key_value_heads 3"),
    (_set("quantization_config", "mxfp4"), "quantization_config is str"),     # was AttributeError
    (_set("rope_parameters", [1]), "rope_parameters is list"),
    (_set("swiglu_limit", "7"), "swiglu_limit is '7'"),
    (lambda c: [c], "holds a JSON list"),                                     # was AttributeError
    (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_type": "nope"}}, "config"),  # KeyError
    (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "factor": "x"}}, "config"),  # TypeError
])
def test_bad_config_fields_are_one_model_error_naming_the_file(base, tmp_path, edit, words):
    folder = _copy(base, tmp_path)
    _edit_config(folder, edit)
    with pytest.raises(ModelError) as info:
        fp4pass.fx.load_gpt_oss(folder)
    assert str(folder / "config.json") in str(info.value) and words in str(info.value)


def test_more_layers_than_the_checkpoint_is_refused_before_building(base, tmp_path, monkeypatch):
    import transformers

    folder = _copy(base, tmp_path)
    _edit_config(folder, lambda c: {**{k: v for k, v in c.items() if k != "layer_types"},
                                    "num_hidden_layers": 100000})
    built = []
    monkeypatch.setattr(transformers, "GptOssForCausalLM", lambda *a, **k: built.append(1) or 1 / 0)
    with pytest.raises(ModelError, match="num_hidden_layers is 100000, but the checkpoint's tensors hold 2 layers"):
        fp4pass.fx.load_gpt_oss(folder)
    assert not built
    with pytest.raises(ModelError, match="hold 2 layers"):  # an override is compared the same way
        fp4pass.fx.load_gpt_oss(_copy(base, tmp_path / "o"), num_hidden_layers=3,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _header(data: bytes) -> tuple[dict, bytes]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + length]), data[8 + length:]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _edit_entry(key, field, value):
    def edit(data):
        header, body = _header(data)
        header[key][field] = value
        return _with_header(header, body)
    return edit


NORM = "model.layers.0.input_layernorm.weight"
BLOCKS = "model.layers.1.mlp.experts.down_proj_blocks"


@pytest.mark.parametrize("edit, words", [
    (lambda d: b"", "0 bytes, shorter than the 8-byte header length"),
    # the words of the shared safetensors reader (fp4pass.safetensors.files), which the checkpoint door uses too
    (lambda d: struct.pack("<Q", 1 << 40) + d[8:], "header length 1099511627776 is over the"),
    (lambda d: d[:8] + b"\xff" * 16 + d[24:], "header is not valid JSON"),
    (lambda d: d[: len(d) // 2], "truncated: its data ends at byte"),                 # truncated data
    (_edit_entry(NORM, "data_offsets", [0, 10 ** 12]), f"tensor '{NORM}': data_offsets span 1000000000000 bytes"),
    (_edit_entry(BLOCKS, "dtype", "F64"), f"tensor '{BLOCKS}': "),
    (_edit_entry(BLOCKS, "dtype", "Q4"), f"tensor '{BLOCKS}': unknown dtype 'Q4'"),
    (_edit_entry(NORM, "shape", [3]), f"tensor '{NORM}': data_offsets span 256 bytes, but F32 [3] needs 12"),
])
def test_corrupted_safetensors_are_one_model_error_naming_file_and_tensor(base, tmp_path, edit, words):
    folder = _copy(base, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(edit(path.read_bytes()))
    with pytest.raises(ModelError) as info:
        fp4pass.fx.load_gpt_oss(folder)
    assert str(path) in str(info.value) and words in str(info.value)


def test_a_tensor_of_the_wrong_shape_names_its_file_and_key(base, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(base, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[NORM] = torch.ones(32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match=rf"model.safetensors: tensor {NORM} \({NORM}\) has shape \[32\]"):
        fp4pass.fx.load_gpt_oss(folder)


def test_config_that_is_not_a_regular_file_is_refused(base, tmp_path):
    folder = _copy(base, tmp_path)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ModelError, match=r"config.json: a character device; only regular files are read"):
        fp4pass.fx.load_gpt_oss(folder)
