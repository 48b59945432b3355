"""Inputs that do not fit an exported program: one FP4PassError naming the input, the dim and the fix, raised
before any batch runs where it can be checked; calibration data the model cannot read (no rows, token ids
outside the vocabulary or not integers) named the same way, never torch's AssertionError or IndexError."""

import pytest
import torch

import fp4pass.fx
from fp4pass.calib.errors import CalibrationDataError
from fp4pass.errors import FP4PassError, ShapeError
from fp4pass.fx import calibration
from fp4pass.fx.mxfp4 import MXFP4Linear

VOCAB = 50


class TokenModel(torch.nn.Module):
    """input_ids [batch, seq] -> embedding (vocabulary 50) -> MXFP4 linear: an FP4 matmul to calibrate."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 64)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, 64, generator=g))
        self.proj = MXFP4Linear.from_linear(torch.nn.Linear(64, 32))

    def forward(self, input_ids):
        return self.proj(self.embed(input_ids))


def _ids(batch, seq, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def fixed():
    return torch.export.export(TokenModel(), (_ids(2, 8),))


@pytest.fixture(scope="module")
def dynamic():
    shapes = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", min=2, max=16)},)
    return torch.export.export(TokenModel(), (_ids(2, 8),), dynamic_shapes=shapes)


def test_a_fixed_dim_names_itself_and_the_fix_before_any_batch_runs(fixed, monkeypatch):
    ran = []
    monkeypatch.setattr(calibration, "_collect", lambda *a, **k: ran.append(1) or 0)
    batches = [_ids(2, 8), _ids(2, 8, 1), _ids(2, 12, 2)]
    with pytest.raises(ShapeError) as info:
        fp4pass.fx.calibrate(fixed, batches)
    message = str(info.value)
    assert message.startswith("fx calibrate: calibration batch #2: input 'input_ids' dim 1 is 12, but the program "
                              "was exported with that dim fixed at 8")
    assert "dynamic_shapes={'input_ids': {1: torch.export.Dim('seq')}}" in message
    assert not ran  # a list is checked whole first


def test_a_stream_of_batches_is_checked_before_each_runs(fixed):
    def stream():
        yield _ids(2, 8)
        yield _ids(3, 8)  # the batch dim is fixed too

    with pytest.raises(ShapeError, match="batch #1: input 'input_ids' dim 0 is 3, .* fixed at 2; .*Dim\\('batch'\\)"):
        fp4pass.fx.calibrate(fixed, stream())


def test_dynamic_dims_run_at_other_lengths_within_their_range(dynamic):
    _, scales = fp4pass.fx.calibrate(dynamic, [_ids(2, 8), _ids(5, 3, 1), _ids(1, 16, 2)])
    assert scales.batches == 3
    with pytest.raises(ShapeError, match=r"input 'input_ids' dim 1 is 20, outside the range \[2, 16\]"):
        fp4pass.fx.calibrate(dynamic, [_ids(2, 20)])


@pytest.mark.parametrize("batch, words", [
    (torch.zeros(0, 8, dtype=torch.long), "input 'input_ids' has no elements (shape [0, 8])"),
    (torch.full((2, 8), VOCAB), f"token id {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    (torch.full((2, 8), -1), "token id -1, outside the vocabulary"),
    (_ids(2, 8).float(), "input 'input_ids' is torch.float32; it holds token ids, which are integers"),
])
def test_calibration_data_the_model_cannot_read_is_named(dynamic, batch, words):
    with pytest.raises(CalibrationDataError) as info:
        fp4pass.fx.calibrate(dynamic, [_ids(2, 8), batch])
    assert str(info.value).startswith("fx calibrate: calibration batch #1: ") and words in str(info.value)


def test_a_model_failure_on_a_batch_is_a_named_error_not_a_torch_exception(fixed):
    """A GraphModule carries no shapes to check first: the model's own error is wrapped, naming the batch."""
    gm = fixed.module()
    with pytest.raises(FP4PassError, match="calibration batch #1: .*input_ids.size\\(\\)\\[1\\] == 8"):
        fp4pass.fx.calibrate(gm, [_ids(2, 8), _ids(2, 9)])
    with pytest.raises(CalibrationDataError, match="batch #0: the model failed on it \\(IndexError"):
        fp4pass.fx.calibrate(gm, [torch.full((2, 8), VOCAB)])


class _Pair(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def test_diff_checks_both_programs_before_running_and_explains_torch_guards(fixed):
    with pytest.raises(ShapeError, match="fx diff: a: input 'input_ids' dim 1 is 4, .*fixed at 8"):
        fp4pass.fx.diff(fixed, fixed, (_ids(2, 4),))
    n = torch.export.Dim("n")
    pair = torch.export.export(_Pair(), (torch.ones(3), torch.ones(3)), dynamic_shapes=({0: n}, {0: n}))
    # each dim is in its range; only torch's guard knows they must be equal
    with pytest.raises(ShapeError, match="fx diff: a: the inputs break a shape the program was exported with"):
        fp4pass.fx.diff(pair, pair, (torch.ones(3), torch.ones(4)))
