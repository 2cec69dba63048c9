"""Image activations kept channels-last (NHWC) inside a lowered torch program.

torch programs are NCHW. XLA:CPU computes a convolution in NHWC, so an NCHW one costs a
transpose of its input and of its output on top of a convolution kernel that is itself slow
(EfficientNet-B0's 1x1 convolutions took 5x torch's time). Here a 4-D activation that a
convolution produces is held as a `ChannelsLast`: its array is NHWC, what the program means
by it is that array transposed to NCHW. The operations between convolutions in vision models
(element-wise arithmetic and activations, spatial means, pools, concatenations, bilinear
upsampling, the permutes around ConvNeXt's layer norms, batch norms) compute on the NHWC array
directly; any other operation receives the NCHW tensor, one transpose where it asks for it, so
the program computes what torch's does.
Convolutions run NHWC: a 1x1 one as a dot over the channel axis, a depthwise one as a sum of
strided slices scaled per channel (one element-wise fusion), a grouped one with few channels
per group likewise per tap and input channel, any other with XLA's NHWC/HWIO convolution.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from hloserve.kernels import DEPTHWISE_CONV2D
from hloserve.models import _xla

__all__ = [
    "ELEMENTWISE",
    "ChannelGroups",
    "ChannelsLast",
    "avg_pool",
    "concatenate",
    "convolution",
    "logical",
    "max_pool",
    "mean",
    "permute",
    "physical",
    "split",
    "upsample_bilinear",
    "view",
]

jax, jnp = _xla.jax, _xla.jnp

TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)
_AXIS = {0: 0, 1: 3, 2: 1, 3: 2}  # an NCHW axis → the NHWC axis that holds it

_GROUPED_TERMS = 8 * 9
"""A grouped convolution with at most this many weights per output (inputs per group times taps)
runs as `_grouped`; XLA's convolution computes larger ones. Measured on ResNeXt-50's 3x3 shapes
at batch 4, 2 cores (jaxlib 0.10.2): 4 inputs per group 11 ms against XLA's 92, 8 per group 10
against 16, 16 per group 150 against 9 (the fusion of 144 terms no longer pays)."""

_DENSE_TERMS = 27
"""A 1x1 convolution from at most this many channels (MobileNets' and EfficientNet's expansions
from 16 and 24) runs as `_grouped` with one group: a loop that XLA fuses with the bias,
activation and padding after it, where a dot writes its output for another loop to read.
Measured alone with the bias and ReLU6 after it, batch 4, 2 cores (Intel Xeon, jaxlib 0.10.2),
ms: at 112 pixels from 16 channels to 96 3.7 against the dot's 8.7; at 56 from 24 to 144 2.2
against 3.6; from 32 level; from 40 7.0 against 5.9, from 64 5.7 against 2.8. An RGB stem's
3x3x3 (27 terms) ran faster that way too (2.6 ms against YNNPACK's 6.1), but where a YNNPACK
convolution reads its output, YNNPACK takes the whole loop into its own fusion and materializes
every tap (a small CNN's scratch 0.6 -> 2.5 MB at batch 8), so kernels with taps are left to
the dot and convolution forms."""

_aten = torch.ops.aten
_UNARY_AND_BINARY = (
    "relu sigmoid clamp gelu tanh neg exp erf sqrt rsqrt hardtanh silu hardswish hardsigmoid "
    "maximum minimum abs"
)
ELEMENTWISE = frozenset(
    {
        *(getattr(_aten, op).Tensor for op in ("add", "sub", "mul", "div", "rsub")),
        *(getattr(_aten, op).Scalar for op in ("add", "sub", "mul", "div", "rsub")),
        *(getattr(_aten, op).default for op in _UNARY_AND_BINARY.split()),
        _aten.pow.Tensor_Scalar,
        _aten.where.self,
    }
)
"""Operations applied element by element, with broadcasting: the same on NHWC arrays once every
operand is NHWC (or a scalar)."""


class ChannelsLast:
    """A 4-D activation whose array is NHWC; the program means the NCHW tensor."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array


class ChannelGroups:
    """A `ChannelsLast` viewed with its channels in two axes, as ShuffleNet's channel shuffle
    views them: the array is (N, H, W, A, B), the program means (N, A, B, H, W)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array


def logical(value: Any) -> Any:
    """`value` as the torch program sees it: a `ChannelsLast` as its NCHW array, `ChannelGroups`
    as its (N, A, B, H, W) one."""
    if isinstance(value, ChannelsLast):
        return jnp.transpose(value.array, TO_NCHW)
    if isinstance(value, ChannelGroups):
        return jnp.transpose(value.array, (0, 3, 4, 1, 2))
    return value


def view(x: ChannelsLast | ChannelGroups, shape: Sequence[int]) -> ChannelsLast | ChannelGroups | None:
    """torch's view that splits a `ChannelsLast`'s channels in two axes, or joins
    `ChannelGroups`' back, as one reshape of the array; None for any other view (flattens ask
    for torch's layout)."""
    shape = [int(d) for d in shape]
    if shape.count(-1) == 1:  # torch's inferred size
        shape[shape.index(-1)] = math.prod(x.array.shape) // -math.prod(shape)
    if isinstance(x, ChannelsLast):
        n, h, w, c = x.array.shape
        if len(shape) == 5 and shape[0] == n and shape[3:] == [h, w] and shape[1] * shape[2] == c:
            return ChannelGroups(x.array.reshape(n, h, w, shape[1], shape[2]))
        return None
    n, h, w, a, b = x.array.shape
    return ChannelsLast(x.array.reshape(n, h, w, a * b)) if shape == [n, a * b, h, w] else None


def split(x: ChannelsLast, sizes: int | Sequence[int], dim: int = 0) -> list[ChannelsLast]:
    """torch's split of a `ChannelsLast` (by a size, or by sizes), each part channels-last:
    ShuffleNet's chunk of its channels in two."""
    axis = _AXIS[dim % 4]
    length = x.array.shape[axis]
    if isinstance(sizes, int):
        sizes = [min(sizes, length - start) for start in range(0, length, sizes)] or [0]
    bounds = np.cumsum([0, *sizes])
    return [
        ChannelsLast(jax.lax.slice_in_dim(x.array, int(lo), int(hi), axis=axis))
        for lo, hi in itertools.pairwise(bounds)
    ]


def physical(value: Any) -> Any:
    """An operand of an element-wise operation beside a `ChannelsLast`, laid out as its array."""
    if isinstance(value, ChannelsLast):
        return value.array
    if not hasattr(value, "ndim") or value.ndim == 0:
        return value  # a scalar broadcasts as it is
    array = jnp.asarray(value)
    return jnp.transpose(array.reshape((1,) * (4 - array.ndim) + array.shape), TO_NHWC)


def concatenate(tensors: Sequence[Any], dim: int = 0) -> ChannelsLast | None:
    """torch's cat of 4-D activations, some `ChannelsLast`, joined as NHWC arrays; None where
    another operand or mixed dtypes ask for torch's layout. SqueezeNet's fire modules and every
    DenseNet layer concatenate channels: NCHW, each operand was transposed out of NHWC and the
    result back in, and SqueezeNet's pools after them ran in float64 (torchax's lowering)."""
    if not any(isinstance(t, ChannelsLast) for t in tensors):
        return None
    arrays = [t.array if isinstance(t, ChannelsLast) else t for t in tensors]
    if any(getattr(a, "ndim", 0) != 4 for a in arrays) or len({np.dtype(a.dtype) for a in arrays}) != 1:
        return None
    return ChannelsLast(jnp.concatenate([physical(t) for t in tensors], axis=_AXIS[dim % 4]))


def applies(args: Sequence[Any]) -> bool:
    """Whether an element-wise operation over `args` can run channels-last: some operand is
    `ChannelsLast` and none has more than 4 axes."""
    return any(isinstance(a, ChannelsLast) for a in args) and all(
        getattr(a, "ndim", 0) <= 4 for a in args if not isinstance(a, ChannelsLast)
    )


def mean(lowering: Callable[..., Any], x: ChannelsLast, dims: Any, keepdim: bool = False, **kw: Any) -> Any:
    """A mean over a `ChannelsLast`'s axes; None where the result's axes would not be in torch's
    order (the caller computes it on the NCHW tensor instead)."""
    if not dims and not isinstance(dims, int):
        return None  # None or []: every axis, as torch reads it
    axes = sorted({d % 4 for d in ([dims] if isinstance(dims, int) else dims)})
    physical_axes = [_AXIS[d] for d in axes]
    if keepdim:
        return ChannelsLast(lowering(x.array, physical_axes, True, **kw))
    if axes == [2, 3]:  # (N, C): NHWC's remaining axes are in NCHW's order
        return lowering(x.array, physical_axes, False, **kw)
    return None


def permute(x: Any, order: Sequence[int]) -> Any:
    """torch's permute of a `ChannelsLast` (one transpose of its array, none for ConvNeXt's
    `permute(0, 2, 3, 1)`), of `ChannelGroups`' two channel axes (ShuffleNet's shuffle), or of a
    plain 4-D tensor into NCHW from NHWC (kept as its array)."""
    if isinstance(x, ChannelGroups):
        swapped = [d % 5 for d in order] == [0, 2, 1, 3, 4]
        return ChannelGroups(jnp.swapaxes(x.array, 3, 4)) if swapped else None
    order = [d % 4 for d in order]
    if isinstance(x, ChannelsLast):
        composed = [TO_NCHW[d] for d in order]
        return x.array if composed == [0, 1, 2, 3] else jnp.transpose(x.array, composed)
    return ChannelsLast(x) if order == list(TO_NCHW) else None


def batch_norm(x: ChannelsLast, weight: Any, bias: Any, mean_: Any, var: Any, eps: float) -> ChannelsLast:
    """An eval batch norm over the channel axis (last)."""
    scale = jax.lax.rsqrt(var + eps)
    scale = scale if weight is None else scale * weight
    y = (x.array - mean_) * scale
    return ChannelsLast(y if bias is None else y + bias)


def _pair(value: Sequence[int] | int) -> list[int]:
    return [value] * 2 if isinstance(value, int) else [*value] * (2 // len(value))


def _pooled_rows(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """How many windows torch's 2-D pooling places along an axis of `size`."""
    span = size + 2 * p - d * (k - 1) - 1
    rows = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (rows - 1) * s >= size + p:  # torch: the last window starts inside
        rows -= 1
    return rows


def _pool_window(
    x: ChannelsLast,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int] | int,
    dilation: Sequence[int] | int,
    ceil_mode: bool,
) -> tuple[list[int], list[int], list[int], list[int], list[tuple[int, int]]]:
    """torch's 2-D pooling window over a `ChannelsLast`'s spatial axes: kernel, stride, padding,
    dilation and the (low, high) padding of each axis that places the last window."""
    kernel = _pair(kernel)
    stride = _pair(stride) if stride else kernel
    padding, dilation = _pair(padding), _pair(dilation)
    pads = []
    for axis in range(2):
        size, k, s, p, d = x.array.shape[1 + axis], kernel[axis], stride[axis], padding[axis], dilation[axis]
        rows = _pooled_rows(size, k, s, p, d, ceil_mode)
        pads.append((p, (rows - 1) * s + d * (k - 1) + 1 - size - p))
    return kernel, stride, padding, dilation, pads


def max_pool(
    x: ChannelsLast,
    kernel: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] | int = 0,
    dilation: Sequence[int] | int = 1,
    ceil_mode: bool = False,
) -> ChannelsLast:
    """torch's 2-D max pooling over a `ChannelsLast`'s spatial axes, in its own dtype. torchax's
    lowering pooled NCHW in float64 (its initial value, `-inf`, is a Python float, which x64 makes
    f64): two transposes and two conversions around every pool (SqueezeNet's first: 35 ms of 195
    at batch 4)."""
    kernel, stride, _, dilation, pads = _pool_window(x, kernel, stride, padding, dilation, ceil_mode)
    dtype = np.dtype(x.array.dtype)
    lowest = np.array(-np.inf if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).min).astype(dtype)
    y = jax.lax.reduce_window(
        x.array,
        lowest,
        jax.lax.max,
        (1, *kernel, 1),
        (1, *stride, 1),
        ((0, 0), *pads, (0, 0)),
        window_dilation=(1, *dilation, 1),
    )
    return ChannelsLast(y)


def avg_pool(
    x: ChannelsLast,
    kernel: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] | int = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> ChannelsLast | None:
    """torch's 2-D average pooling over a `ChannelsLast`'s spatial axes (DenseNet's transitions,
    NF-ResNet's shortcuts): a windowed sum divided by torch's count per output position, a
    constant of the shapes. None for an integer dtype (the caller keeps torch's layout)."""
    if not jnp.issubdtype(x.array.dtype, jnp.floating):
        return None
    kernel, stride, padding, _, pads = _pool_window(x, kernel, stride, padding, 1, ceil_mode)
    zero = np.array(0, np.dtype(x.array.dtype))
    total = jax.lax.reduce_window(
        x.array, zero, jax.lax.add, (1, *kernel, 1), (1, *stride, 1), ((0, 0), *pads, (0, 0))
    )
    if divisor_override:
        return ChannelsLast(total / np.array(divisor_override, zero.dtype))
    counts = []
    for axis in range(2):
        size, k, s, p = x.array.shape[1 + axis], kernel[axis], stride[axis], padding[axis]
        starts = np.arange(total.shape[1 + axis]) * s - p
        ends = np.minimum(starts + k, size + p)  # a ceil-mode window stops at the padding's end
        if not count_include_pad:
            starts, ends = np.maximum(starts, 0), np.minimum(ends, size)
        counts.append(ends - starts)
    divisor = np.outer(*counts).astype(zero.dtype)[None, :, :, None]
    return ChannelsLast(total / divisor)


def upsample_bilinear(
    x: Any, output_size: Sequence[int] | None, align_corners: bool, scales: Sequence[float | None]
) -> Any:
    """torch's bilinear upsampling of an NCHW tensor, or of a `ChannelsLast` on its NHWC array (a
    `ChannelsLast` back): one pass per axis, W then H as torch's decomposition interpolates, each
    reading the two input rows of every output row. The decomposition gathers the four corners
    of every output pixel in torch's layout (LR-ASPP's and DeepLabV3's heads)."""
    kept = isinstance(x, ChannelsLast)
    array = x.array if kept else jnp.asarray(x)
    axes = (1, 2) if kept else (2, 3)
    if output_size is None:  # scale factors instead, as torch's `upsample_compute_output_size`
        factors = [float(s) for s in scales if s is not None]
        if len(factors) != len(axes):
            raise ValueError(f"bilinear upsampling takes an output size or 2 scale factors, not {scales}")
        output_size = [
            array.shape[a] * int(f) if int(f) == f else int(array.shape[a] * f)
            for a, f in zip(axes, factors, strict=True)
        ]
    dtype = array.dtype
    floating = jnp.issubdtype(dtype, jnp.floating)
    compute = jnp.promote_types(dtype, jnp.float32) if floating else jnp.float32
    y = array.astype(compute)
    for axis, size, scale in reversed(list(zip(axes, output_size, scales, strict=True))):
        low, high, weight = _linear_taps(y.shape[axis], int(size), align_corners, scale, np.dtype(compute))
        if size == y.shape[axis] and not weight.any() and (low == np.arange(size)).all():
            continue  # the same rows: torch returns them unchanged too
        shape = [1] * y.ndim
        shape[axis] = int(size)
        first, second = jnp.take(y, low, axis), jnp.take(y, high, axis)
        y = first + (second - first) * weight.reshape(shape)
    y = y.astype(dtype) if floating else jnp.round(y).astype(dtype)
    return ChannelsLast(y) if kept else y


def _linear_taps(
    size: int, rows: int, align_corners: bool, scale: float | None, dtype: np.dtype[Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each output row along one axis: the two input rows linear interpolation reads and the
    second's weight, computed in `dtype` (float32, or float64 for float64 tensors) as torch's
    decomposition computes them."""
    if align_corners:
        step = (size - 1) / (rows - 1) if rows > 1 else 0.0
    else:
        step = 1.0 / scale if scale is not None and scale > 0 else size / rows
    index = np.arange(rows, dtype=dtype)
    half = dtype.type(0.5)
    source = dtype.type(step) * (index if align_corners else index + half) - (0 if align_corners else half)
    source = np.maximum(source, 0).astype(dtype)
    low = source.astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    return low, high, np.clip(source - low.astype(dtype), 0, 1).astype(dtype)


def _materialized(padded: Any) -> Any:
    """`padded` computed once into its own buffer: XLA would otherwise fuse the element-wise
    producers and the padding into each tap of the sum that reads it, and recompute them there."""
    return jax.lax.optimization_barrier(padded)


def _depthwise(
    x: Any, weight: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> Any:
    """A depthwise convolution of NHWC `x` by OIHW `weight` (one filter per channel). In float32,
    a composite the server runs as its native kernel on CPU (`hloserve.kernels`), whose
    decomposition every other platform compiles."""
    taps = jnp.transpose(weight, (2, 3, 1, 0))[:, :, 0, :]  # (kh, kw, C): the stored HWIO
    attributes = {
        "stride_h": stride[0],
        "stride_w": stride[1],
        "pad_h": padding[0],
        "pad_w": padding[1],
        "dilation_h": dilation[0],
        "dilation_w": dilation[1],
    }
    if x.dtype != jnp.float32:
        return _depthwise_sum(x, taps, **attributes)
    return _DEPTHWISE_CONV2D(x, taps, **{name: np.int64(value) for name, value in attributes.items()})


def _depthwise_sum(
    x: Any,
    taps: Any,
    *,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
) -> Any:
    """A depthwise convolution of NHWC `x` by (kh, kw, C) `taps` as a sum of strided slices
    scaled per channel. XLA:CPU's grouped convolution took 6-80x longer on MobileNetV3's,
    EfficientNet's and ConvNeXt's shapes (jaxlib 0.10.2, one core)."""
    stride, padding, dilation = (
        (int(stride_h), int(stride_w)),
        (int(pad_h), int(pad_w)),
        (int(dilation_h), int(dilation_w)),
    )
    total = None
    for i, j, tap in _taps(x, taps.shape[:2], stride, padding, dilation):
        term = tap * taps[i, j]
        total = term if total is None else total + term
    return total


_DEPTHWISE_CONV2D = jax.lax.composite(_depthwise_sum, name=DEPTHWISE_CONV2D)


def _taps(
    x: Any, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> Iterator[tuple[int, int, Any]]:
    """Each kernel tap (i, j) of a convolution of NHWC `x` that reads more than padding: the
    strided slice of the padded input (computed once) that the tap multiplies."""
    kh, kw = kernel
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    padded = _materialized(jnp.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0))))
    rows = (padded.shape[1] - dh * (kh - 1) - 1) // sh + 1
    columns = (padded.shape[2] - dw * (kw - 1) - 1) // sw + 1
    for i in range(kh):
        for j in range(kw):
            if not (_live(i, x.shape[1], rows, sh, ph, dh) and _live(j, x.shape[2], columns, sw, pw, dw)):
                continue  # it reads padding only: adds zeros
            last = (i * dh + (rows - 1) * sh + 1, j * dw + (columns - 1) * sw + 1)
            end = (padded.shape[0], *last, padded.shape[3])
            yield i, j, jax.lax.slice(padded, (0, i * dh, j * dw, 0), end, (1, sh, sw, 1))


def _live(tap: int, size: int, rows: int, stride: int, padding: int, dilation: int) -> bool:
    """Whether a convolution's kernel tap `tap` (along one axis) reads any of the `size` input
    elements, not only the `padding` on either side: with the large dilations of atrous heads
    (DeepLabV3's rates 24 and 36 over a 14x14 map at 224 pixels) most taps read padding alone."""
    first = tap * dilation
    return first + (rows - 1) * stride >= padding and first <= padding + size - 1


def _cropped(
    weight: Any, shape: Sequence[int], stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> tuple[Any, list[int]]:
    """OIHW `weight` without the rows and columns of taps that read padding only, and the
    padding that keeps the output's size; the same where cropping would need uneven padding."""
    kept, pads = [], []
    for axis, (size, s, p, d) in enumerate(zip(shape, stride, padding, dilation, strict=True)):
        k = weight.shape[2 + axis]
        rows = (size + 2 * p - d * (k - 1) - 1) // s + 1
        live = [i for i in range(k) if _live(i, size, rows, s, p, d)]
        low = p - live[0] * d
        high = (rows - 1) * s + d * (len(live) - 1) + 1 - size - low
        if low != high or low < 0:
            return weight, list(padding)
        kept.append((live[0], live[-1] + 1))
        pads.append(low)
    (i0, i1), (j0, j1) = kept
    return weight[:, :, i0:i1, j0:j1], pads


_ATROUS_SHARE = 0.5
"""A dilated convolution (stride 1) whose taps read the input for at most this share of a full
convolution's work runs as `_atrous`; XLA's convolution computes the rest."""


def _atrous_parts(
    shape: Sequence[int], kernel: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> list[tuple[int, int, int, int, int, int]]:
    """Per kernel tap (i, j) of a stride-1 convolution, the output rows [r0, r1) and columns
    [c0, c1) where it reads the input rather than padding: (i, j, r0, r1, c0, c1)."""
    spans = []
    for size, k, p, d in zip(shape, kernel, padding, dilation, strict=True):
        out = size + 2 * p - d * (k - 1)
        spans.append([(t, max(0, p - t * d), min(out, size + p - t * d)) for t in range(k)])
    return [(i, j, r0, r1, c0, c1) for i, r0, r1 in spans[0] for j, c0, c1 in spans[1] if r0 < r1 and c0 < c1]


def _atrous(x: Any, weight: Any, padding: Sequence[int], dilation: Sequence[int]) -> Any:
    """A stride-1 dilated convolution of NHWC `x` by OIHW `weight` as one dot per tap over only
    the part of the input the tap reads, each added into its part of the output. DeepLabV3's
    rate-12 convolution over a 14x14 map reads the input for 18% of a full convolution's work,
    the rest padding; YNNPACK computed it all (half of the model's time at batch 4)."""
    hwio = jnp.transpose(weight, (2, 3, 1, 0))
    (ph, pw), (dh, dw) = padding, dilation
    rows = x.shape[1] + 2 * ph - dh * (weight.shape[2] - 1)
    columns = x.shape[2] + 2 * pw - dw * (weight.shape[3] - 1)
    total = None
    for i, j, r0, r1, c0, c1 in _atrous_parts(x.shape[1:3], weight.shape[2:], padding, dilation):
        part = x[:, r0 + i * dh - ph : r1 + i * dh - ph, c0 + j * dw - pw : c1 + j * dw - pw, :]
        y = jax.lax.dot_general(part, hwio[i, j], (((3,), (0,)), ((), ())))
        y = jnp.pad(y, ((0, 0), (r0, rows - r1), (c0, columns - c1), (0, 0)))
        total = y if total is None else total + y
    return total


def _atrous_share(
    shape: Sequence[int], weight: Any, padding: Sequence[int], dilation: Sequence[int]
) -> float:
    """The share of a full convolution's work that `_atrous` does."""
    kh, kw = (int(k) for k in weight.shape[2:])
    rows, columns = (
        s + 2 * p - d * (k - 1) for s, p, d, k in zip(shape, padding, dilation, (kh, kw), strict=True)
    )
    work = sum(
        (r1 - r0) * (c1 - c0) for _, _, r0, r1, c0, c1 in _atrous_parts(shape, (kh, kw), padding, dilation)
    )
    return float(work / (kh * kw * rows * columns))


def _grouped(
    x: Any,
    weight: Any,
    groups: int,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> Any:
    """A grouped convolution with few inputs per group (RegNet's 8) as one element-wise fusion:
    per tap and per input channel of a group, that channel times its row of weights to the
    group's outputs. XLA:CPU's grouped convolution took 2-5x longer on RegNetY-400MF's shapes."""
    out_channels, per_group, kh, kw = weight.shape
    per_tap = jnp.transpose(weight, (2, 3, 1, 0)).reshape(kh, kw, per_group, groups, -1)
    total = None
    for i, j, tap in _taps(x, (kh, kw), stride, padding, dilation):
        tap = tap.reshape(*tap.shape[:3], groups, per_group)
        for k in range(per_group):
            term = tap[..., k : k + 1] * per_tap[i, j, k]
            total = term if total is None else total + term
    assert total is not None
    return total.reshape(*total.shape[:3], out_channels)


def convolution(
    x: Any,
    weight: Any,
    bias: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> ChannelsLast:
    """A 2-D convolution (not transposed) of `x` (NCHW tensor or `ChannelsLast`) by torch's OIHW
    `weight`, computed NHWC."""
    array = x.array if isinstance(x, ChannelsLast) else jnp.transpose(jnp.asarray(x), TO_NHWC)
    weight = jnp.asarray(weight).astype(array.dtype)
    stride, padding, dilation = (list(v) * (2 // len(v)) for v in (stride, padding, dilation))
    if groups == 1:
        weight, padding = _cropped(weight, array.shape[1:3], stride, padding, dilation)
    out_channels, per_group, kh, kw = weight.shape
    if groups > 1 and per_group == 1 and groups == out_channels:
        y = _depthwise(array, weight, stride, padding, dilation)
    elif groups > 1 and per_group * kh * kw <= _GROUPED_TERMS:
        y = _grouped(array, weight, groups, stride, padding, dilation)
    elif groups == 1 and (kh, kw) == (1, 1) and per_group <= _DENSE_TERMS:
        y = _grouped(array, weight, 1, stride, padding, dilation)
    elif (
        groups == 1
        and stride == [1, 1]
        and dilation != [1, 1]
        and _atrous_share(array.shape[1:3], weight, padding, dilation) <= _ATROUS_SHARE
    ):
        y = _atrous(array, weight, padding, dilation)
    elif groups == 1 and (kh, kw) == (1, 1) and padding == [0, 0]:
        strided = array[:, :: stride[0], :: stride[1], :] if stride != [1, 1] else array
        hwio = jnp.transpose(weight, (2, 3, 1, 0))  # cancels the program's OIHW restore
        y = jax.lax.dot_general(strided, hwio[0, 0], (((3,), (0,)), ((), ())))
    else:
        y = jax.lax.conv_general_dilated(
            array,
            jnp.transpose(weight, (2, 3, 1, 0)),
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
        )
    return ChannelsLast(y if bias is None else y + jnp.asarray(bias).astype(y.dtype))
