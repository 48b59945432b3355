"""fp4pass.checkpoint.output_forms' exclude list and compressed-tensors ``ignore`` on names the bundled examples
lack: a kept module under a top-level module that holds nothing converted, and a ``re:`` pattern that holds a
``*``. Expected values are written out by hand from the rules of docs/checkpoint.md."""

from __future__ import annotations

import re

from fp4pass.checkpoint import output_forms as forms


def test_a_kept_module_is_excluded_under_its_shallowest_ancestor_without_converted_modules():
    kept = ["vision_tower.blocks.0.attn", "model.layers.0.self_attn.q_proj", "lm_head"]
    converted = ["model.layers.0.mlp.experts.0.w1"]
    assert forms.exclude_list(kept, converted) == ["vision_tower*", "model.layers.0.self_attn*", "lm_head"]


def test_ct_ignore_leaves_a_regex_holding_a_star_as_it_is():
    pattern = r"re:^model\.layers\..*\.gate$"
    out = forms.ct_ignore([pattern, "model.layers.*.mlp.gate"])
    assert out[0] == pattern
    assert re.fullmatch(out[1][3:], "model.layers.12.mlp.gate") and not re.fullmatch(out[1][3:], "model.layers.x.mlp.gate")
