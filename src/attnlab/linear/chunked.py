"""The chunked form of linear attention: matmuls inside each chunk, one small step between chunks.

The sequence is cut into chunks of ``C`` positions. Inside a chunk, with ``S`` the state at its
start and ``g_i`` the log-decay summed from the chunk's start to position ``i`` (a vector over key
channels; a scalar rule repeats it), every rule of :mod:`attnlab.linear.reference` reads::

    S_i   = diag(exp(g_i)) S + Σ_{j<=i} diag(exp(g_i - g_j)) k_j u_jᵀ
    o_i   = scale · (exp(g_i) ⊙ q_i)ᵀ S + scale · Σ_{j<=i} A_ij u_j,   A_ij = Σ_c q_ic k_jc exp(g_ic - g_jc)

with ``u_j = v_j`` for the additive rule. The delta rule writes ``u_i = beta_i (v_i - S'_iᵀ k_i)``,
which depends on the earlier ``u_j`` of the chunk: stacked, ``(I + L) U = beta·V - beta·(exp(g)⊙K) S``
with ``L_ij = beta_i Σ_c k_ic k_jc exp(g_ic - g_jc)`` for ``j < i``. ``T = (I + L)⁻¹`` (unit lower
triangular, the WY/UT representation of DeltaNet) is computed once per chunk, so
``U = W_v - W_k S`` with ``W_v = T beta V`` and ``W_k = T beta (exp(g) ⊙ K)``. Everything but the
state is known before the scan, for all chunks at once; the scan over chunks is then two matmuls
a chunk (``C·Dk·Dv`` each), and the outputs one batched matmul after it::

    U_n     = W_v - W_k S_n                                (additive rules: U = V, known)
    S_{n+1} = diag(exp(g_C)) S_n + K_endᵀ U_n               K_end: rows exp(g_C - g_j) ⊙ k_j
    O_n     = scale · (exp(g) ⊙ Q) S_n + A U_n

The scans are ``torch.autograd.Function`` s whose backward runs the chunks in reverse (two matmuls
a chunk) and forms the other gradients as batched products over all chunks; the inverse ``T``
has a two-matmul backward; the rest is autograd through a few large operations. Memory: the
states entering each chunk, ``O(T·Dk·Dv / C)``, ``O(T·C)`` for the within-chunk matrices and,
for per-channel decays, ``O(T·SUB·Dk)`` for the pairwise factors inside sub-chunks.

Decay factors never grow: every exponent is ``g_i - g_j`` with ``j <= i`` (or ``g_C - g_j``,
``g_i``), so log-decays as low as -20 a step stay finite. Per-channel decays cannot factor
``exp(g_ic - g_jc)`` into a query part and a key part over a whole chunk without overflow; they
are split into sub-chunks of :data:`SUB` positions: across sub-chunks both parts are taken
relative to the query sub-chunk's first position (both exponents <= 0), inside one the factor
is formed pairwise.

Example:
    >>> import torch, attnlab
    >>> q, k = torch.randn(2, 1, 1, 70, 8, dtype=torch.float64).unbind(0)
    >>> v = torch.randn(1, 1, 70, 4, dtype=torch.float64)
    >>> decay = -torch.rand(1, 1, 70, 8, dtype=torch.float64); beta = torch.rand(1, 1, 70, dtype=torch.float64)
    >>> k = torch.nn.functional.normalize(k, dim=-1)
    >>> fast = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, backend="chunked")
    >>> slow = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, backend="reference")
    >>> bool((fast - slow).abs().max() < 1e-10)
    True
"""

from __future__ import annotations

import torch

from attnlab._checks import positive_int
from attnlab.linear._call import LinearCall

__all__ = ["run_chunked", "CHUNK", "SUB"]

