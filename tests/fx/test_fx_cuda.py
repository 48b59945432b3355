"""The fx path on CUDA: ``fp4pass.fx.convert``, ``calibrate`` and ``diff`` of the bundled gpt-oss (the README's
example, transformers' own GptOss code) give on ``cuda`` what they give on the CPU: the same converted tensors
(integer codes exactly, float scales to float32 rounding), the same activation amax (float32 matmuls, TF32 off
as torch's default, up to summation order: 1e-4 relative) and the same diff (SNR within 0.5 dB)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run_readme_example(device: str) -> dict:
    import fp4pass.fx
    from fp4pass.fx.gpt_oss import CausalLMLogits

    model = fp4pass.fx.load_gpt_oss(ROOT / "models" / "tiny_gpt_oss", device=device)
    input_ids = torch.from_numpy(np.load(ROOT / "models" / "tiny_gpt_oss_calib.npz")["input_ids"]).to(device)
    dims = ({0: torch.export.Dim("batch", max=4096), 1: torch.export.Dim("seq", min=2, max=4096)},)
    program = torch.export.export(CausalLMLogits(model), (input_ids,), dynamic_shapes=dims)
    nvfp4, report = fp4pass.fx.convert(program)
    calibrated, scales = fp4pass.fx.calibrate(nvfp4, [(input_ids,)])
    result = fp4pass.fx.diff(program, calibrated, (input_ids,))
    tensors = {name: t.detach().cpu() for name, t in {**dict(nvfp4.named_parameters()),
                                                      **dict(nvfp4.named_buffers()), **nvfp4.constants}.items()
               if isinstance(t, torch.Tensor)}
    return {"summary": report["summary"], "tensors": tensors, "scales": scales, "diff": result}


@pytest.mark.gpu
def test_fx_convert_calibrate_and_diff_on_cuda_equal_the_cpu():
    cpu, cuda = _run_readme_example("cpu"), _run_readme_example("cuda")
    for key in ("tensors_converted", "lossless"):
        assert cuda["summary"][key] == cpu["summary"][key], key
    assert cuda["tensors"].keys() == cpu["tensors"].keys()
    for name, tensor in cpu["tensors"].items():
        torch.testing.assert_close(cuda["tensors"][name], tensor, msg=name)  # exact for integer codes
    assert cuda["scales"].provider == "torch:cuda" and cpu["scales"].provider == "torch:cpu"
    assert cuda["scales"].tensors.keys() == cpu["scales"].tensors.keys()
    for name, entry in cpu["scales"].tensors.items():
        assert cuda["scales"].tensors[name].amax == pytest.approx(entry.amax, rel=1e-4), name
    assert cuda["diff"].provider == "torch:cuda"
    cpu_snr = {m.name: m.snr_db for m in cpu["diff"].outputs}
    for m in cuda["diff"].outputs:
        assert m.snr_db == pytest.approx(cpu_snr[m.name], abs=0.5), m.name
