"""The diff's figures: signal and error energies for SNRs, the logit statistics, and the tokens they count.

SNR = 10 log10(sum a^2 / sum (a - b)^2), in float64 over the tokens that are not padding; KL(source || nvfp4)
per token over the vocabulary (natural log), top-1 agreement and each model's negative log-likelihood of the
data's next tokens (:mod:`fp4pass.checkpoint.numerics` says where each is measured). Under
``torch.distributed`` every sum is all-reduced (:func:`reduce_sums`) before a figure is taken from it.
"""

from __future__ import annotations

import math

import torch

from fp4pass.checkpoint.calib_data import Batch
from fp4pass.checkpoint.layerwise.runner import float32_products

__all__ = ["Energy", "LogitStats", "float32_logits", "next_tokens", "valid_tokens", "tokens_of", "reduce_sums"]


class Energy:
    """Signal and error energy of a comparison, in float64: SNR = 10 log10(signal / error)."""

    __slots__ = ("signal", "error", "values", "nonfinite")

    def __init__(self):
        self.signal = self.error = 0.0
        self.values = self.nonfinite = 0

    def add(self, ref: torch.Tensor, test: torch.Tensor) -> None:
        r, t = ref.double(), test.double()
        finite = torch.isfinite(t)
        self.nonfinite += int((~finite).sum())
        d = torch.where(finite, t - r, torch.zeros_like(r))
        self.signal += float((r * r).sum())
        self.error += float((d * d).sum())
        self.values += r.numel()

    def as_list(self) -> list[float]:
        return [self.signal, self.error, float(self.values), float(self.nonfinite)]

    def set(self, values: list[float]) -> None:
        self.signal, self.error, self.values, self.nonfinite = values[0], values[1], int(values[2]), int(values[3])

    def snr_db(self) -> float | None:
        """None where identical; -inf where the test side has NaN/Inf or the reference is all zero."""
        if self.nonfinite:
            return -math.inf
        if self.error == 0.0:
            return None
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.error)


def float32_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of ``hidden`` [n, H]: float32 products where the CPU lacks bf16 matrix instructions
    (the head's weight converted in slices of the vocabulary), else the head's own product, upcast."""
    weight = head.weight
    if not float32_products(weight.device, weight.dtype):
        return head(hidden).float()
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    step = max(1, (64 << 20) // (weight.shape[1] * 4))
    for v in range(0, weight.shape[0], step):
        torch.matmul(x, weight[v:v + step].float().t(), out=out[:, v:v + step])
    if getattr(head, "bias", None) is not None:
        out += head.bias.float()
    return out


class LogitStats:
    """KL(source || nvfp4), top-1 agreement and both negative log-likelihoods, summed over tokens."""

    def __init__(self):
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.tokens = 0
        self.agree = 0
        self.nll = [0.0, 0.0]
        self.scored = 0

    def add(self, src: torch.Tensor, nv: torch.Tensor, targets: torch.Tensor) -> None:
        """``src``/``nv``: float32 logits [n, V]; ``targets`` [n]: the next token id, -1 where not scored."""
        log_p = torch.log_softmax(src, -1)
        log_q = torch.log_softmax(nv, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        kl = torch.where(torch.isnan(kl), torch.full_like(kl, math.inf), kl)
        self.kl_sum += float(kl.double().sum())
        self.kl_max = max(self.kl_max, float(kl.max()) if kl.numel() else 0.0)
        self.tokens += kl.numel()
        self.agree += int((src.argmax(-1) == nv.argmax(-1)).sum())
        scored = targets >= 0
        if scored.any():
            idx = targets[scored].unsqueeze(-1)
            self.nll[0] -= float(log_p[scored].gather(-1, idx).double().sum())
            self.nll[1] -= float(log_q[scored].gather(-1, idx).double().sum())
            self.scored += int(scored.sum())

    def as_list(self) -> list[float]:
        return [self.kl_sum, float(self.tokens), float(self.agree), self.nll[0], self.nll[1], float(self.scored)]

    def set(self, values: list[float], kl_max: float) -> None:
        self.kl_sum, self.tokens, self.agree = values[0], int(values[1]), int(values[2])
        self.nll, self.scored, self.kl_max = [values[3], values[4]], int(values[5]), kl_max

    def to_json(self) -> dict:
        def ppl(nll: float) -> float | None:
            if not self.scored:
                return None
            mean = nll / self.scored
            return math.exp(mean) if mean < 700 else math.inf
        n = max(self.tokens, 1)
        return {"kl_mean": self.kl_sum / n, "kl_max": self.kl_max, "top1_agreement": self.agree / n,
                "ppl_source": ppl(self.nll[0]), "ppl_nvfp4": ppl(self.nll[1]), "tokens": self.tokens,
                "scored_next_tokens": self.scored}


def next_tokens(batch: Batch, device) -> torch.Tensor:
    """[B, T]: the next token where this position and the next are real tokens, else -1."""
    ids = batch.input_ids.to(device)
    out = torch.full_like(ids, -1)
    out[:, :-1] = ids[:, 1:]
    if batch.attention_mask is not None:
        mask = batch.attention_mask.to(device).bool()
        scored = mask[:, :-1] & mask[:, 1:]
        out[:, :-1] = torch.where(scored, out[:, :-1], torch.full_like(out[:, :-1], -1))
    return out


def valid_tokens(batch: Batch, device) -> torch.Tensor | None:
    """flat bool [B*T]: the batch's tokens that are not padding; None where every token counts."""
    return None if batch.attention_mask is None else batch.attention_mask.reshape(-1).bool().to(device)


def tokens_of(hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The non-padding positions of ``hidden`` [B, T, ...] as rows [n, ...]."""
    if batch.attention_mask is None:
        return hidden.reshape(-1, *hidden.shape[2:])
    return hidden[batch.attention_mask.to(hidden.device).bool()]


def reduce_sums(values: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
    """Sum ``values`` and take the max of ``maxima`` over the process group (torch.distributed), if any."""
    from fp4pass.calib.distributed import distributed_ready

    if not distributed_ready():
        return values, maxima
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    sums = torch.tensor(values, dtype=torch.float64, device=device)
    dist.allreduce_sums(sums)
    tops = torch.tensor(maxima or [0.0], dtype=torch.float64, device=device)
    dist.allreduce_sums(tops, op=dist.ReduceOp.MAX)
    return sums.tolist(), tops.tolist()[:len(maxima)]
