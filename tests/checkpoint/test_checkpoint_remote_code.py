"""A checkpoint that ships its own modeling code (config.json ``auto_map``) calibrates through that code only
under ``--trust-remote-code``, and a model no code can run is refused in one line that names what works.

The folder's code is written by the test: a model type transformers does not know (``toy_moe``) whose config and
causal LM subclass transformers' DeepSeek-V3 classes, over the bundled DeepSeek-V3-architecture weights. The
oracle: the same weights calibrated through transformers' own DeepSeek-V3 give the same scales. Importing the
folder's modeling file leaves a marker file, so a run that must not execute it can be seen not to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import fp4pass.checkpoint
from cli_helpers import run_cli
from fp4pass.safetensors.files import CheckpointError

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
DATA = ROOT / "calib_tokens.npz"

CONFIG_CODE = '''
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config


class ToyMoeConfig(DeepseekV3Config):
    model_type = "toy_moe"
'''
MODEL_CODE = '''
from pathlib import Path

from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

from .configuration_toy import ToyMoeConfig

Path({marker!r}).write_text("imported")


class ToyMoeForCausalLM(DeepseekV3ForCausalLM):
    config_class = ToyMoeConfig
'''


@pytest.fixture
def remote(tmp_path):
    """(folder, marker): the bundled DeepSeek-V3-architecture weights under a model type only its code knows."""
    folder = tmp_path / "toy"
    shutil.copytree(ROOT / "deepseek_v3", folder)
    marker = tmp_path / "imported.txt"
    (folder / "configuration_toy.py").write_text(CONFIG_CODE)
    (folder / "modeling_toy.py").write_text(MODEL_CODE.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="toy_moe", architectures=["ToyMoeForCausalLM"],
                  auto_map={"AutoConfig": "configuration_toy.ToyMoeConfig",
                            "AutoModelForCausalLM": "modeling_toy.ToyMoeForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def test_without_the_flag_the_folders_code_never_runs(remote, tmp_path, capsys):
    folder, marker = remote
    code, _, err = run_cli(capsys, "calibrate", str(folder), "--data", str(DATA), "-o", str(tmp_path / "s.json"))
    assert code == 2 and "--trust-remote-code" in err and "auto_map" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "s.json").exists()
    with pytest.raises(CheckpointError, match="--trust-remote-code"):
        fp4pass.checkpoint.calibrate(folder, DATA)
    assert not marker.exists()


def test_with_the_flag_it_runs_the_folders_code_and_calibrates_as_the_known_model(remote):
    folder, marker = remote
    ours = fp4pass.checkpoint.calibrate(folder, DATA, trust_remote_code=True)
    assert marker.exists() and ours.model_type == "toy_moe"
    known = fp4pass.checkpoint.calibrate(ROOT / "deepseek_v3", DATA)  # transformers' own DeepseekV3ForCausalLM
    assert known.model_type == "deepseek_v3"
    assert ours.to_json()["tensors"] == known.to_json()["tensors"] and len(known.tensors) == 20


def test_convert_calib_takes_the_flag_too(remote, tmp_path, capsys):
    folder, _ = remote
    code, _, err = run_cli(capsys, "convert", str(folder), "-o", str(tmp_path / "out"), "--calib", str(DATA),
                           "--trust-remote-code", "--quiet")
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "NVFP4"  # W4A4: calibrated input scales written


def test_a_model_no_code_runs_is_refused_naming_what_works(tmp_path, capsys):
    """Kimi-K3 (transformers 5.25 has no kimi_k3; the bundled example ships no code): one line, exit 2, the
    constant and the file that convert takes instead of a calibration."""
    code, _, err = run_cli(capsys, "calibrate", str(ROOT / "kimi_k3"), "--data", str(DATA), "-o",
                           str(tmp_path / "s.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "kimi_k3" in err and "--input-scale" in err and "--scales" in err


def test_diff_runs_both_folders_through_their_own_code_only_under_the_flag(remote, tmp_path, capsys):
    folder, marker = remote
    out = tmp_path / "nvfp4"
    code, _, err = run_cli(capsys, "convert", str(folder), "-o", str(out), "--input-scale", "0.01", "--quiet")
    assert code == 0, err
    code, _, err = run_cli(capsys, "diff", str(folder), str(out), "--data", str(DATA), "--seq-len", "8")
    assert code == 2 and "--trust-remote-code" in err and not marker.exists(), err
    result = fp4pass.checkpoint.diff(folder, out, DATA, seq_len=8, trust_remote_code=True)
    assert marker.exists() and result.to_json()["logits"]["kl_mean"] > 0
