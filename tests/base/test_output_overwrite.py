"""``convert CKPT --overwrite`` replaces only a folder fp4pass wrote, and only once the new one is complete;
``convert CKPT --calib`` reports the calibration as the input scales' source, with its figures.

Every command runs in-process through ``fp4pass.cli.main`` on the bundled checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import cli, one_line

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
MOE, CALIB = MODELS / "moe.onnx", MODELS / "calib.npz"
KIMI = MODELS / "checkpoints" / "deepseek_v3"
TEXT = MODELS / "checkpoints" / "calib_text.jsonl"


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- --overwrite for checkpoint output folders -----------------------------------------------------------------


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_temporaries(folder: Path) -> None:
    from fp4pass.io import TMP_PREFIX

    assert not [p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_a_second_run_is_refused_without_overwrite_and_replaces_with_it(work, capsys):
    from fp4pass.io import OUTPUT_MARKER

    assert cli(capsys, "convert", KIMI, "-o", "out", "--quiet")[0] == 0
    first = _tree(work / "out")
    assert json.loads(first[OUTPUT_MARKER])["written_by"] == "fp4pass"
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--format", "compressed-tensors")
    assert code == 2 and "out: exists and is not empty" in one_line(err) and "--overwrite" in one_line(err)
    assert _tree(work / "out") == first
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--format", "compressed-tensors", "--overwrite", "--quiet")
    assert code == 0, err
    second = _tree(work / "out")
    assert json.loads(second["config.json"])["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "hf_quant_config.json" in first and "hf_quant_config.json" not in second  # nothing of the old one left
    assert OUTPUT_MARKER in second
    _no_temporaries(work)


@pytest.mark.parametrize("marker", [None, "not json", '{"written_by": "someone else"}', "link"])
def test_overwrite_refuses_a_folder_fp4pass_did_not_write(work, capsys, marker):
    from fp4pass.io import OUTPUT_MARKER

    folder = work / "theirs"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"keep me")
    if marker == "link":  # a link to a real marker elsewhere is not this folder's own
        (work / "real.json").write_text('{"written_by": "fp4pass"}')
        (folder / OUTPUT_MARKER).symlink_to(work / "real.json")
    elif marker is not None:
        (folder / OUTPUT_MARKER).write_text(marker)
    before = _tree(folder)
    code, err = cli(capsys, "convert", KIMI, "-o", folder, "--overwrite")
    line = one_line(err)
    assert code == 2 and f"{folder}: exists and was not written by fp4pass (it holds no {OUTPUT_MARKER})" in line
    assert _tree(folder) == before and (folder / "weights.bin").read_bytes() == b"keep me"
    _no_temporaries(work)


def test_overwrite_keeps_the_old_folder_when_the_new_one_fails(work, capsys, monkeypatch):
    """The old folder goes only once the new one is complete: a failure while writing leaves it whole."""
    import fp4pass.checkpoint.run as run
    from fp4pass.safetensors.files import CheckpointError

    assert cli(capsys, "convert", KIMI, "-o", "out", "--quiet")[0] == 0
    first = _tree(work / "out")

    def broken(folder):
        assert (Path(folder) / "model.safetensors").exists()  # the new folder was being written
        raise CheckpointError("planted failure after the shards were written")

    monkeypatch.setattr(run, "validate_own_output", broken)
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--overwrite", "--format", "compressed-tensors")
    assert code == 2 and "planted failure" in one_line(err)
    assert _tree(work / "out") == first
    _no_temporaries(work)


def test_overwrite_never_replaces_the_input_and_is_refused_for_onnx(work, capsys):
    import shutil

    from fp4pass.io import OUTPUT_MARKER

    source = work / "src"
    shutil.copytree(KIMI, source)
    (source / OUTPUT_MARKER).write_text('{"written_by": "fp4pass"}')
    before = _tree(source)
    code, err = cli(capsys, "convert", source, "-o", source, "--overwrite")
    assert code == 2 and "is, is inside, or holds the input folder" in one_line(err) and _tree(source) == before
    code, err = cli(capsys, "convert", MOE, "-o", "x.onnx", "--overwrite")
    assert code == 2 and "--overwrite applies to checkpoint folders" in one_line(err)
    assert not (work / "x.onnx").exists()


def test_an_onnx_output_file_is_still_replaced_without_overwrite(work, capsys):
    (work / "x.onnx").write_bytes(b"old")
    assert cli(capsys, "convert", MOE, "-o", "x.onnx", "--quiet")[0] == 0
    assert (work / "x.onnx").read_bytes() != b"old"


# -- convert CKPT --calib: where the input scales came from ----------------------------------------------------


def _text_tokens() -> list[int]:
    """Each row's token count, by the tokenizers package on the checkpoint's own tokenizer.json."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(KIMI / "tokenizer.json"))
    rows = [json.loads(line)["text"] for line in TEXT.read_text().splitlines() if line.strip()]
    return [len(tokenizer.encode(text, add_special_tokens=False).ids) for text in rows]


def test_convert_calib_reports_the_calibration_as_the_source(work, capsys, caplog):
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--calib", TEXT, "--seq-len", "16", "--num-samples", "2",
                    "--report", "r.json")
    assert code == 0, err
    counts = _text_tokens()
    assert counts[0] > 32 and len(counts) > 1  # the first row alone fills both samples: the rest is left out
    assert (f"{TEXT}: 2 sequence(s) of --seq-len 16 (32 tokens) taken; left out: {counts[0] - 32} more tokens "
            "of row 1 and every row after it") in caplog.text
    scales = json.loads((work / "r.json").read_text())["input_scales"]
    assert scales["source"] == "calibration" and scales["unmatched_keys"] == []
    calibration = scales["calibration"]
    assert calibration["tokens"] == 32 and calibration["calibrator"] == "max" and calibration["layers"] == 2
    rows = {row["name"]: row for row in calibration["tensors"]}
    assert "model.layers.0.mlp.experts.0.w1" in rows and "model.layers.1.self_attn.o_proj" in rows
    from safetensors import safe_open

    with safe_open(str(work / "out" / "model.safetensors"), framework="pt") as written:
        for name, row in rows.items():  # each module's input_scale is its calibration's g_amax / 2688
            assert float(written.get_tensor(f"{name}.input_scale")) == pytest.approx(row["g_amax"] / 2688, rel=1e-6)


@pytest.mark.parametrize("seq_len, num_samples", [(48, None), (7, 1000)])
def test_text_too_short_for_another_sequence_is_noted(caplog, seq_len, num_samples):
    """Every row read: the tail that fills no sequence is named (and a --num-samples not reached)."""
    import logging

    from fp4pass.checkpoint.calib_data import load_batches

    total = sum(_text_tokens())
    with caplog.at_level(logging.INFO, logger="fp4pass"):
        batches = load_batches(TEXT, KIMI, vocab_size=1 << 30, seq_len=seq_len, num_samples=num_samples)
    rows = total // seq_len
    assert total % seq_len, "a tail to leave out"
    assert sum(b.input_ids.shape[0] for b in batches) == rows
    short = f", fewer than the --num-samples {num_samples} asked" if num_samples else ""
    assert (f"{rows} sequence(s) of --seq-len {seq_len} ({rows * seq_len} tokens) taken{short}; left out: the last "
            f"{total % seq_len} tokens, too few for another sequence") in caplog.text