CHUNK = 64  # positions per chunk (measured against 32 and 128 on a CPU)
SUB = 16  # positions per sub-chunk of per-channel decays (the pairwise block is (SUB, SUB, Dk))


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + tril(L, -1))⁻¹`` for ``L`` ``(..., C, C)``, by doubling diagonal blocks (L's diagonal is not read).

    The inverses of the diagonal blocks of size ``b`` are merged pairwise into those of size ``2b``:
    ``[[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ B A⁻¹, D⁻¹]]``, all pairs of all chunks in two batched
    matmuls a level (``log2 C`` levels; ``C`` a power of two times an odd block solved directly).
    """
    C = L.shape[-1]
    lead = L.shape[:-2]
    b = C
    while b % 2 == 0 and b > 8:
        b //= 2
    eye = torch.eye(b, dtype=L.dtype, device=L.device)
    # (..., C/b, b, b): the diagonal blocks of size b, inverted directly
    blocks = L.reshape(*lead, C // b, b, C // b, b).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    inv = torch.linalg.solve_triangular(blocks + eye, eye.expand_as(blocks), upper=False, unitriangular=True)
    while b < C:
        n = C // b  # blocks of size b; merge (2p, 2p+1)
        grid = L.reshape(*lead, n, b, n, b)
        below = grid.diagonal(offset=-1, dim1=-4, dim2=-2).movedim(-1, -3)[..., 0::2, :, :]  # (..., n/2, b, b)
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        corner = -(second @ below @ first)  # (..., n/2, b, b)
        top = torch.cat([first, torch.zeros_like(first)], dim=-1)
        bottom = torch.cat([corner, second], dim=-1)
        inv = torch.cat([top, bottom], dim=-2)  # (..., n/2, 2b, 2b)
        b *= 2
    return inv.reshape(*lead, C, C)


class _UnitLowerInverse(torch.autograd.Function):
    """``(I + tril(L, -1))⁻¹`` (L's diagonal and upper part are not read); backward ``-Tᵀ dT Tᵀ``, strictly lower."""

    @staticmethod
    def forward(ctx, L):
        T = _unit_lower_inverse(L)
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, grad):
        (T,) = ctx.saved_tensors
        Tt = T.mT
        return -(Tt @ grad @ Tt).tril(-1)


def _pairs(left: list, b: torch.Tensor, g: torch.Tensor | None) -> list:
    """``M_ij = Σ_c a_ic b_jc exp(g_ic - g_jc)`` for ``j <= i``, else 0, for each ``a`` of ``left``.

    Args:
        left: tensors ``a`` ``(..., C, Dk)``. b: ``(..., C, Dk)``. g: None (no decay), ``(..., C)``
            (one per position) or ``(..., C, Dk)`` (per channel): the log-decay summed within the
            chunk, non-increasing. The decay factors are formed once for every ``a``.

    Returns:
        one ``(..., C, C)`` lower triangular tensor for each ``a``.
    """
    C = b.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=b.device).tril()
    if g is None:
        return [(a @ b.mT).masked_fill(~keep, 0) for a in left]
    if g.dim() == b.dim() - 1:  # one decay per position
        factor = (g[..., :, None] - g[..., None, :]).masked_fill(~keep, float("-inf")).exp()
        return [(a @ b.mT) * factor for a in left]
    return _channel_pairs(left, b, g, keep)


