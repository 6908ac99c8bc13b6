"""The modules attnlab's MultiHeadAttention is compared with, written as their authors wrote them.

* :class:`SeedMultiHeadAttention` -- the multi-head module of the tutorial "Attention for your
  Transformers": three projections and an explicit masked softmax over the full score matrix.
* :class:`NanoGPTAttention` -- nanoGPT's ``CausalSelfAttention``: one fused projection and
  ``F.scaled_dot_product_attention(is_causal=True)``.
* :class:`CompiledFlex` -- ``torch.compile(flex_attention)`` with the block mask
  ``create_block_mask`` builds from a plain mask-mod function, as FlexAttention's documentation
  writes it; :func:`flex_mask_mods` -- the sparse suite's masks as such functions.

The benchmark suites time them; the tests use them as independent references.

Example:
    >>> import torch
    >>> NanoGPTAttention(8, 2)(torch.randn(1, 5, 8)).shape
    torch.Size([1, 5, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import masks

try:  # FlexAttention appeared in PyTorch 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    create_block_mask = flex_attention = None

__all__ = ["SeedMultiHeadAttention", "NanoGPTAttention", "CompiledFlex", "flex_mask_mods", "sparse_cases"]


class SeedMultiHeadAttention(nn.Module):
    """The tutorial "Attention for your Transformers"'s MultiHeadAttention as written: explicit masked softmax, O(T^2) scores.

    Shapes:
        x: ``(B, T, d_in)`` -> ``(B, T, d_out)``.

    Example:
        >>> SeedMultiHeadAttention(8, 8, 16, 0.0, 2)(torch.randn(1, 5, 8)).shape
        torch.Size([1, 5, 8])
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x: Tensor) -> Tensor:
        b, num_tokens, _ = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        shape = (b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.view(shape).transpose(1, 2)  # (b, H, T, hd)
        queries = queries.view(shape).transpose(1, 2)
        values = values.view(shape).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, H, T, T)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / self.head_dim**0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).contiguous()  # (b, T, H, hd)
        return self.out_proj(context_vec.view(b, num_tokens, self.d_out))


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: fused ``c_attn``, SDPA with ``is_causal=True``, ``c_proj``;
    given ``attn_mask`` (a padded batch's causal AND padding mask, as its user builds it), SDPA
    takes that mask instead.

    Shapes:
        x: ``(B, T, C)``, attn_mask: bool ``(B, 1, T, T)`` -> ``(B, T, C)``.

    Example:
        >>> NanoGPTAttention(8, 2)(torch.randn(1, 5, 8)).shape
        torch.Size([1, 5, 8])
    """

    def __init__(self, n_embd: int, n_head: int, *, bias: bool = True):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        heads = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, C)


def sparse_cases(t: int) -> dict[str, object]:
    """The structured masks the sparse suite times, as mask mods with bounds (causal inside).

    The document ids are prepared once (:func:`attnlab.masks.prepare`), as a model prepares a
    batch's layout once for all its layers and as FlexAttention's users build a ``BlockMask``
    once; the tensor-free mods need no preparing (dispatch does it once per shape).

    Example:
        >>> sorted(sparse_cases(64))
        ['chunked-local 1024', 'packed 8 docs', 'prefix-LM T/4', 'window 256']
    """
    return {
        "window 256": masks.sliding_window_mod(t, t, 256),
        "packed 8 docs": masks.prepare(masks.document_mod(torch.arange(t) // max(1, t // 8)), tq=t, tk=t),
        "prefix-LM T/4": masks.prefix_lm_mod(t, t, t // 4),
        "chunked-local 1024": masks.chunked_local_mod(t, t, 1024),
    }


def flex_mask_mods(t: int) -> dict:
    """The masks of :func:`sparse_cases` as a FlexAttention user writes them:
    plain functions closing over their parameters (attention-gym's style), causal inside.

    Example:
        >>> mods = flex_mask_mods(512)
        >>> bool(mods["window 256"](0, 0, torch.tensor(300), torch.tensor(44)))
        False
    """
    window, chunk, prefix = 256, 1024, t // 4
    documents = torch.arange(t) // max(1, t // 8)

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def packed_documents(b, h, q_idx, kv_idx):
        return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    def chunked_local(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)

    return {"window 256": sliding_window, "packed 8 docs": packed_documents,
            "prefix-LM T/4": prefix_lm, "chunked-local 1024": chunked_local}


class CompiledFlex:
    """``torch.compile(flex_attention)`` with its own block mask, built once from ``mask_mod``.

    What FlexAttention's documentation writes: ``create_block_mask(mask_mod, None, None, Tq, Tk)``
    (one block mask for every batch row and head) and the compiled kernel; the block mask is
    built here, outside any timing. Each new ``mask_mod`` function compiles the kernel anew.

    Shapes:
        q ``(B, H, Tq, D)``, k and v ``(B, H, Tk, D)`` -> ``(B, H, Tq, D)``.

    Example:
        >>> flex = CompiledFlex(lambda b, h, q, kv: q >= kv, 128, 128)  # doctest: +SKIP
        >>> flex(q, k, v).shape  # doctest: +SKIP
        torch.Size([1, 8, 128, 64])
    """

    def __init__(self, mask_mod, q_len: int, kv_len: int, *, device: str = "cpu"):
        if flex_attention is None:
            raise RuntimeError(f"torch {torch.__version__} has no FlexAttention (needs 2.5+)")
        self.block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)
        self.kernel = torch.compile(flex_attention, dynamic=False)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with torch._dynamo.config.patch(recompile_limit=64):  # one variant per mask mod and shape
            return self.kernel(q, k, v, block_mask=self.block_mask)
