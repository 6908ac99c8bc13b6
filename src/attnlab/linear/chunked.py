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
state is then known before the scan, for all chunks at once::

    O_n     = P_n + Q'_n S_n            P = A W_v,  Q' = scale·exp(g)⊙Q - A W_k
    S_{n+1} = M_n S_n + R_n             M = diag(exp(g_C)) - K_endᵀ W_k,  R = K_endᵀ W_v

where ``K_end`` holds ``exp(g_C - g_j) ⊙ k_j``. The scan over chunks is one matmul a chunk (an
elementwise product for additive rules, whose ``M`` is diagonal); the outputs are one batched
matmul after it. Gradients come from autograd through these few large operations; the inverse
``T`` has its own two-matmul backward. Memory: the states at chunk starts, ``O(T·Dk·Dv / C)``.

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
import torch.nn.functional as F

from attnlab.linear._call import LinearCall

__all__ = ["run_chunked", "CHUNK", "SUB"]

CHUNK = 64  # positions per chunk (measured against 32 and 128 on a CPU)
SUB = 16  # positions per sub-chunk of per-channel decays (the pairwise block is (SUB, SUB, Dk))


class _UnitLowerInverse(torch.autograd.Function):
    """``(I + L)⁻¹`` of strictly lower triangular ``L`` ``(..., C, C)``; backward ``-Tᵀ dT Tᵀ`` (lower part)."""

    @staticmethod
    def forward(ctx, L):
        eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
        T = torch.linalg.solve_triangular(L + eye, eye.expand_as(L), upper=False, unitriangular=True)
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, grad):
        (T,) = ctx.saved_tensors
        Tt = T.mT
        return -(Tt @ grad @ Tt).tril(-1)


def _pairs(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None, *, strict: bool) -> torch.Tensor:
    """``M_ij = Σ_c a_ic b_jc exp(g_ic - g_jc)`` for ``j <= i`` (``j < i`` if strict), else 0.

    Args:
        a, b: ``(..., C, Dk)``. g: None (no decay), ``(..., C)`` (one per position) or
            ``(..., C, Dk)`` (per channel): the log-decay summed within the chunk, non-increasing.

    Returns:
        ``(..., C, C)``.
    """
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if g is None:
        return (a @ b.mT).masked_fill(~keep, 0)
    if g.dim() == a.dim() - 1:  # one decay per position
        gap = (g[..., :, None] - g[..., None, :]).masked_fill(~keep, float("-inf"))
        return (a @ b.mT) * gap.exp()
    return _channel_pairs(a, b, g, keep)


