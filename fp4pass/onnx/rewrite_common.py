"""One MXFP4 weight's conversion, computed when its first NVFP4 tensor is written and dropped after the last.

The new initializers are ``onnx_ir.LazyTensor`` objects over a shared :class:`WeightConversion`; ``ir.save``
evaluates them one at a time while streaming external data, so only one weight's working set (its MXFP4 bytes
and the NVFP4 result) is in memory at once. Validation that needs only the small scale tensor (shapes, E8M0
code 255) runs before anything is written, so a bad model fails with nothing on disk.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch

from fp4pass.convert import DEFAULT_EFFORT, DEFAULT_THREADS, lossless_range
from fp4pass.errors import FormatError, ShapeError, UsageError
from fp4pass.formats import MXFP4Tensor
from fp4pass.formats.codecs import check_e8m0
from fp4pass.formats.constants import E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN
from fp4pass.onnx.loading import tensor_bytes
from fp4pass.onnx.patterns import FP4Weight
from fp4pass.onnx.qmoe_layout import KERNEL, kernel_to_schema, schema_to_kernel
from fp4pass.onnx.report import group_stats

__all__ = ["WeightConversion", "UniqueNames", "e8m0_codes_from_float", "float_scales_to_e8m0"]

log = logging.getLogger(__name__)


def e8m0_codes_from_float(scales: np.ndarray, name: str) -> np.ndarray:
    """float32 scales that are powers of two 2^k -> E8M0 codes k + 127 (uint8); anything else is an error."""
    mantissa, exponent = np.frexp(scales.astype(np.float32))
    codes = exponent.astype(np.int64) - 1 + E8M0_BIAS
    if not (np.all(mantissa == 0.5) and np.all((codes >= 0) & (codes < E8M0_NAN))):
        raise FormatError(f"{name}: scales are not all finite powers of two in E8M0's range (not MXFP4)")
    return codes.astype(np.uint8)


class UniqueNames:
    """Value names already taken in a graph and its subgraphs; :meth:`take` hands out new ones.

    A new name is ``base`` when free, else ``base_1``, ``base_2``, ...: a scale kept for an unconverted reader
    (or any tensor of the input) may already hold the name a rewrite would choose. With ``root`` (a model's
    main graph), a name for any of its subgraphs (an If branch) is checked against the whole model, so that a
    value in a branch never shadows one of the outer graph or repeats one of another branch.
    """

    def __init__(self, root: ir.Graph | None = None) -> None:
        self._taken: dict[int, set[str]] = {}
        self._root = root
        self._inside_root: set[int] | None = None

    def _scope(self, graph: ir.Graph) -> ir.Graph:
        if self._root is None or graph is self._root:
            return graph
        if self._inside_root is None:
            self._inside_root = {id(sub) for sub in self._root.subgraphs()}
        return self._root if id(graph) in self._inside_root else graph

    def _names(self, graph: ir.Graph) -> set[str]:
        graph = self._scope(graph)
        names = self._taken.get(id(graph))
        if names is None:
            names = {v.name for v in graph.inputs} | set(graph.initializers)
            for node in ir.traversal.RecursiveGraphIterator(graph):
                names.update(v.name for v in node.outputs if v is not None and v.name)
                for sub in node.attributes.values():
                    if isinstance(sub, ir.Attr) and sub.type == ir.AttributeType.GRAPH:
                        names.update(v.name for v in sub.value.inputs)
            self._taken[id(graph)] = names
        return names

    def take(self, graph: ir.Graph, base: str) -> str:
        names = self._names(graph)
        name, n = base, 0
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.add(name)
        return name

    def release(self, graph: ir.Graph, name: str) -> None:
        """``name`` is free again (its value left the graph)."""
        self._names(graph).discard(name)


def float_scales_to_e8m0(scales: np.ndarray, codes: ir.TensorProtocol, name: str) -> tuple[np.ndarray | None, str | None]:
    """Float block scales of FP4 DequantizeLinear (pattern 4) -> (E8M0 codes, None) when they are MXFP4 by value.

    A scale 2^k with k in [-127, 127] is E8M0 code k + 127, exactly (float32 subnormal 2^-127..2^-149 count
    only down to 2^-127). A scale of 0 is accepted over a block whose E2M1 codes are all ±0 (any scale gives
    0 there; code 0 = 2^-127 is written). Anything else (another value, a negative scale, 0 over non-zero
    codes) returns ``(None, reason)``: FP4 with arbitrary scales, for the lossy path. A NaN or infinite scale
    makes the file untrustworthy and raises.
    """
    scales = np.asarray(scales, dtype=np.float32)
    if not np.isfinite(scales).all():
        raise FormatError(f"{name}: scales hold NaN or infinity")
    mantissa, exponent = np.frexp(scales)
    k = exponent.astype(np.int64) - 1
    pow2 = (mantissa == 0.5) & (k >= E8M0_MIN_EXP) & (k <= E8M0_MAX_EXP)
    zero = scales == 0
    if zero.any():
        packed = tensor_bytes(codes).reshape(*scales.shape, -1)
        empty = ((packed & 0x77) == 0).all(-1)
        zero_ok = zero & empty
        pow2 |= zero_ok
        k = np.where(zero_ok, E8M0_MIN_EXP, k)
    if not pow2.all():
        where = tuple(int(i) for i in np.argwhere(~pow2)[0])
        bad = float(scales[where])
        why = ("negative" if bad < 0 else "0 over a block with non-zero codes" if bad == 0
               else "outside E8M0's range 2^-127..2^127" if mantissa[where] == 0.5 else "not a power of two")
        return None, (f"lossy: block scales are not all powers of two in E8M0's range (scale {bad!r} at "
                      f"{list(where)} is {why}), so this is FP4 with arbitrary scales, not MXFP4; "
                      "converted through the lossy path")
    return (k + E8M0_BIAS).astype(np.uint8), None


def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def _release_memory() -> None:
    """Hand freed heap pages back to the OS: glibc keeps them otherwise, and RSS would grow with the model."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _map_external(tensor) -> np.ndarray | None:
    """A copy-on-write memory map of an external tensor's bytes (nothing is read until a page is touched).

    None when the tensor is not external or cannot be mapped (empty, truncated: ``tensor_bytes`` then reads it
    and reports what is wrong).
    """
    if not isinstance(tensor, ir.ExternalTensor) or not tensor.nbytes:
        return None
    try:
        return np.memmap(tensor.path, dtype=np.uint8, mode="c", offset=tensor.offset or 0, shape=(tensor.nbytes,))
    except (OSError, ValueError):
        return None


