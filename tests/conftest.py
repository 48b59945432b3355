import os
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.database import DirectoryBasedExampleDatabase

# Hypothesis keeps its files (example database, constants cache) in a temporary folder, never in the checkout.
_HYPOTHESIS_HOME = os.path.join(tempfile.gettempdir(), "fp4pass-hypothesis")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
_DATABASE = DirectoryBasedExampleDatabase(os.path.join(_HYPOTHESIS_HOME, "examples"))
# "fp4pass" (the default): the same examples on every run, so that CI passes or fails on the code alone.
# "explore" (HYPOTHESIS_PROFILE=explore): fresh random examples on every run, to hunt for new counterexamples
# (run it repeatedly); pin each one found with @example before fixing it.
settings.register_profile("fp4pass", database=None, derandomize=True)
settings.register_profile("explore", database=_DATABASE, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fp4pass"))


def _ort_has_cuda() -> bool:
    from fp4pass.onnx.runtime import cuda_available

    return cuda_available()[0]


def pytest_collection_modifyitems(config, items):
    """``gpu``: needs torch with CUDA. ``ort_cuda``: needs onnxruntime's CUDA EP (a CPU torch may sit beside it)."""
    torch_cuda = torch.cuda.is_available()
    ort_cuda = None
    for item in items:
        if "gpu" in item.keywords and not torch_cuda:
            item.add_marker(pytest.mark.skip(reason="needs torch with a CUDA device; none here"))
        if "ort_cuda" in item.keywords:
            if ort_cuda is None:
                ort_cuda = _ort_has_cuda()
            if not ort_cuda:
                item.add_marker(pytest.mark.skip(reason="needs onnxruntime's CUDA execution provider; none here"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each test that takes ``device`` runs on CPU, and on CUDA where there is one."""
    return torch.device(request.param)
