"""What ran: a call under torch.profiler, the attnlab backend that served it and its kernels.

While a profiler is on, :func:`attnlab.attention` runs its backend inside the range
``attnlab.<backend>`` (:func:`labelled`; with no profiler on it reads one flag and opens
nothing). :func:`observe` runs a function under torch.profiler and reads, per range, the
kernels seen below it, named by :data:`KERNELS`, the one table from PyTorch's op names to
words. So what ran is read, not predicted: PyTorch's own selector (``_fused_sdp_choice``,
which dispatch asks) disagrees with real dispatch under compile (pytorch #113524).

Example:
    >>> import torch, attnlab
    >>> q = torch.randn(1, 2, 8, 4)                          # (B, H, T, D)
    >>> _, ran = observe(attnlab.attention, q, q, q, backend="reference")
    >>> ran.backend
    'reference'
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["KERNELS", "RANGE", "Ran", "labelled", "observe", "mismatch"]

RANGE = "attnlab."  # + a backend's name: the profiler range dispatch opens around it

# PyTorch's op names (a compiled graph's by prefix) -> (kind, words). The SDPA kinds are those
# sdpa.kernel_for predicts; "compiled" contains the ops it calls; "op" is a plain operation.
KERNELS: dict[str, tuple[str, str]] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("flash", "SDPA's flash kernel for CPU"),
    "aten::_scaled_dot_product_flash_attention": ("flash", "SDPA's flash kernel (FlashAttention-2)"),
    "aten::_flash_attention_forward": ("flash", "the FlashAttention-2 forward"),
    "aten::_scaled_dot_product_efficient_attention": ("efficient", "SDPA's memory-efficient kernel"),
    "aten::_efficient_attention_forward": ("efficient", "the memory-efficient forward"),
    "aten::_scaled_dot_product_cudnn_attention": ("cudnn", "SDPA's cuDNN kernel"),
    "aten::_scaled_dot_product_fused_attention_overrideable": ("fused", "the device's own fused SDPA kernel"),
    "aten::_scaled_dot_product_attention_math": ("math", "SDPA's math fallback (matmul, softmax, matmul)"),
    "aten::_scaled_dot_product_attention_math_for_mps": ("math", "SDPA's math fallback for MPS"),
    "## Call CompiledFxGraph": ("compiled", "a compiled graph (Inductor's generated code)"),
    "aten::matmul": ("op", "matmul"),
    "aten::bmm": ("op", "batched matmul"),
    "aten::baddbmm": ("op", "batched matmul-add"),
    "aten::softmax": ("op", "softmax"),
    "aten::_softmax": ("op", "softmax"),
    "aten::exp": ("op", "exp"),
}
_PREFIXES = ("## Call CompiledFxGraph",)  # names that go on with a graph's hash
SDPA_KINDS = ("flash", "efficient", "cudnn", "fused", "math")


def labelled(name: str, fn: Callable, *args):
    """``fn(*args)`` inside the profiler range ``attnlab.<name>``: dispatch calls it only while a
    profiler is on (``torch.autograd.profiler._is_profiler_enabled``).

    Example:
        >>> labelled("reference", max, 1, 2)
        2
    """
    with record_function(RANGE + name):
        return fn(*args)


@dataclass(frozen=True)
class Ran:
    """What a profiled run executed.

    Attributes:
        calls: ``(backend, ranges)`` per attnlab backend, in the order they first ran.
        kernels: ``(backend, op, count)``: the :data:`KERNELS` ops under each backend's ranges
            (outermost only: a kernel's own parts are not listed), and the SDPA and compiled
            ones outside every range (backend None: a compiled graph may drop the range).
        device_kernels: names of the device kernels those ops launched (CUDA only).

    Example:
        >>> Ran((("sdpa", 1),), (("sdpa", "aten::_scaled_dot_product_flash_attention_for_cpu", 1),), ()).sdpa_kernel
        'flash'
    """

    calls: tuple[tuple[str, int], ...]
    kernels: tuple[tuple[str | None, str, int], ...]
    device_kernels: tuple[str, ...]

    @property
    def backend(self) -> str | None:
        """The first backend that ran (None: no attnlab range was seen)."""
        return self.calls[0][0] if self.calls else None

    @property
    def sdpa_kernel(self) -> str | None:
        """The kind (flash, efficient, cudnn, fused, math) of the first SDPA kernel of the first
        backend (outside every range when none was seen), or None."""
        for backend, op, _ in self.kernels:
            if backend == self.backend and _row(op)[0] in SDPA_KINDS:
                return _row(op)[0]
        return None

    def lines(self) -> list[str]:
        """What ran, one line per backend (and one for kernels outside every range).

        Example:
            >>> Ran((("chunked", 1),), (("chunked", "aten::matmul", 4),), ()).lines()
            ["ran 'chunked' (1 call): matmul x4 [aten::matmul]"]
        """
        owners = [name for name, _ in self.calls] + ([None] if any(b is None for b, _, _ in self.kernels) else [])
        counts = dict(self.calls)
        lines = []
        for owner in owners:
            parts = [f"{_row(op)[1]} x{n} [{op}]" for b, op, n in self.kernels if b == owner]
            seen = ", ".join(parts) or "no kernel of the table (nothing to compute?)"
            who = (f"ran {owner!r} ({counts[owner]} call{'s' * (counts[owner] != 1)})" if owner is not None
                   else "ran outside any attnlab range (a compiled graph)")
            lines.append(f"{who}: {seen}")
        if not owners:
            lines.append("ran: no attnlab backend and no attention kernel was seen")
        if self.device_kernels:
            lines.append("device kernels: " + ", ".join(self.device_kernels))
        return lines


def _row(op: str) -> tuple[str, str] | None:
    """``op``'s ``(kind, words)`` in :data:`KERNELS`, or None."""
    return KERNELS.get(_key(op))


def _key(op: str) -> str:
    """``op`` as :data:`KERNELS` names it (a compiled graph without its hash)."""
    return next((p for p in _PREFIXES if op.startswith(p)), op)


def observe(fn: Callable, *args, **kwargs) -> tuple[object, Ran]:
    """Run ``fn(*args, **kwargs)`` once under torch.profiler (CPU; CUDA too when a tensor
    argument is on CUDA) and read what ran. The profiler stops even if ``fn`` raises.

    Returns:
        ``(fn's result, Ran)``.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 8, 4)
        >>> _, ran = observe(torch.nn.functional.scaled_dot_product_attention, q, q, q)
        >>> ran.backend is None, ran.sdpa_kernel
        (True, 'flash')
    """
    cuda = any(isinstance(a, Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's own start/stop lines, unless asked for
    with profile(activities=activities) as prof:
        result = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
    return result, _read(prof.events())


def _read(events) -> Ran:
    """The attnlab ranges and the table's kernels of a profiler's events."""
    calls, kernels, device = Counter(), Counter(), []
    for event in events:
        if event.cpu_parent is None:
            _walk(event, None, calls, kernels, device)
    listed = [(b, op, n) for (b, op), n in kernels.items() if b is not None or _row(op)[0] != "op"]
    return Ran(tuple(calls.items()), tuple(listed), tuple(dict.fromkeys(device)))


def _walk(event, backend: str | None, calls: Counter, kernels: Counter, device: list) -> None:
    """Count ``event``'s subtree: ranges, the outermost table ops, their device kernels."""
    name = event.name
    if name.startswith(RANGE):
        backend = name[len(RANGE):]
        calls[backend] += 1
    row = _row(name)
    if row is not None:
        kernels[backend, _key(name)] += 1
        if row[0] != "compiled":  # a graph contains its kernels; a kernel's parts are its own
            device += _device_kernels(event)
            return
    for child in event.cpu_children:
        _walk(child, backend, calls, kernels, device)


def _device_kernels(event) -> list[str]:
    """The device kernels ``event`` and its subtree launched, their names cut at a template."""
    names = [k.name.split("<")[0].split("(")[0] for k in getattr(event, "kernels", [])]
    for child in event.cpu_children:
        names += _device_kernels(child)
    return names


def mismatch(ran: Ran, backend: str, kernel: str | None) -> str | None:
    """How what ran differs from the prediction (``backend``; ``kernel``, SDPA's predicted kind,
    or None not to compare), in words; None where they agree.

    Example:
        >>> ran = Ran((("sdpa", 1),), (("sdpa", "aten::_scaled_dot_product_attention_math", 1),), ())
        >>> mismatch(ran, "sdpa", "flash")
        "predicted SDPA's flash kernel, but its math kernel ran"
    """
    if ran.backend is None:  # nothing labelled (a compiled graph may drop the range): see its lines
        return None
    if ran.backend != backend or len(ran.calls) > 1:
        seen = " then ".join(repr(name) for name, _ in ran.calls)
        return f"predicted backend {backend!r}, but {seen} ran"
    if kernel is not None and ran.sdpa_kernel is not None and ran.sdpa_kernel != kernel:
        return f"predicted SDPA's {kernel} kernel, but its {ran.sdpa_kernel} kernel ran"
    return None
