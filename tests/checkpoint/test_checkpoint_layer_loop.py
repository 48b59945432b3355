"""The one layer loop (``fp4pass.checkpoint.layerwise.runner.run_layers``) on stand-in runners, without a model.

Each stand-in's layer i adds (i + 1) x its own scale to the hidden states, and its captured input is the batch's
token id x that scale, so after L layers batch b holds scale x (b + L(L + 1) / 2): two runners with scales 1 and
10 tell whose outputs went where. The visitor logs every call; the oracle is that arithmetic and the protocol's
order (begin, every batch, end, release, after; finish at the end), written out by hand.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from fp4pass.checkpoint.layerwise.hidden_states import HiddenStore
from fp4pass.checkpoint.layerwise.runner import LayerVisitor, run_layers

CPU = torch.device("cpu")


class StandIn:
    """What the loop uses of a LayerRunner (and its prefetcher uses): capture, layer inputs, one layer's run,
    load and release."""

    def __init__(self, scale: float, log: list):
        self.scale, self.log = scale, log
        self.device = CPU
        self.loader = SimpleNamespace(cancel=threading.Event())
        self.loaded: set[int] = set()

    def capture(self, index, input_ids, attention_mask):
        assert index == 0
        return input_ids.double() * self.scale, (), {}

    def layer_inputs(self, index, input_ids, attention_mask):
        return (), {"index": index}

    def run_layer(self, module, hidden, args, kwargs):
        assert module == ("layer", self.scale, kwargs["index"])
        return hidden + (kwargs["index"] + 1) * self.scale

    def load_layer(self, index):
        self.loaded.add(index)
        return ("layer", self.scale, index)

    def release_layer(self, index):
        self.log.append(("release", self.scale, index))
        self.loaded.discard(index)


class Logged(LayerVisitor):
    desc = "test"
    after_phase = "after"
    finish_phase = "finish"

    def __init__(self, log: list, fail_at: tuple | None = None):
        self.log, self.fail_at = log, fail_at

    def begin_layer(self, index, layers):
        self.log.append(("begin", index, tuple(layer[2] for layer in layers)))

    def run_batch(self, runners, index, batch, layers, hidden):
        b = int(batch.input_ids[0, 0])
        if (index, b) == self.fail_at:
            raise RuntimeError("a batch fails")
        self.log.append(("batch", index, b))
        return super().run_batch(runners, index, batch, layers, hidden)

    def end_layer(self, index):
        self.log.append(("end", index))

    def after_layer(self, index):
        self.log.append(("after", index))

    def finish(self):
        self.log.append(("finish",))


def _batches(n: int) -> list:
    return [SimpleNamespace(input_ids=torch.tensor([[b]]), attention_mask=None) for b in range(n)]


@pytest.mark.parametrize("keep_last", [True, False])
def test_every_layer_runs_every_batch_in_order_and_each_runner_keeps_its_own_outputs(keep_last):
    log: list = []
    runners = [StandIn(1.0, log), StandIn(10.0, log)]
    stores = [HiddenStore(1 << 20, CPU), HiddenStore(1 << 20, CPU)]
    timings: dict = {}
    run_layers(runners, stores, _batches(3), Logged(log), layers=4, timings=timings, keep_last=keep_last)
    ran = 4 if keep_last else 3  # without keep_last the store holds the last layer's inputs
    for runner, store in zip(runners, stores):
        for b in range(3):
            assert float(store.get(b)) == runner.scale * (b + ran * (ran + 1) / 2)
        assert runner.loaded == set()
    expected = []
    for i in range(4):
        expected += [("begin", i, (i, i))] + [("batch", i, b) for b in range(3)]
        expected += [("end", i), ("release", 1.0, i), ("release", 10.0, i), ("after", i)]
    assert log == expected + [("finish",)]
    assert list(timings) == ["embed", "load", "layers", "release", "after", "finish", "load_background"]
    assert all(seconds >= 0 for seconds in timings.values())


def test_a_failing_batch_still_ends_the_layer_and_releases_every_loaded_layer():
    log: list = []
    runners = [StandIn(1.0, log), StandIn(10.0, log)]
    stores = [HiddenStore(1 << 20, CPU), HiddenStore(1 << 20, CPU)]
    with pytest.raises(RuntimeError, match="a batch fails"):
        run_layers(runners, stores, _batches(2), Logged(log, fail_at=(1, 1)), layers=3, timings={})
    assert log[log.index(("batch", 1, 0)) + 1:][:3] == [("end", 1), ("release", 1.0, 1), ("release", 10.0, 1)]
    assert ("after", 1) not in log and ("finish",) not in log
    assert all(runner.loaded == set() for runner in runners)  # layer 2, loading meanwhile, released too


def test_no_layer_to_run_still_captures_and_finishes():
    log: list = []
    runner, store = StandIn(2.0, log), HiddenStore(1 << 20, CPU)
    timings: dict = {}
    run_layers([runner], [store], _batches(2), Logged(log), layers=0, timings=timings)
    assert [float(store.get(b)) for b in range(2)] == [0.0, 2.0]
    assert log == [("finish",)] and runner.loaded == set()
    assert list(timings) == ["embed", "finish", "load_background"]