def _packed_array(tensor) -> np.ndarray | None:
    """The bytes of an in-memory ``ir.PackedTensor`` that holds them as a uint8 array, as a view (no copy);
    None for any other tensor."""
    raw = getattr(tensor, "raw", None)
    if isinstance(tensor, ir.PackedTensor) and isinstance(raw, np.ndarray) and raw.dtype == np.uint8 \
            and raw.flags.c_contiguous and raw.nbytes == tensor.nbytes:
        return raw.reshape(-1)
    return None


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` without copying a read-only array (in-model raw data): the converter reads its
    input codes and never writes them (what it re-encodes goes to a copy)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _copy_range(source: tuple[str, int, int], file) -> bool:
    """Copy bytes [offset, offset + length) of file ``path`` to ``file`` at its position, inside the kernel.

    ``os.copy_file_range``: no byte passes through this process. False (nothing to undo: the caller then
    writes the bytes itself, over the same range) when the platform or the file systems do not support it.
    """
    path, offset, length = source
    copy = getattr(os, "copy_file_range", None)
    if copy is None or not hasattr(file, "fileno"):
        return False
    try:
        file.flush()
        position = file.tell()
        with open(path, "rb") as src:
            done = 0
            while done < length:
                n = copy(src.fileno(), file.fileno(), length - done, offset + done, position + done)
                if n <= 0:
                    break
                done += n
    except (OSError, ValueError, AttributeError):
        return False
    if done != length:
        return False
    file.seek(position + length)
    return True


class _SameBytes:
    """Output codes that are the input's bytes unchanged (lossless): written by ``_copy_range`` when possible."""

    def __init__(self, *args, source: tuple[str, int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._same_bytes_source = source

    def tofile(self, file) -> None:
        if not _copy_range(self._same_bytes_source, file):
            super().tofile(file)


class _SameBytesPacked(_SameBytes, ir.PackedTensor):
    """FLOAT4E2M1 codes (DequantizeLinear / GatherBlockQuantized weights)."""


class _SameBytesTensor(_SameBytes, ir.Tensor):
    """uint8 codes (QMoE's packed weights)."""


class WeightConversion:
    """Converts one :class:`FP4Weight` with ``fp4pass.convert.mxfp4_to_nvfp4`` on demand.

    ``prior_global``: an FP32 per-expert scale the input already applied (QMoE 'fp4' fc*_global_scale); the
    written global scale is ``prior_global * global_scale`` (FP32 product), the block scales stay E4M3.
    """

    def __init__(self, record: FP4Weight, method: str, prior_global: np.ndarray | None = None, *,
                 effort: str = DEFAULT_EFFORT, threads: int | None = DEFAULT_THREADS) -> None:
        self.record = record
        self.method = method
        self.effort, self.threads = effort, threads  # of mxfp4_to_nvfp4
        self.prior_global = prior_global
        self.group_dims = 1 if len(record.shape) == 3 else 0
        self.stats: dict | None = None
        self.per_expert: list[dict] | None = None  # report.group_stats, one entry per expert
        self.seconds = 0.0
        self._result = None
        self._global: np.ndarray | None = None
        self._pending: set[str] = set()
        self._same_bytes: tuple[str, int, int] | None = None  # (path, offset, length) when codes are unchanged
        self._codes_layout: str | None = None  # KERNEL when the result's codes are the stored kernel-layout bytes
        self._source = record.codes.const_value  # the MXFP4 codes; the value itself gets the lazy NVFP4 codes
        self._scale_source = record.scales.const_value
        self.lossy_reason: str | None = None  # FP4 with arbitrary float scales (pattern 4, not MXFP4 by value)
        self._float_scales: np.ndarray | None = None
        # validated now (nothing written yet), read again when converting: holding every weight's scales from
        # here to the end would grow memory with the model (1/16 of its bytes) instead of its largest tensor
        self._read_scales()

    # -- validation and input --------------------------------------------------------------------------
    def _read_scales(self, check: bool = True) -> np.ndarray:
        """E8M0 codes [..., K/32] (uint8), checked against the codes' shape and (``check``) for code 255 (NaN).

        The converter's own min/max pass refuses code 255 too, so the read at conversion time skips it.
        """
        record = self.record
        scales = self._scale_source
        name = record.name
        if record.pattern == "gbq":
            codes = e8m0_codes_from_float(scales.numpy(), f"{name} scales")
        elif record.pattern == "dq_float":
            floats = np.asarray(scales.numpy()).astype(np.float32)
            codes, self.lossy_reason = float_scales_to_e8m0(floats, self._source, f"{name} scales {record.scales.name!r}")
            if codes is None:
                codes = floats
        else:
            codes = tensor_bytes(scales).reshape(scales.shape.numpy())
            if not codes.flags.writeable:  # a view of in-model raw data
                codes = codes.copy()
        *lead, k = record.shape
        if k % 32:
            raise ShapeError(f"{name}: K={k} is not a multiple of the MXFP4 block 32")
        if tuple(codes.shape) != (*lead, k // 32):
            raise ShapeError(f"{name}: scales {record.scales.name!r} have shape {list(codes.shape)}, "
                             f"expected {[*lead, k // 32]} for weight {list(record.shape)}")
        if self.lossy_reason is not None:
            return codes
        if check and (codes == E8M0_NAN).any():  # numpy: one thread; the torch check only to name the position
            check_e8m0(torch.from_numpy(np.ascontiguousarray(codes).copy()), f"{name} scales {record.scales.name!r}")
        return codes

    def mx(self, as_stored: bool = False) -> MXFP4Tensor:
        """The MXFP4 tensor over the codes as stored, without copying them.

        External data is memory-mapped copy-on-write: the lossless path never touches the codes (it needs
        only the scales), so they are neither read nor resident. Shapes and E8M0 code 255 were checked in
        ``_read_scales``, hence no second pass of ``from_codes``. A QMoE weight in the kernel layout
        [E, K, N/2] is repacked here into [E, N, K/2] (a copy; the converter works along K), unless
        ``as_stored``: then the codes are the stored bytes viewed as [E, N, K/2], meaningful only to a
        conversion that never reads a code (see :meth:`_codes_untouched`).
        Not for FP4 with arbitrary scales (``lossy_reason`` set): that is no MXFP4 tensor (:meth:`scaled_inputs`).
        """
        if self.lossy_reason is not None:
            raise UsageError(f"{self.record.name}: {self.lossy_reason}")
        *lead, k = self.record.shape
        if self.record.layout == KERNEL and not as_stored:
            e, n = lead
            packed = kernel_to_schema(tensor_bytes(self._source), n, k)
        else:
            packed = _map_external(self._source)
            if packed is None:
                packed = _packed_array(self._source)
            if packed is None:
                packed = tensor_bytes(self._source)
        codes = _read_only_tensor(packed.reshape(*lead, k // 2))
        return MXFP4Tensor(codes, torch.from_numpy(self._read_scales(check=False)), name=self.record.name)

    def scaled_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP4 with arbitrary scales: (packed codes uint8 [..., K/2], float32 scales [..., K/32])."""
        packed = tensor_bytes(self._source).copy()
        *lead, k = self.record.shape
        scales = np.asarray(self._scale_source.numpy()).astype(np.float32)
        return torch.from_numpy(packed.reshape(*lead, k // 2)), torch.from_numpy(scales)

    # -- conversion ------------------------------------------------------------------------------------
    def result(self):
        """The NVFP4Tensor, converting now if needed (stats and seconds recorded on the first run)."""
        if self._result is None:
            from fp4pass.convert import mxfp4_to_nvfp4

            start = time.perf_counter()
            if self.lossy_reason is not None:
                from fp4pass.convert.scaled import scaled_fp4_to_nvfp4

                codes, scales = self.scaled_inputs()
                nv, stats = scaled_fp4_to_nvfp4(codes, scales, self.method, self.group_dims, name=self.record.name)
                mx = None
            else:
                as_stored = self._codes_untouched()
                mx = self.mx(as_stored)
                nv, stats = mxfp4_to_nvfp4(mx, method=self.method, group_dims=self.group_dims,
                                           effort=self.effort, threads=self.threads)
                if as_stored and nv.codes.data_ptr() != mx.codes.data_ptr():  # a code was re-encoded after all
                    as_stored = False
                    mx = self.mx()
                    nv, stats = mxfp4_to_nvfp4(mx, method=self.method, group_dims=self.group_dims,
                                               effort=self.effort, threads=self.threads)
                self._codes_layout = KERNEL if as_stored else None
            elapsed = time.perf_counter() - start
            source = self._source
            if mx is not None and isinstance(source, ir.ExternalTensor) and nv.codes.data_ptr() == mx.codes.data_ptr():
                # the converter shares nibbles it keeps and copies any it re-encodes: these are the input's
                self._same_bytes = (source.path, source.offset or 0, source.nbytes)
            if self.stats is None:
                self.stats, self.seconds = stats, elapsed
                self.per_expert = group_stats(mx, nv, self.group_dims, stats) if mx is not None else None
            self._result = nv
            g = nv.global_scale.cpu().numpy().astype(np.float32)
            if self.prior_global is not None:
                g = (self.prior_global.astype(np.float32).reshape(g.shape) * g).astype(np.float32)
            self._global = g
        return self._result

    def _codes_untouched(self) -> bool:
        """Whether the conversion can run on the kernel-layout bytes as they are, without repacking them.

        ``auto`` on groups whose E8M0 codes all lie within 17 of each other (over all blocks) is lossless
        without reading a single E2M1 code: the output shares the input's nibbles and the E4M3 scales come from
        the E8M0 codes alone (``fp4pass.convert``). The codes then stay in the kernel layout, and are written
        back as they came. :meth:`result` checks that the nibbles were indeed shared, and repacks otherwise.
        """
        if self.record.layout != KERNEL or self.method != "auto":
            return False
        scales = self._read_scales(check=False).reshape(self.record.shape[0], -1)
        if scales.size == 0:
            return False
        return bool(lossless_range(scales.min(axis=1).astype(np.int64), scales.max(axis=1).astype(np.int64)).all())

    def global_scale(self) -> np.ndarray:
        """FP32 global scale, [] or [E] (small; kept after the big parts are released)."""
        if self._global is None:
            self.result()
        return self._global

    def _fetched(self, part: str) -> None:
        self._pending.discard(part)
        if not self._pending:
            self._result = None  # every big part written: free the working set
            _release_memory()

    # -- lazy tensors ----------------------------------------------------------------------------------
    def codes_tensor(self, name: str, packed_uint8: bool = False, layout: str | None = None) -> ir.LazyTensor:
        """E2M1 codes: FLOAT4E2M1 [..., K] (ONNX), or uint8 [..., K/2] when ``packed_uint8`` (QMoE); with
        ``layout="kernel"`` the QMoE kernel layout uint8 [E, K, N/2] (nibbles paired along N)."""
        *lead, k = self.record.shape
        self._pending.add("codes")
        kernel = layout == KERNEL

        def make():
            codes = self.result().codes.cpu().numpy()
            # the input's bytes are the output's only when both are in the same layout
            same = self._same_bytes if kernel == (self.record.layout == KERNEL) else None
            self._fetched("codes")
            if kernel and self._codes_layout == KERNEL:  # the stored kernel-layout bytes, kept as they are
                codes = codes.reshape(lead[0], k, lead[1] // 2)
            elif kernel:
                codes = schema_to_kernel(codes, lead[1], k)
            if same is not None:
                if packed_uint8:
                    return _SameBytesTensor(codes, name=name, source=same)
                return _SameBytesPacked(codes, ir.DataType.FLOAT4E2M1, shape=ir.Shape([*lead, k]), name=name,
                                        source=same)
            if packed_uint8:
                return ir.Tensor(codes, name=name)
            return ir.PackedTensor(codes, ir.DataType.FLOAT4E2M1, shape=ir.Shape([*lead, k]), name=name)

        if kernel:
            return ir.LazyTensor(make, ir.DataType.UINT8, ir.Shape([lead[0], k, lead[1] // 2]), name=name)
        if packed_uint8:
            return ir.LazyTensor(make, ir.DataType.UINT8, ir.Shape([*lead, k // 2]), name=name)
        return ir.LazyTensor(make, ir.DataType.FLOAT4E2M1, ir.Shape([*lead, k]), name=name)

    def scales_tensor(self, name: str) -> ir.LazyTensor:
        """E4M3FN block scales [..., K/16] (global scale not applied)."""
        *lead, k = self.record.shape
        self._pending.add("scales")

        def make():
            scales = self.result().scales.cpu().numpy().view(ml_dtypes.float8_e4m3fn)
            self._fetched("scales")
            return ir.Tensor(scales, dtype=ir.DataType.FLOAT8E4M3FN, name=name)

        return ir.LazyTensor(make, ir.DataType.FLOAT8E4M3FN, ir.Shape([*lead, k // 16]), name=name)

    def global_tensor(self, name: str) -> ir.LazyTensor:
        """FP32 global scale: shape [] per tensor, [E] per expert."""
        shape = [self.record.shape[0]] if self.group_dims else []

        def make():
            return ir.Tensor(self.global_scale().reshape(shape), name=name)

        return ir.LazyTensor(make, ir.DataType.FLOAT, ir.Shape(shape), name=name)

    def materialize(self) -> None:
        """Run the conversion now (stats for the report); the lazy tensors then read the cached result."""
        self.result()
