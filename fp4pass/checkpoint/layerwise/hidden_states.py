"""Where the hidden states between two decoder layers live: in memory within a budget, then on disk.

Every calibration batch's hidden states are kept from one layer to the next (one set at a time: a layer's
outputs replace its inputs); :func:`hidden_budget` says how many bytes of them stay in memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = ["HiddenStore", "hidden_budget"]


class HiddenStore:
    """The hidden states of every calibration batch: in memory while their total stays within ``budget`` bytes,
    then in files of a temporary folder (removed by :meth:`close`, also on Ctrl-C)."""

    def __init__(self, budget: int, device: torch.device):
        self.budget, self.device = budget, device
        self.memory: dict[int, torch.Tensor] = {}
        self.used = 0
        self.folder: Path | None = None
        self.on_disk: dict[int, tuple] = {}

    def put(self, index: int, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        old = self.memory.pop(index, None)
        if old is not None:
            self.used -= old.numel() * old.element_size()
        if index in self.on_disk or self.used + size > self.budget:
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="fp4pass-calib-"))
            path = self.folder / f"{index}.bin"
            cpu = tensor.detach().to("cpu").contiguous()
            cpu.view(-1).view(torch.uint8).numpy().tofile(path)
            self.on_disk[index] = (tuple(cpu.shape), cpu.dtype)
            return
        self.memory[index] = tensor.detach()
        self.used += size

    def get(self, index: int) -> torch.Tensor:
        if index in self.memory:
            return self.memory[index]
        shape, dtype = self.on_disk[index]
        import numpy as np

        raw = torch.from_numpy(np.fromfile(self.folder / f"{index}.bin", dtype=np.uint8))
        return raw.view(dtype).reshape(shape).to(self.device)

    @property
    def spilled(self) -> int:
        return len(self.on_disk)

    def close(self) -> None:
        self.memory.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def hidden_budget(device: torch.device, requested: int | None) -> int:
    """Bytes of hidden states kept in memory: ``requested``, else half the free GPU memory on CUDA, else a
    quarter of the machine's available memory."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30