def _channel_pairs(a, b, g, keep) -> torch.Tensor:
    """:func:`_pairs` for per-channel decays, by sub-chunks (no exponent above 0)."""
    C, Dk = a.shape[-2:]
    s = SUB if C % SUB == 0 else C
    lead = a.shape[:-2]
    # Inside each sub-chunk: the pairwise factor, (..., C/s, s, s, Dk), masked before exp.
    gs, as_, bs = (x.reshape(*lead, C // s, s, Dk) for x in (g, a, b))
    inner = keep[:s, :s, None]
    gap = (gs[..., :, None, :] - gs[..., None, :, :]).masked_fill(~inner, float("-inf"))
    diag = (as_[..., :, None, :] * bs[..., None, :, :] * gap.exp()).sum(-1)  # (..., C/s, s, s)
    rows = []
    for i in range(C // s):
        r = i * s
        ref = g[..., r:r + 1, :]  # the query sub-chunk's first position: g_j >= ref >= g_i
        left = (a[..., r:r + s, :] * (g[..., r:r + s, :] - ref).exp()) @ (b[..., :r, :] * (ref - g[..., :r, :]).exp()).mT
        rows.append(torch.cat([left, diag[..., i, :, :], a.new_zeros(*lead, s, C - r - s)], dim=-1))
    return torch.cat(rows, dim=-2)  # (..., C, C)


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
        return out[:, :, :self.T] if self.take is None else out.index_select(2, self.back)


def _prepare(q, k, v, decay, beta, scale):
    """The chunk-parallel part: ``P, Q', M, R`` of the module docstring, for all chunks at once.

    Args: ``(B, Hv, N, C, D)`` tensors (q and k already per value head), decay None or
    ``(B, Hv, N, C[, Dk])``, beta None or ``(B, Hv, N, C)``.

    Returns:
        ``P (B, Hv, N, C, Dv)``, ``Q' (B, Hv, N, C, Dk)``, ``M`` (``(B, Hv, N, Dk, Dk)``, or the
        diagonal ``(B, Hv, N, Dk)`` / ``(B, Hv, N, 1)`` for additive rules), ``R (B, Hv, N, Dk, Dv)``.
    """
    g = None if decay is None else decay.cumsum(3)  # (B, Hv, N, C[, Dk]), non-increasing
    A = _pairs(q, k, g, strict=False) * scale  # (B, Hv, N, C, C)
    if g is None:
        q_in, k_in, k_end, m_diag = q * scale, k, k, q.new_ones(1).expand(*q.shape[:3], 1)
    else:
        g_ = g if g.dim() == q.dim() else g[..., None]  # (B, Hv, N, C, Dk or 1)
        g_end = g_[..., -1:, :]  # (B, Hv, N, 1, Dk or 1)
        q_in, k_in = q * (g_.exp() * scale), k * g_.exp()
        k_end, m_diag = k * (g_end - g_).exp(), g_end.squeeze(-2).exp()
    if beta is None:
        return A @ v, q_in, m_diag, k_end.mT @ v
    L = _pairs(k, k, g, strict=True) * beta[..., None]  # (B, Hv, N, C, C)
    T = _UnitLowerInverse.apply(L)
    w_v, w_k = T @ (v * beta[..., None]), T @ (k_in * beta[..., None])  # (B, Hv, N, C, Dv / Dk)
    M = torch.diag_embed(m_diag.expand(*k.shape[:3], k.shape[-1])) - k_end.mT @ w_k  # (B, Hv, N, Dk, Dk)
    return A @ w_v, q_in - A @ w_k, M, k_end.mT @ w_v


def _scan(M, R, S, first: int, count: int, starts: list) -> torch.Tensor:
    """Steps ``S_{n+1} = M_n S_n + R_n`` over chunks ``first … first+count-1``; appends each ``S_n``."""
    diagonal = M.dim() == R.dim() - 1
    for n in range(first, first + count):
        starts.append(S)
        S = (M[:, :, n, :, None] * S if diagonal else M[:, :, n] @ S) + R[:, :, n]
    return S


def run_chunked(call: LinearCall, *, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form of a checked call: ``(out (B, Hv, T, Dv) in q's dtype, final state)``.

    Args:
        call: a checked call with ``T > 0``. chunk: positions per chunk.

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
    dtype, layout = call.state_dtype, _Layout(call, chunk)
    q, k = (x.to(dtype).repeat_interleave(call.groups, dim=1) if call.groups > 1 else x.to(dtype)
            for x in (call.q, call.k))  # (B, Hv, T, Dk)
    q, k, v = (layout.chunks(x) for x in (q, k, call.v.to(dtype)))  # (B, Hv, N, C, D)
    decay, beta = (None if x is None else layout.chunks(x.to(dtype)) for x in (call.decay, call.beta))
    P, q_in, M, R = _prepare(q, k, v, decay, beta, call.scale)
    init = (call.initial_state.to(dtype) if call.initial_state is not None
            else q.new_zeros(call.state_shape))  # (B or N docs, Hv, Dk, Dv)
    starts: list[torch.Tensor] = []
    if layout.spans is None:
        state = _scan(M, R, init, 0, layout.N, starts)
    else:
        state = torch.cat([_scan(M, R, init[d:d + 1], first, count, starts)
                           for d, (first, count) in enumerate(layout.spans)])
    S = torch.stack(starts, dim=2)  # (B, Hv, N, Dk, Dv): the state entering each chunk
    out = layout.positions(P + q_in @ S)
    return out.to(call.q.dtype), state