def _channel_pairs(left: list, b: torch.Tensor, g: torch.Tensor, keep: torch.Tensor) -> list:
    """:func:`_pairs` for per-channel decays, by sub-chunks (no exponent above 0)."""
    C, Dk = b.shape[-2:]
    s = SUB if C % SUB == 0 else C
    lead = b.shape[:-2]
    # Inside each sub-chunk, b_j exp(g_i - g_j) for every pair: (..., C/s, s, s, Dk), masked before exp.
    gs = g.reshape(*lead, C // s, s, Dk)
    gap = (gs[..., :, None, :] - gs[..., None, :, :]).masked_fill(~keep[:s, :s, None], float("-inf"))
    b_pairs = gap.exp() * b.reshape(*lead, C // s, 1, s, Dk)
    # Across sub-chunks, relative to the query sub-chunk's first position r: g_j >= g_r >= g_i.
    refs = [g[..., r:r + 1, :] for r in range(0, C, s)]
    b_before = [b[..., :r, :] * (ref - g[..., :r, :]).exp() for r, ref in zip(range(0, C, s), refs)]
    out = []
    for a in left:
        diag = (a.reshape(*lead, C // s, s, 1, Dk) @ b_pairs.mT).squeeze(-2)  # (..., C/s, s, s)
        rows = []
        for i, (ref, before) in enumerate(zip(refs, b_before)):
            r = i * s
            cross = (a[..., r:r + s, :] * (g[..., r:r + s, :] - ref).exp()) @ before.mT  # (..., s, r)
            rows.append(torch.cat([cross, diag[..., i, :, :], a.new_zeros(*lead, s, C - r - s)], dim=-1))
        out.append(torch.cat(rows, dim=-2))  # (..., C, C)
    return out


class _Layout:
    """Where each position goes in the chunked layout ``(rows, Hv, N, C, ...)``.

    Without ``cu_seqlens`` each batch row is one sequence, padded at its end to a multiple of C.
    With it, every document of row 0 starts a chunk of its own (padded at its end), so each
    document's chunks are consecutive: ``spans[d] = (first chunk, chunk count)``. Padding is
    k = v = q = 0, decay = 0, beta = 0: a step that leaves the state as it is.
    """

    def __init__(self, call: LinearCall, C: int):
        T = call.q.shape[2]
        self.T, self.C = T, C
        if call.cu_seqlens is None:
            self.N = -(-T // C)
            self.pad, self.take, self.back, self.spans = self.N * C - T, None, None, None
            return
        take, back, spans = [], [], []
        for s, e in zip(call.starts[:-1], call.starts[1:]):
            n = -(-(e - s) // C)
            spans.append((len(take) // C, n))
            back.extend(range(len(take), len(take) + e - s))
            take.extend(list(range(s, e)) + [T] * (n * C - (e - s)))  # T: the zero row appended
        self.N, self.spans = len(take) // C, spans
        device = call.q.device
        self.take = torch.tensor(take, dtype=torch.long, device=device)
        self.back = torch.tensor(back, dtype=torch.long, device=device)

    def chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Hv, T, *rest)`` -> ``(B, Hv, N, C, *rest)``."""
        rest = x.shape[3:]
        if self.take is None:
            if self.pad:
                x = torch.cat([x, x.new_zeros(*x.shape[:2], self.pad, *rest)], dim=2)
        else:
            x = torch.cat([x, x.new_zeros(*x.shape[:2], 1, *rest)], dim=2).index_select(2, self.take)
        return x.reshape(*x.shape[:2], self.N, self.C, *rest)

    def positions(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, Hv, N, C, Dv)`` -> ``(B, Hv, T, Dv)``."""
        out = out.reshape(*out.shape[:2], self.N * self.C, out.shape[-1])
        if self.take is None:
            return out[:, :, :self.T] if self.pad else out
        return out.index_select(2, self.back)


def _intra(q, k, v, decay, beta, scale):
    """The within-chunk quantities of the module docstring, for all chunks at once.

    Args: ``(B, Hv, N, C, D)`` tensors (q and k already per value head), decay None or
    ``(B, Hv, N, C[, Dk])``, beta None or ``(B, Hv, N, C)``.

    Returns:
        ``A (B, Hv, N, C, C)`` (scaled), ``q_in`` (``scale·exp(g)⊙Q``), ``k_end``, ``gamma``
        ``(B, Hv, N, Dk or 1)`` (the decay over a whole chunk), and ``(w_v, w_k)`` for delta rules
        or ``(v, None)``.
    """
    g = None if decay is None else decay.cumsum(3)  # (B, Hv, N, C[, Dk]), non-increasing
    q = q * scale
    if g is None:
        q_in, k_end, gamma = q, k, q.new_ones(1).expand(*q.shape[:3], 1)
    else:
        g_ = g if g.dim() == q.dim() else g[..., None]  # (B, Hv, N, C, Dk or 1)
        g_end = g_[..., -1:, :]  # (B, Hv, N, 1, Dk or 1)
        q_in = q * g_.exp()
        k_end, gamma = k * (g_end - g_).exp(), g_end.squeeze(-2).exp()
    if beta is None:
        (A,) = _pairs([q], k, g)  # (B, Hv, N, C, C)
        return A, q_in, k_end, gamma, v, None
    # L's diagonal (beta_i k_i·k_i) is formed but never read: T = (I + strictly lower part of L)⁻¹
    b = beta[..., None]
    k_beta = k * b
    A, L = _pairs([q, k_beta], k, g)  # (B, Hv, N, C, C) each
    T = _UnitLowerInverse.apply(L)
    k_in_beta = k_beta if g is None else k_beta * g_.exp()
    return A, q_in, k_end, gamma, T @ (v * b), T @ k_in_beta  # W_v (B, Hv, N, C, Dv), W_k (..., Dk)


class _DecayScan(torch.autograd.Function):
    """Additive rules: ``S_{n+1} = gamma_n ⊙ S_n + R_n`` (gamma over key channels or one per head).

    ``gamma`` ``(B, Hv, N, Dk or 1)``, ``R`` ``(B, Hv, N, Dk, Dv)``, ``S0`` ``(B, Hv, Dk, Dv)``.
    Returns ``(starts (B, Hv, N, Dk, Dv), final (B, Hv, Dk, Dv))``: the state entering each chunk.
    """

    @staticmethod
    def forward(ctx, gamma, R, S0):
        starts, S = [], S0
        for gamma_n, R_n in zip(gamma.unbind(2), R.unbind(2)):
            starts.append(S)
            S = torch.addcmul(R_n, gamma_n[..., None], S)
        starts = _stack(starts, S0, (*S0.shape[:2], R.shape[2], *S0.shape[2:]), 2)
        ctx.save_for_backward(gamma, starts)
        return starts, S

    @staticmethod
    def backward(ctx, grad_starts, grad_final):
        gamma, starts = ctx.saved_tensors
        dS, after = _grad_or_zeros(grad_final, starts.sum(2)), []
        grad_starts = _grad_or_zeros(grad_starts, starts)
        for n in range(starts.shape[2] - 1, -1, -1):
            after.append(dS)  # d loss / d S_{n+1}
            dS = torch.addcmul(grad_starts[:, :, n], gamma[:, :, n, :, None], dS)
        grad_R = _stack(after[::-1], starts, starts.shape, 2)  # (B, Hv, N, Dk, Dv)
        return _sum_to(grad_R * starts, gamma), grad_R, dS


class _DeltaChunks(torch.autograd.Function):
    """Delta rules, the scan and the outputs: ``U_n = W_v - W_k S_n``, ``S_{n+1} = gamma_n ⊙ S_n + K_endᵀ U_n``,
    ``O_n = q_in S_n + A U_n``.

    ``A`` ``(B, Hv, N, C, C)``, ``q_in``, ``w_k``, ``k_end`` ``(B, Hv, N, C, Dk)``, ``w_v`` ``(B, Hv, N, C, Dv)``,
    ``gamma`` ``(B, Hv, N, Dk or 1)``, ``S0`` ``(B, Hv, Dk, Dv)``. Returns ``(O (B, Hv, N, C, Dv), final)``.
    The loop runs on ``(B·Hv, ...)`` views, a step one ``baddbmm`` and one ``bmm``; everything else,
    forward and backward, is one batched product over all chunks.
    """

    @staticmethod
    def forward(ctx, A, q_in, w_v, w_k, k_end, gamma, S0):
        B, Hv, N, C, Dv = w_v.shape
        flat = lambda x: x.reshape(B * Hv, *x.shape[2:])  # noqa: E731  (B·Hv, N, ...)
        w_v_, w_k_, k_end_, gamma_ = (flat(x) for x in (w_v, w_k, k_end, gamma))
        S, starts, us = flat(S0), [], []
        for n in range(N):
            starts.append(S)
            U = torch.baddbmm(w_v_[:, n], w_k_[:, n], S, alpha=-1)  # (B·Hv, C, Dv)
            us.append(U)
            S = torch.bmm(k_end_[:, n].mT, U).addcmul_(gamma_[:, n, :, None], S)
        starts, U = _stack(starts, S0, (B, Hv, N, w_k.shape[-1], Dv), 1), _stack(us, w_v, w_v.shape, 1)
        ctx.save_for_backward(A, q_in, w_k, k_end, gamma, starts, U)
        return (q_in @ starts).add_(A @ U), S.reshape(S0.shape)

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        A, q_in, w_k, k_end, gamma, starts, U = ctx.saved_tensors
        B, Hv, N, Dk, Dv = starts.shape
        flat = lambda x: x.reshape(B * Hv, *x.shape[2:])  # noqa: E731  (B·Hv, N, ...)
        w_k_, k_end_, gamma_ = (flat(x) for x in (w_k, k_end, gamma))
        grad_out = _grad_or_zeros(grad_out, U)
        grad_starts, grad_u = flat(q_in.mT @ grad_out), flat(A.mT @ grad_out)  # the outputs' share
        dS = flat(_grad_or_zeros(grad_final, starts.sum(2)))
        after, d_us = [], []
        for n in range(N - 1, -1, -1):
            after.append(dS)  # d loss / d S_{n+1}
            dU = torch.baddbmm(grad_u[:, n], k_end_[:, n], dS)  # (B·Hv, C, Dv)
            d_us.append(dU)
            dS = torch.baddbmm(torch.addcmul(grad_starts[:, n], gamma_[:, n, :, None], dS), w_k_[:, n].mT, dU,
                               alpha=-1)
        after, dU = _stack(after[::-1], starts, starts.shape, 1), _stack(d_us[::-1], U, U.shape, 1)
        grad_A, grad_q_in = grad_out @ U.mT, grad_out @ starts.mT
        grad_w_k, grad_k_end = -(dU @ starts.mT), U @ after.mT  # (B, Hv, N, C, Dk)
        return (grad_A, grad_q_in, dU, grad_w_k, grad_k_end, _sum_to(after * starts, gamma),
                dS.reshape(B, Hv, Dk, Dv))


def _stack(xs: list, like: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """The chunks' tensors ``xs`` stacked at ``dim`` and viewed as ``shape`` ``(B, Hv, N, ...)``; zeros if none."""
    return torch.stack(xs, dim=dim).reshape(shape) if xs else like.new_zeros(shape)


def _grad_or_zeros(grad, like):
    return torch.zeros_like(like) if grad is None else grad


def _sum_to(prod: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gamma`` ``(B, Hv, N, Dk or 1)`` from ``d S_{n+1} ⊙ S_n`` ``(B, Hv, N, Dk, Dv)``."""
    grad = prod.sum(-1)
    return grad.sum(-1, keepdim=True) if gamma.shape[-1] == 1 else grad


def _run_scan(A, q_in, k_end, gamma, w_v, w_k, S0, first: int, end: int):
    """The scan over chunks ``first … end-1`` from ``S0`` and their outputs: ``(O (B, Hv, n, C, Dv), final)``."""
    whole = first == 0 and end == A.shape[2]  # a slice of everything would copy in the backward
    part = lambda x: x if whole else x[:, :, first:end]  # noqa: E731
    if w_k is not None:
        return _DeltaChunks.apply(*(part(x) for x in (A, q_in, w_v, w_k, k_end, gamma)), S0)
    # additive: U = V, so each chunk's write K_endᵀ V is known before the scan
    starts, final = _DecayScan.apply(part(gamma), part(k_end).mT @ part(w_v), S0)
    return part(q_in) @ starts + part(A) @ part(w_v), final


def _chunk_for(call: LinearCall, chunk: int) -> int:
    """Positions per chunk: as many chunks as ``chunk`` needs for the longest sequence, each the next
    multiple of :data:`SUB` above an even share (a 25-token row is padded to 32, an 81-token one to
    2 x 48, not 2 x 64: the within-chunk work grows as ``C²``). Any chunk is exact."""
    ends = [call.q.shape[2]] if call.cu_seqlens is None else [e - s for s, e in zip(call.starts[:-1], call.starts[1:])]
    longest = max(ends)
    share = -(-longest // -(-longest // chunk))  # ceil(longest / the number of chunks)
    return min(chunk, SUB * -(-share // SUB))


def run_chunked(call: LinearCall, *, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form of a checked call: ``(out (B, Hv, T, Dv) in q's dtype, final state)``.

    Args:
        call: a checked call with ``T > 0``. chunk: positions per chunk (a multiple of :data:`SUB`
            for per-channel decays to use sub-chunks; any positive int is exact).

    Returns:
        ``out`` in q's dtype and the final state ``(B or N documents, Hv, Dk, Dv)`` in
        ``call.state_dtype``; both differentiable in every input.

    Example:
        >>> import torch
        >>> from attnlab.linear._call import linear_call
        >>> from attnlab.linear.reference import run_reference
        >>> q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
        >>> call = linear_call(q, q, q, decay=-torch.rand(1, 2, 9, dtype=torch.float64), beta=None, scale=None,
        ...                    initial_state=None, cu_seqlens=None)
        >>> out, state = run_chunked(call, chunk=4)
        >>> ref, ref_state = run_reference(call)
        >>> bool((out - ref).abs().max() < 1e-12 and (state - ref_state).abs().max() < 1e-12)
        True
    """
    dtype, layout = call.state_dtype, _Layout(call, _chunk_for(call, positive_int("chunk", chunk)))
    q, k = (x.to(dtype).repeat_interleave(call.groups, dim=1) if call.groups > 1 else x.to(dtype)
            for x in (call.q, call.k))  # (B, Hv, T, Dk)
    q, k, v = (layout.chunks(x) for x in (q, k, call.v.to(dtype)))  # (B, Hv, N, C, D)
    decay, beta = (None if x is None else layout.chunks(x.to(dtype)) for x in (call.decay, call.beta))
    A, q_in, k_end, gamma, w_v, w_k = _intra(q, k, v, decay, beta, call.scale)
    init = (call.initial_state.to(dtype) if call.initial_state is not None
            else q.new_zeros(call.state_shape))  # (B or N docs, Hv, Dk, Dv)
    spans = [(slice(None), 0, layout.N)] if layout.spans is None else [
        (slice(d, d + 1), first, first + count) for d, (first, count) in enumerate(layout.spans)]
    runs = [_run_scan(A, q_in, k_end, gamma, w_v, w_k, init[rows], first, end) for rows, first, end in spans]
    if len(runs) == 1:
        (out, state), = runs  # (B, Hv, N, C, Dv), (B, Hv, Dk, Dv)
    else:
        out = torch.cat([o for o, _ in runs], dim=2)  # (1, Hv, N, C, Dv)
        state = torch.cat([final for _, final in runs])  # (N docs, Hv, Dk, Dv)
    out = layout.positions(out)  # (B, Hv, T, Dv)
    return out.to(call.q.dtype), state
