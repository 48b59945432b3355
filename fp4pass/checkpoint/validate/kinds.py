"""The problems the validator finds, one record per kind, and one finding (:class:`Problem`).

A kind says once what it means for a deployment, what an engine does when it meets it (its *outcome*, worst
first in :data:`OUTCOMES`), whether it stops the engine's load, whether fp4pass's own output can only have it
through a broken writer, and the fix its messages name. Every table the validator, the verdicts and the writer's
self-check read (:data:`KINDS`, :data:`WRITER_BUGS`, :data:`FAILS_LOAD`) is derived from :data:`PROBLEM_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp4pass.checkpoint.engines.records import engine_record

__all__ = ["ProblemKind", "PROBLEM_KINDS", "KINDS", "OUTCOMES", "FAILS_LOAD", "WRITER_BUGS", "Problem", "kind_of"]

#: what an engine does with the checkpoint, worst first: the engine table's words for a problem's outcome
OUTCOMES = {"refuses": "refuses at load", "unsupported": "does not load this form", "nan": "loads, computes NaN",
            "garbage": "loads, computes garbage", "wrong_w3": "loads, w3 dequantized with w1's scale",
            "inconsistent": "loads, not what the others serve", "accuracy": "loads, loses accuracy", "loads": "loads"}


@dataclass(frozen=True)
class ProblemKind:
    """One kind of problem.

    - ``means``: what it does to a deployment (``KINDS[kind]``);
    - ``outcome``: what an engine does because of it (an :data:`OUTCOMES` key) where the engine's record
      (:mod:`fp4pass.checkpoint.engines.records`, ``outcomes``) says nothing else; a finding may carry its own (a
      zero input scale computes NaN, a zero weight scale garbage);
    - ``fails_load``: the engine stops loading (its verdict's ``loads`` is false);
    - ``writer_bug``: in a folder fp4pass has just written, only a broken writer makes it (exit 3);
    - ``severity``: "error", or "warning" for a kind that fails ``inspect`` only where its engine was asked for
      (or with ``--strict``); a magnitude guess of any kind is a warning too;
    - ``fix``: what its messages tell the user to do.
    """

    kind: str
    means: str
    fix: str
    outcome: str = "refuses"
    fails_load: bool = False
    writer_bug: bool = False
    severity: str = "error"


PROBLEM_KINDS = (
    ProblemKind("missing_shard", "a shard the index names is not in the folder",
                "copy the shard in, or rewrite the index", fails_load=True, writer_bug=True),
    ProblemKind("unreadable_shard", "a shard's header cannot be read", "download or write the shard again",
                fails_load=True, writer_bug=True),
    ProblemKind("missing_tensor", "a quantized module lacks its packed weight", "write the packed E2M1 weight",
                fails_load=True, writer_bug=True),
    ProblemKind("missing_scale", "a quantized module lacks a scale the engine loads",
                "write the missing scale (or declare weight-only)", outcome="garbage"),
    ProblemKind("scale_missing_some_experts", "some experts of a layer have an input scale, others none",
                "give those experts the largest input scale of the layer", outcome="nan", writer_bug=True),
    ProblemKind("zero_scale", "a scale is zero", "a finite positive scale", outcome="garbage", writer_bug=True),
    ProblemKind("negative_scale", "a scale is negative", "a positive scale", outcome="garbage", writer_bug=True),
    ProblemKind("nonfinite_scale", "a scale is NaN or infinite", "a finite scale", outcome="nan", writer_bug=True),
    ProblemKind("w1_w3_mismatch", "gate (w1) and up (w3) of one expert have different scales",
                "requantize both with one shared scale", outcome="wrong_w3", writer_bug=True),
    ProblemKind("scale_convention", "a divisor stored as a multiplier, or the reverse", "store its reciprocal",
                outcome="garbage", writer_bug=True),
    ProblemKind("folded_global_scale", "the global scale folded into the E4M3 block scales",
                "requantize with a float32 global scale", outcome="accuracy", writer_bug=True),
    ProblemKind("unexcluded_linear", "a bf16/f16/f32 Linear the engine would quantize (not in the exclusions)",
                "add the Linear to the exclusions", fails_load=True),
    ProblemKind("quantized_lm_head", "lm_head is quantized", "keep lm_head in bf16 and exclude it", fails_load=True),
    ProblemKind("quantized_router", "a MoE router (gate) is quantized", "keep the router in bf16 and exclude it",
                fails_load=True),
    ProblemKind("dtype_shape", "dtypes or shapes that do not fit the form", "write the tensors in the form's layout",
                fails_load=True, writer_bug=True),
    ProblemKind("missing_config_field", "a config field the engine needs is missing", "add the field",
                fails_load=True, writer_bug=True),
    ProblemKind("bad_config_value", "a config value the engines do not accept", "write a value the engines accept",
                fails_load=True, writer_bug=True),
    ProblemKind("config_disagreement", "config.json and hf_quant_config.json disagree", "write the same in both",
                outcome="inconsistent", writer_bug=True),
    ProblemKind("engine_cannot_load", "the engine's loader cannot load this form",
                "write the form this engine loads, or serve it with one that loads it", severity="warning"),
    ProblemKind("no_quantized_modules", "no NVFP4 module found", "point at the quantized folder", writer_bug=True),
)

_BY_KIND = {k.kind: k for k in PROBLEM_KINDS}
#: problem kinds, each with what it does to a deployment
KINDS = {k.kind: k.means for k in PROBLEM_KINDS}
#: kinds that stop an engine's load
FAILS_LOAD = frozenset(k.kind for k in PROBLEM_KINDS if k.fails_load)
#: kinds that, in a folder fp4pass itself wrote, can only come from a broken writer (exit 3); the others
#: (an engine that cannot load the form yet, exclusions an engine reads differently, a source's quantized lm_head)
#: are reported in convert's output and report
WRITER_BUGS = frozenset(k.kind for k in PROBLEM_KINDS if k.writer_bug)


def kind_of(kind: str) -> ProblemKind:
    """The record of ``kind`` (a key of :data:`KINDS`)."""
    return _BY_KIND[kind]


@dataclass
class Problem:
    """One finding: ``kind`` (a key of :data:`KINDS`), a message with the consequence and the fix."""

    kind: str
    message: str
    module: str | None = None
    tensor: str | None = None
    engines: list[str] | None = None  # None: every engine
    #: a judgement from magnitudes alone (a weight amax outside 2^-14..2^10 but inside 2^-24..2^20), which a
    #: legitimately large or small weight can also give: always a warning
    guess: bool = False
    #: for a weight's scale_convention finding: the weight amax its global scale gives as stored
    amax_as_stored: float | None = None
    #: a finding that does not fail ``inspect`` unless ``--strict``: a guess, or an engine that does not load a
    #: form that is correct (its loader's gap, not the checkpoint's defect)
    warning: bool = False
    #: what every engine does because of it (an :data:`OUTCOMES` key); by default the engine record's for its
    #: kind, else the kind's own
    outcome: str | None = None

    def __post_init__(self) -> None:
        self.warning = self.warning or self.guess

    def outcome_for(self, engine: str) -> str:
        return self.outcome or engine_record(engine).outcomes.get(self.kind) or kind_of(self.kind).outcome

    def to_json(self) -> dict:
        out = {"kind": self.kind, "severity": "warning" if self.warning else "error", "message": self.message}
        for key in ("module", "tensor", "engines", "amax_as_stored"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.guess:
            out["guess"] = True
        return out
