"""Masks and score mods as views: a mask's block map, the difference of two masks, a score mod's change.

* :func:`mask_view` -- any mask (a bool tensor, a mask mod, a :class:`~attnlab.masks.PreparedMask`)
  as a **block map**: each ``block x block`` tile full, partial or empty, the sparsity a
  block-sparse kernel exploits. Click a block to see it cell by cell.
* :func:`mask_diff_view` -- two masks of one size: which blocks and cells only one of them allows.
* :func:`score_mod_view` -- a score mod as the change it makes to one head's scores and weights.
* :func:`show` -- what ``attnlab.show`` hands a mask, a mask mod or a score mod to.

Any size: the map is built one band of ``block`` query rows at a time, so memory is
O(T * block), never ``Tq x Tk``. A mask that is one key interval per query row (attnlab's
patterns and ANDs of them, through :func:`~attnlab.masks.prepare`) is classified from its
intervals alone (a tile is evaluated only where its segments, e.g. documents, are mixed), and
the page carries the intervals, from which the zoom computes any cell. Any other mask (a
tensor, an OR, a function of the user's) carries a bit tile per PARTIAL block, in block order,
up to ``budget`` bytes; full and empty blocks need none. The map is a canvas of one pixel per
block, shown :data:`MAP_PX` CSS pixels on its longer side; the clicked block is outlined.

Example:
    >>> from attnlab import masks
    >>> view = mask_view(masks.sliding_window_mod(1024, 1024, 256), size=(1024, 1024))
    >>> "data-attnlab-mask" in view._repr_html_()
    True
"""

from __future__ import annotations

import base64
import inspect
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab.masks import block_spans
from attnlab.lab.viz.page import View, asset, escape, fragment, new_prefix, to_json, viridis
from attnlab.lab.viz.picture import Panel, Picture, block_picture, colours

__all__ = ["mask_view", "map_view", "mask_diff_view", "score_mod_view", "show", "shows", "parse_mask",
           "BlockMap", "block_map", "map_width", "score_mod_values", "DEFAULT_BLOCK", "TILE_BUDGET", "MAX_EVALUATED", "EMPTY",
           "PARTIAL", "FULL"]

DEFAULT_BLOCK = 128  # FlexAttention's block (attnlab.backends.flex) and blocks' middle size
TILE_BUDGET = 1 << 20  # bytes of partial blocks' bit tiles one mask may put in a page
MAX_BLOCKS = 1024  # blocks per axis the map draws (a canvas pixel each)
MAX_SCORE_SIZE = 64  # queries and keys a score mod view shows, every cell a number
MAP_PX = 512  # CSS pixels of the block map's longer side (more when it has more blocks: one pixel each)
MAX_EVALUATED = 8192 * 8192  # cells of a mask mod evaluated one by one (not intervals): a few seconds on 2 cores
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass
class _Source:
    """A mask of one batch row and head, ``(tq, tk)``, as what a band of query rows allows.

    ``band(qs, qe, ks, ke)`` is the ``(qe - qs, ke - ks)`` bool tile; ``span(qs, qe)`` the keys
    ``[lo, hi)`` those queries may reach; ``rows`` the per-row intervals and segments when the
    mask has that form (1-D int64 ``lo, hi, q_segment (Tq,)``, ``k_segment (Tk,)``).
    """

    tq: int
    tk: int
    label: str
    band: object
    span: object
    rows: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    mod: object = None


@dataclass
class BlockMap:
    """A mask's blocks: ``states`` ``(nq, nk)`` uint8 (:data:`EMPTY`, :data:`PARTIAL`, :data:`FULL`),
    the number of allowed cells, and the bit tiles of partial blocks (flat index -> packed bits).

    Example:
        >>> from attnlab import masks
        >>> m = block_map(masks.causal_mod(4, 4), size=(4, 4), block=2)
        >>> m.states.tolist(), m.allowed
        ([[1, 0], [2, 1]], 10)
    """

    source: _Source
    block: int
    states: Tensor
    allowed: int
    tiles: dict = field(default_factory=dict)
    dropped: int = 0  # partial blocks whose tile did not fit the budget

    @property
    def visited(self) -> float:
        """Share of blocks a block-sparse kernel visits (full or partial)."""
        return float((self.states != EMPTY).float().mean()) if self.states.numel() else 0.0

    @property
    def density(self) -> float:
        """Share of the ``Tq x Tk`` cells the mask allows."""
        cells = self.source.tq * self.source.tk
        return self.allowed / cells if cells else 0.0

    def counts(self) -> dict[str, int]:
        """Blocks per state."""
        return {name: int((self.states == state).sum()) for name, state in
                (("full", FULL), ("partial", PARTIAL), ("empty", EMPTY))}


def _arity(fn) -> int | None:
    """Required positional parameters of a callable (4: a mask mod, 5: a score mod), None if unknown."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def _is_score_mod(obj) -> bool:
    return isinstance(obj, _scores.ScoreMod) or (
        callable(obj) and not isinstance(obj, (Tensor, _masks.MaskMod)) and _arity(obj) == 5)


def _is_mask(obj) -> bool:
    if isinstance(obj, Tensor):
        return obj.dtype == torch.bool
    return isinstance(obj, _masks.MaskMod) or (callable(obj) and _arity(obj) == 4)


def shows(obj) -> bool:
    """Whether :func:`show` takes ``obj``: a bool tensor, a mask mod or a score mod (a float
    tensor is weights).

    Example:
        >>> from attnlab import masks, scores
        >>> shows(masks.causal_mod(4, 4)), shows(scores.softcap(20.0)), shows(torch.ones(2, 2))
        (True, True, False)
    """
    return _is_mask(obj) or _is_score_mod(obj)


def _known_size(mask) -> tuple[int, int] | None:
    """The ``(Tq, Tk)`` a mask states itself: a tensor's, a prepared mask's, a document's ids."""
    if isinstance(mask, Tensor):
        return tuple(mask.shape[-2:]) if mask.ndim >= 2 else None
    if type(mask) is _masks.PreparedMask:
        return mask.tq, mask.tk
    if isinstance(mask, _masks.DocumentMod):
        return mask.ids.shape[1] - mask.offset, mask.ids.shape[1]
    if isinstance(mask, _masks.VarlenCausalMod) and mask.q_lengths.numel():
        return int(mask.q_lengths.max()), int(mask.k_lengths.max())
    if isinstance(mask, _masks.CombinedMod):
        return next((s for s in map(_known_size, mask.mods) if s is not None), None)
    return None


def _size(mask, size, name: str) -> tuple[int, int]:
    known = _known_size(mask)
    if size is None:
        if known is None:
            raise ValueError(f"size: {name} {mask!r} does not know its sizes; give size=(Tq, Tk)")
        return known
    if (not isinstance(size, (tuple, list)) or len(size) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in size)):
        raise ValueError(f"size must be (Tq, Tk), two positive ints, got {size!r}")
    if known is not None and tuple(size) != tuple(known):
        raise ValueError(f"size {tuple(size)} does not match {name}'s own {tuple(known)}")
    return tuple(size)


def _tensor_source(mask: Tensor, *, batch: int, head: int, label: str) -> _Source:
    if mask.ndim not in (2, 4):
        raise ValueError(f"mask must be a bool (Tq, Tk) or (B, H, Tq, Tk) tensor, got shape {tuple(mask.shape)}")
    if mask.ndim == 4:
        for axis, (name, index) in enumerate((("batch", batch), ("head", head))):
            if not 0 <= index < mask.shape[axis] and mask.shape[axis] != 1:
                raise ValueError(f"{name} must be in [0, {mask.shape[axis]}), got {index}")
        mask = mask[min(batch, mask.shape[0] - 1), min(head, mask.shape[1] - 1)]  # (Tq, Tk)
    mask = mask.detach().cpu()
    tq, tk = mask.shape
    return _Source(tq, tk, label, band=lambda qs, qe, ks, ke: mask[qs:qe, ks:ke], span=lambda qs, qe: (0, tk))


def _mod_rows(mod) -> int:
    """Batch rows a mod's tensors hold (lengths, ids): what :func:`~attnlab.masks.prepare` must be told."""
    if type(mod) is _masks.PreparedMask:
        return mod.lo.shape[0]
    return max((t.shape[0] for t in _masks.mod_tensors(mod) if t.ndim), default=1)


def _mod_source(mod, *, tq: int, tk: int, batch: int, head: int, label: str) -> _Source:
    if _masks.has_row_ranges(mod):
        rows = _mod_rows(mod)
        prepared = _masks.prepare(mod, tq=tq, tk=tk, batch=rows)
        r = prepared.lo.shape[0]
        if not 0 <= batch < max(r, rows):
            raise ValueError(f"batch must be in [0, {max(r, rows)}), got {batch}")
        row = min(batch, r - 1)
        lo, hi, qseg, kseg = (t[row].cpu() for t in (prepared.lo, prepared.hi, prepared.q_segment, prepared.k_segment))
        keys = torch.arange(tk)

        def band(qs, qe, ks, ke):
            k = keys[ks:ke]
            return ((k >= lo[qs:qe, None]) & (k <= hi[qs:qe, None])
                    & (qseg[qs:qe, None] == kseg[None, ks:ke]))  # (qe - qs, ke - ks)

        return _Source(tq, tk, label, band=band, span=lambda qs, qe: _masks.kv_range(prepared, qs, qe, tk),
                       rows=(lo, hi, qseg, kseg), mod=mod)
    def band(qs, qe, ks, ke):
        allowed = _masks.apply_mod(mod, torch.tensor(batch), torch.tensor(head),
                                   torch.arange(qs, qe).view(-1, 1), torch.arange(ks, ke).view(1, -1))
        allowed = torch.as_tensor(allowed)
        if allowed.dtype != torch.bool:
            raise TypeError(f"mask: the mask mod {mod!r} must return bool, got {allowed.dtype}")
        return allowed.expand(qe - qs, ke - ks)

    return _Source(tq, tk, label, band=band, span=lambda qs, qe: _masks.kv_range(mod, qs, qe, tk), mod=mod)


def _source(mask, *, size, batch: int, head: int, name: str = "mask") -> _Source:
    for option, value in (("batch", batch), ("head", head)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{option} must be a non-negative int, got {value!r}")
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool tensor (True = attend), got dtype {mask.dtype}")
        _size(mask, size, name)
        return _tensor_source(mask, batch=batch, head=head, label=f"bool tensor {tuple(mask.shape)}")
    if not _is_mask(mask):
        raise TypeError(f"{name} must be a bool tensor, a mask mod (b, h, q_idx, kv_idx) -> bool or a "
                        f"PreparedMask, got {type(mask).__name__}")
    tq, tk = _size(mask, size, name)
    label = repr(mask) if isinstance(mask, _masks.MaskMod) else getattr(mask, "__qualname__", repr(mask))
    return _mod_source(mask, tq=tq, tk=tk, batch=batch, head=head, label=label)


def _check_block(block, tq: int, tk: int) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if max(-(-tq // block), -(-tk // block)) > MAX_BLOCKS:
        raise ValueError(f"block {block} cuts ({tq}, {tk}) into more than {MAX_BLOCKS} blocks a side; "
                         f"give block >= {-(-max(tq, tk) // MAX_BLOCKS)}")
    return block


def block_map(mask, *, size=None, block: int = DEFAULT_BLOCK, batch: int = 0, head: int = 0,
              budget: int = TILE_BUDGET) -> BlockMap:
    """Each ``block x block`` tile of ``mask`` full, partial or empty, in O(T * block) memory.

    Args:
        mask: a bool tensor ``(Tq, Tk)`` or ``(B|1, H|1, Tq, Tk)``, a mask mod or a PreparedMask.
        size: ``(Tq, Tk)`` for a mod that does not state its sizes.
        block: rows and columns per block.
        batch, head: which batch row and head of the mask.
        budget: bytes of bit tiles kept for partial blocks (masks without interval rows).

    Example:
        >>> block_map(torch.ones(3, 5, dtype=torch.bool), block=2).states.tolist()
        [[2, 2, 2], [2, 2, 2]]
    """
    src = _source(mask, size=size, batch=batch, head=head)
    return _build(src, _check_block(block, src.tq, src.tk), budget)


def _evaluated_cells(src: _Source, block: int) -> int:
    """Cells a mask without interval rows evaluates: per band of ``block`` queries, the key blocks its span reaches."""
    cells = 0
    for qs in range(0, src.tq, block):
        qe = min(qs + block, src.tq)
        lo, hi = src.span(qs, qe)
        cells += (qe - qs) * max(0, min(src.tk, -(-hi // block) * block) - lo // block * block)
    return cells


def _check_work(src: _Source, block: int) -> None:
    """A mask mod evaluated cell by cell is refused at once past :data:`MAX_EVALUATED` cells (it
    would run for minutes); a bool tensor is only read, and an interval mask's blocks cost O(T) each."""
    if src.rows is not None or src.mod is None:
        return
    cells = _evaluated_cells(src, block)
    if cells > MAX_EVALUATED:
        raise ValueError(
            f"size {(src.tq, src.tk)}: the mask mod {src.label} is not one key interval per query, so each of its "
            f"{cells:,} reachable cells would be evaluated; a view evaluates at most {MAX_EVALUATED:,} "
            f"({math.isqrt(MAX_EVALUATED)} x {math.isqrt(MAX_EVALUATED)}). Give a smaller size, or a mask of one "
            "key interval per query (attnlab.masks' causal_mod, sliding_window_mod, document_mod, ... and their "
            "&), whose blocks follow from its intervals at any size")


def _build(src: _Source, block: int, budget: int) -> BlockMap:
    _check_work(src, block)
    nq, nk = -(-src.tq // block), -(-src.tk // block)
    states = torch.zeros(nq, nk, dtype=torch.uint8)
    result = BlockMap(src, block, states, 0)
    ks = torch.arange(nk) * block
    ke = (ks + block).clamp(max=src.tk)
    k_seg = _tile_segments(src.rows[3], block, nk) if src.rows is not None else None
    for i, qs in enumerate(range(0, src.tq, block)):
        qe = min(qs + block, src.tq)
        if src.rows is not None:
            _interval_band(src, result, i, qs, qe, ks, ke, k_seg)
        else:
            _evaluated_band(src, result, i, qs, qe, budget)
    if src.rows is not None:
        result.allowed = _interval_count(*src.rows)
    return result


def _tile_segments(k_segment: Tensor, block: int, nk: int) -> tuple[Tensor, Tensor]:
    """Per key block, the lowest and highest segment id of its keys, ``(nk,)`` each."""
    padded = torch.cat([k_segment, k_segment[-1:].expand(nk * block - k_segment.numel())])
    tiles = padded.view(nk, block)  # (nk, block)
    return tiles.amin(dim=1), tiles.amax(dim=1)


def _interval_band(src, result, i, qs, qe, ks, ke, k_seg) -> None:
    """One band of a mask with interval rows: states from the intervals, tiles only where segments mix."""
    lo, hi, qseg, _ = (t[qs:qe] if n < 3 else t for n, t in enumerate(src.rows))
    reach = _reached_blocks(lo, hi, result.block, ks.numel(), src.tk)  # (nk,)
    cover = (lo.max() <= ks) & (hi.min() >= ke - 1)  # every row's interval holds the whole key block
    s_lo, s_hi = qseg.min(), qseg.max()
    k_lo, k_hi = k_seg
    same = (s_lo == s_hi) & (k_lo == k_hi) & (k_lo == s_lo)  # every cell of the tile is in one segment
    apart = (k_lo > s_hi) | (k_hi < s_lo)  # no segment in common
    states = torch.where(cover, FULL, PARTIAL).to(torch.uint8)
    states[~reach | apart] = EMPTY
    for j in torch.nonzero(reach & ~apart & ~same).flatten().tolist():  # mixed segments: look
        tile = src.band(qs, qe, int(ks[j]), int(ke[j]))
        states[j] = FULL if bool(tile.all()) else PARTIAL if bool(tile.any()) else EMPTY
    result.states[i] = states


def _reached_blocks(lo: Tensor, hi: Tensor, block: int, nk: int, tk: int) -> Tensor:
    """Key blocks some row's interval ``[lo, hi]`` touches, ``(nk,)`` bool, in O(rows + nk): each
    live row marks its first and one-past-last block, and a running sum fills the blocks between."""
    live = (hi >= lo) & (hi >= 0) & (lo < tk)
    first, last = lo[live].clamp(min=0) // block, hi[live].clamp(max=tk - 1) // block
    marks = torch.zeros(nk + 1, dtype=torch.int64)
    marks.index_add_(0, first, torch.ones_like(first))
    marks.index_add_(0, last + 1, -torch.ones_like(last))
    return marks.cumsum(0)[:nk] > 0


def _interval_count(lo: Tensor, hi: Tensor, qseg: Tensor, kseg: Tensor) -> int:
    """Allowed cells: per row, the keys in ``[lo, hi]`` of its segment (sorted keys, two searches)."""
    tk = kseg.numel()
    ids = torch.unique(torch.cat([qseg, kseg]), return_inverse=True)[1]
    q_ids, k_ids = ids[: qseg.numel()], ids[qseg.numel():]
    keyed = torch.sort(k_ids * (tk + 1) + torch.arange(tk)).values  # (Tk,) by segment, then position
    start = torch.searchsorted(keyed, q_ids * (tk + 1) + lo.clamp(min=0))
    stop = torch.searchsorted(keyed, q_ids * (tk + 1) + hi, right=True)
    return int(torch.where(hi >= lo, stop - start, 0).clamp(min=0).sum())


def _evaluated_band(src, result, i, qs, qe, budget) -> None:
    """One band evaluated on the keys its span reaches; partial tiles kept as bits within ``budget``."""
    block = result.block
    lo, hi = src.span(qs, qe)
    first, last = lo // block, -(-hi // block)
    if last <= first:
        return
    allowed = src.band(qs, qe, first * block, min(src.tk, last * block))  # (bq, keys)
    padded = torch.zeros(block, (last - first) * block, dtype=torch.bool)
    padded[: qe - qs, : allowed.shape[1]] = allowed
    tiles = padded.view(block, last - first, block).transpose(0, 1)  # (tiles, block, block)
    counts = tiles.sum(dim=(1, 2))
    areas = torch.tensor([(qe - qs) * (min(src.tk, (j + 1) * block) - j * block) for j in range(first, last)])
    states = torch.where(counts == areas, FULL, torch.where(counts > 0, PARTIAL, EMPTY)).to(torch.uint8)
    result.states[i, first:last] = states
    result.allowed += int(counts.sum())
    tile_bytes = block * block // 8 + (block * block % 8 > 0)
    for t in torch.nonzero(states == PARTIAL).flatten().tolist():
        if len(result.tiles) * tile_bytes + tile_bytes > budget:
            result.dropped += 1
            continue
        result.tiles[i * result.states.shape[1] + first + t] = np.packbits(
            tiles[t].numpy(), axis=None, bitorder="little").tobytes()


def _b64(array: Tensor | bytes) -> str:
    raw = array if isinstance(array, bytes) else array.numpy().astype(array.numpy().dtype.newbyteorder("<")).tobytes()
    return base64.b64encode(raw).decode("ascii")


def _skipping(src: _Source, bmap: BlockMap) -> list[str]:
    """Which attnlab backends skip this mask's empty blocks, and how much they visit."""
    mod = src.mod
    if mod is None:
        return ["A dense bool tensor: sdpa, chunked and flex (as a dense bias) visit every block; "
                "prepare a mask mod to let blocks, chunked and flex skip."]
    lines = []
    if isinstance(mod, _masks.MaskMod) and mod.kv_bounds(0, min(src.tq, 1)) is not None:
        spans = block_spans(mod, src.tq, src.tk, bmap.block)
        visited = sum((qe - qs) * (hi - lo) for qs, qe, lo, hi in spans) / (src.tq * src.tk)
        lines.append(f"blocks and chunked: each query block reads only the keys its bounds reach, "
                     f"{visited:.1%} of the cells at {bmap.block} queries a block.")
    if _masks.has_row_ranges(mod):
        lines.append(f"flex: skips the empty {bmap.block} x {bmap.block} blocks and runs full ones unmasked "
                     f"({bmap.visited:.1%} of the blocks visited, with block {bmap.block}).")
    return lines or ["This mod states no bounds: every backend evaluates it on every block (sdpa after "
                     "materialising it, flex as a dense bias)."]


def _side(bmap: BlockMap) -> dict:
    src = bmap.source
    data = {"label": src.label, "states": _b64(bmap.states), "allowed": bmap.allowed}
    if src.rows is not None:
        lo, hi, qseg, kseg = src.rows
        data["lo"], data["hi"] = _b64(lo.to(torch.int32)), _b64(hi.to(torch.int32))
        if bool(qseg.any()) or bool(kseg.any()):
            data["qseg"], data["kseg"] = _b64(qseg.to(torch.int32)), _b64(kseg.to(torch.int32))
    else:
        data["tiles"] = sorted(bmap.tiles)
        data["bits"] = _b64(b"".join(bmap.tiles[k] for k in data["tiles"]))
        data["dropped"] = bmap.dropped
    return data


def _summary(bmap: BlockMap) -> str:
    c = bmap.counts()
    return (f"{bmap.source.tq} x {bmap.source.tk} in blocks of {bmap.block}: {c['full']} full, {c['partial']} partial, "
            f"{c['empty']} empty; a block-sparse kernel visits {bmap.visited:.1%} of the blocks; "
            f"{bmap.density:.1%} of the cells are allowed.")


def mask_view(mask, *, size=None, block: int = DEFAULT_BLOCK, batch: int = 0, head: int = 0,
              budget: int = TILE_BUDGET, title: str | None = None) -> View:
    """A mask's block map (full / partial / empty); click a block to see each of its cells.

    Shapes:
        mask: bool ``(Tq, Tk)`` or ``(B|1, H|1, Tq, Tk)`` (True = attend), a mask mod of
        :mod:`attnlab.masks` (or a function ``(b, h, q_idx, kv_idx) -> bool`` with ``size``), or
        a :class:`~attnlab.masks.PreparedMask`.

    Args:
        size: ``(Tq, Tk)``, for a mod that does not state its sizes.
        block: rows and columns per block (default: FlexAttention's 128).
        batch, head: which batch row and head to draw.
        budget: bytes of bit tiles for partial blocks of a mask without interval rows.
        title: shown above the view.

    Example:
        >>> from attnlab import masks
        >>> page = mask_view(masks.causal_mod(512, 512), size=(512, 512))._repr_html_()
        >>> '"n":[4,4]' in page
        True
    """
    return map_view(block_map(mask, size=size, block=block, batch=batch, head=head, budget=budget), title=title)


def map_view(bmap: BlockMap, *, title: str | None = None) -> View:
    """The view of a :class:`BlockMap` already built (what :func:`mask_view` draws).

    Example:
        >>> from attnlab import masks
        >>> map_view(block_map(masks.causal_mod(8, 8), size=(8, 8), block=4)).title
        'mask: CausalMod(offset=0)'
    """
    title = title or f"mask: {bmap.source.label}"
    data = {"kind": "mask", "n": list(bmap.states.shape), "block": bmap.block, "size": [bmap.source.tq, bmap.source.tk],
            "a": _side(bmap), "summary": _summary(bmap), "skips": _skipping(bmap.source, bmap)}
    states = bmap.states.clone()
    return View(lambda: _fragment(data, title), title=title,
                picture=lambda: block_picture(states, diff=False, title=title, note=data["summary"]))


def _diff_states(a: BlockMap, b: BlockMap) -> tuple[Tensor, dict[str, int]]:
    """Per block, bits: 1 = some cell in both, 2 = some only in a, 4 = some only in b; and the cell counts."""
    block, (tq, tk) = a.block, (a.source.tq, a.source.tk)
    sa, sb = a.states, b.states
    rows = torch.tensor([min(block, tq - i * block) for i in range(sa.shape[0])])
    cols = torch.tensor([min(block, tk - j * block) for j in range(sa.shape[1])])
    area = rows[:, None] * cols[None, :]  # (nq, nk)
    both_full, a_full, b_full = (sa == FULL) & (sb == FULL), (sa == FULL) & (sb == EMPTY), (sa == EMPTY) & (sb == FULL)
    bits = (both_full * 1 + a_full * 2 + b_full * 4).to(torch.uint8)
    counts = {"both": int(area[both_full].sum()), "only_a": int(area[a_full].sum()), "only_b": int(area[b_full].sum())}
    for i, j in torch.nonzero((sa == PARTIAL) | (sb == PARTIAL)).tolist():
        qs, ks = i * block, j * block
        ta = a.source.band(qs, qs + int(rows[i]), ks, ks + int(cols[j]))
        tb = b.source.band(qs, qs + int(rows[i]), ks, ks + int(cols[j]))
        n = [int((ta & tb).sum()), int((ta & ~tb).sum()), int((tb & ~ta).sum())]
        bits[i, j] = (n[0] > 0) * 1 + (n[1] > 0) * 2 + (n[2] > 0) * 4
        for name, value in zip(("both", "only_a", "only_b"), n):
            counts[name] += value
    return bits, counts


def mask_diff_view(mask_a, mask_b, *, size=None, block: int = DEFAULT_BLOCK, batch: int = 0, head: int = 0,
                   budget: int = TILE_BUDGET, title: str | None = None) -> View:
    """Where two masks differ: blocks (and, on a click, cells) only in ``mask_a``, only in ``mask_b``, in both.

    Args:
        mask_a, mask_b: masks of one size, each as :func:`mask_view` takes them.
        size, block, batch, head, budget, title: as :func:`mask_view`.

    Example:
        >>> from attnlab import masks
        >>> view = mask_diff_view(masks.causal_mod(8, 8), masks.sliding_window_mod(8, 8, 3), size=(8, 8), block=4)
        >>> '"only_a":15' in view._repr_html_()
        True
    """
    size = size if size is not None else (_known_size(mask_a) or _known_size(mask_b))  # one states it for both
    src_a = _source(mask_a, size=size, batch=batch, head=head, name="mask_a")
    src_b = _source(mask_b, size=size if size is not None else (src_a.tq, src_a.tk), batch=batch, head=head,
                    name="mask_b")
    if (src_a.tq, src_a.tk) != (src_b.tq, src_b.tk):
        raise ValueError(f"mask_b must have mask_a's size {(src_a.tq, src_a.tk)}, got {(src_b.tq, src_b.tk)}")
    block = _check_block(block, src_a.tq, src_a.tk)
    a, b = _build(src_a, block, budget), _build(src_b, block, budget)
    bits, counts = _diff_states(a, b)
    summary = (f"{src_a.tq} x {src_a.tk} in blocks of {block}: {counts['only_a']} cells only in a, "
               f"{counts['only_b']} only in b, {counts['both']} in both; "
               f"{int(((bits & 6) != 0).sum())} of {bits.numel()} blocks differ.")
    title = title or f"mask difference: {src_a.label} vs {src_b.label}"
    data = {"kind": "diff", "n": list(bits.shape), "block": block, "size": [src_a.tq, src_a.tk], "a": _side(a),
            "b": _side(b), "diff": _b64(bits), "counts": counts, "summary": summary,
            "skips": []}
    return View(lambda: _fragment(data, title), title=title,
                picture=lambda: block_picture(bits, diff=True, title=title, note=summary))


def map_width(nq: int, nk: int) -> int:
    """CSS width of a block map of ``nq x nk`` blocks: its longer side :data:`MAP_PX` pixels (a block
    at least one), every block the same size, so 32 blocks draw as 16-pixel squares, not 4.

    Example:
        >>> map_width(32, 32), map_width(64, 32), map_width(1024, 1024)
        (512, 256, 1024)
    """
    return round(nk * max(1.0, MAP_PX / max(nq, nk)))


def _fragment(data: dict, title: str) -> str:
    prefix = new_prefix()
    nq, nk = data["n"]
    if data["kind"] == "mask":
        legend = (('<span class="mk-key" style="background:#1d4ed8"></span>full '
                   '<span class="mk-key" style="background:#93c5fd"></span>partial '
                   '<span class="mk-key" style="background:#f1f5f9"></span>empty'))
    else:
        legend = ('<span class="mk-key" style="background:#94a3b8"></span>same in both '
                  '<span class="mk-key" style="background:#2563eb"></span>only in a '
                  '<span class="mk-key" style="background:#ea580c"></span>only in b '
                  '<span class="mk-key" style="background:#9333ea"></span>both differ '
                  '<span class="mk-key" style="background:#f1f5f9"></span>in neither')
    skips = "".join(f"<li>{escape(line)}</li>" for line in data["skips"])
    body = (
        f'<section class="card"><h2>{escape(title)}</h2>'
        f'<p class="summary" id="{prefix}mk-summary">{escape(data["summary"])}</p>'
        f'<p class="muted">Row = query block, column = key block. {legend}. Click a block to see its cells.</p>'
        f'{f"<ul class=muted>{skips}</ul>" if skips else ""}'
        f'<div class="mv-main"><div class="mk-map-box"><canvas class="mk-map" id="{prefix}mk-map" width="{nk}" '
        f'height="{nq}" style="width:{map_width(nq, nk)}px"></canvas>'
        f'<div class="mk-mark" id="{prefix}mk-mark" hidden></div></div>'
        f'<div class="mv-side"><p class="summary" id="{prefix}mk-zoom-title">No block chosen.</p>'
        f'<canvas class="mk-zoom" id="{prefix}mk-zoom" width="1" height="1"></canvas>'
        f'<p class="muted" id="{prefix}mk-cell"></p></div></div></section>'
    )
    scripts = (f'<script id="{prefix}attnlab-mask" type="application/json">{to_json(data)}</script>'
               f"<script>{asset('maskview.js')}</script>")
    return fragment(body, prefix=prefix, roles=("mask",), scripts=scripts)


def _check_qk(q, k, size, head_dim: int, seed: int) -> tuple[Tensor, Tensor]:
    """``q (Tq, D)`` and ``k (Tk, D)`` in fp64: the caller's, or seeded normal ones of ``size``."""
    if (q is None) != (k is None):
        raise ValueError(f"q and k must be given together, got q={'a tensor' if q is not None else None} "
                         f"and k={'a tensor' if k is not None else None}")
    if q is None:
        tq, tk = _size(None, size, "score_mod") if size is not None else (8, 8)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(tq, head_dim, generator=gen, dtype=torch.float64)
        k = torch.randn(tk, head_dim, generator=gen, dtype=torch.float64)
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor) or t.ndim != 2 or not t.is_floating_point() or 0 in t.shape:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a non-empty float (T, D) tensor, got {shape}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"k must have q's head size {q.shape[1]}, got {k.shape[1]}")
    if max(q.shape[0], k.shape[0]) > MAX_SCORE_SIZE:
        raise ValueError(f"q and k must have at most {MAX_SCORE_SIZE} rows (every cell is shown), "
                         f"got {q.shape[0]} and {k.shape[0]}")
    return q.detach().cpu().double(), k.detach().cpu().double()


def score_mod_values(score_mod, *, q=None, k=None, size=None, head_dim: int = 16, head: int = 0,
                     seed: int = 0) -> dict[str, Tensor]:
    """One head's scores and weights before and after ``score_mod``, in fp64.

    Returns:
        ``scores``, ``modded``, ``weights``, ``modded_weights``: ``(Tq, Tk)`` each.

    Example:
        >>> from attnlab import scores
        >>> v = score_mod_values(scores.softcap(1.0), size=(3, 3))
        >>> bool(v["modded"].abs().max() < 1)
        True
    """
    q, k = _check_qk(q, k, size, head_dim, seed)
    mod = _scores.as_score_mod(score_mod)
    if isinstance(head, bool) or not isinstance(head, int) or head < 0:
        raise ValueError(f"head must be a non-negative int, got {head!r}")
    scores = q @ k.T / math.sqrt(q.shape[1])  # (Tq, Tk)
    tiled = scores.expand(1, head + 1, *scores.shape)  # (1, H, Tq, Tk): head h sees h
    modded = _scores.apply_tile(mod, tiled, q_start=0, kv_start=0)[0, head].double()
    return {"scores": scores, "modded": modded, "weights": torch.softmax(scores, -1),
            "modded_weights": torch.softmax(modded, -1)}


def _cells(values: Tensor, *, signed: bool) -> str:
    """A table of ``values``: viridis over [min, max], or blue-white-red around 0 when ``signed``."""
    lo, hi = float(values.min()), float(values.max())
    top = max(abs(lo), abs(hi)) or 1.0
    rows = []
    for i, row in enumerate(values.tolist()):
        cells = []
        for j, v in enumerate(row):
            if signed:
                t = v / top
                colour = f"rgb({255 - round(max(t, 0) * 200)},{255 - round(abs(t) * 170)},{255 - round(max(-t, 0) * 200)})"
            else:
                colour = viridis((v - lo) / (hi - lo) if hi > lo else 0.5)
            cells.append(f'<td style="background:{colour}" title="q {i}, k {j}: {v:.4g}"></td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f'<table class="sm-grid" style="border-collapse:collapse">{"".join(rows)}</table>'


def _panels(values: dict[str, Tensor]) -> list[tuple[str, Tensor, bool]]:
    """A score mod view's six panels: ``(label, values, signed)`` each, as the page and picture draw them."""
    change, moved = values["modded"] - values["scores"], values["modded_weights"] - values["weights"]
    return [("scores before", values["scores"], False), ("scores after", values["modded"], False),
            ("score change", change, True), ("weights before", values["weights"], False),
            ("weights after", values["modded_weights"], False), ("weight change", moved, True)]


def score_mod_view(score_mod, *, q=None, k=None, size=None, head_dim: int = 16, head: int = 0, seed: int = 0,
                   title: str | None = None) -> View:
    """What a score mod does to one head: its scores and weights before and after, and the difference.

    Args:
        score_mod: an :mod:`attnlab.scores` mod or a function ``(score, b, h, q_idx, kv_idx) -> score``.
        q, k: ``(Tq, D)`` and ``(Tk, D)`` (both or neither); default seeded normal ones.
        size: ``(Tq, Tk)`` of the random q and k (default 8 x 8, at most 64).
        head_dim: their head size; head: the head index the mod is given; seed: their seed.
        title: shown above the view.

    Example:
        >>> from attnlab import scores
        >>> "data-attnlab-scoremod" in score_mod_view(scores.alibi(4), head=2)._repr_html_()
        True
    """
    values = score_mod_values(score_mod, q=q, k=k, size=size, head_dim=head_dim, head=head, seed=seed)
    change, moved = values["modded"] - values["scores"], values["modded_weights"] - values["weights"]
    flips = int((values["weights"].argmax(-1) != values["modded_weights"].argmax(-1)).sum())
    name = repr(_scores.as_score_mod(score_mod))
    tq = values["scores"].shape[0]
    summary = (f"{name} on head {head}: scores change by up to {float(change.abs().max()):.4g}, weights by up to "
               f"{float(moved.abs().max()):.4g}; the most-attended key changes for {flips} of {tq} queries.")
    title = title or f"score mod: {name}"
    data = {k: v.tolist() for k, v in values.items()}
    data["summary"] = summary

    def render() -> str:
        prefix = new_prefix()
        grid = "".join(f'<div><p class="muted">{escape(label)}</p>{_cells(v, signed=signed)}</div>'
                       for label, v, signed in _panels(values))
        body = (f'<section class="card"><h2>{escape(title)}</h2><p class="summary">{escape(summary)}</p>'
                '<p class="muted">Row = query, column = key; hover a cell for its value. Changes: blue up, '
                f'red down.</p><div class="sm-panels">{grid}</div></section>')
        scripts = f'<script id="{prefix}attnlab-scoremod" type="application/json">{to_json(data)}</script>'
        return fragment(body, prefix=prefix, roles=("scoremod",), scripts=scripts)

    def picture() -> Picture:
        tq, tk = values["scores"].shape
        rows, cols = tuple(map(str, range(tq))), tuple(map(str, range(tk)))
        return Picture(title, tuple(Panel(colours(v, "signed" if signed else "range"), rows, cols, label)
                                    for label, v, signed in _panels(values)), note=summary)

    return View(render, title=title, picture=picture)


def show(obj, other=None, *, title: str | None = None, head: int = 0, **options) -> View:
    """A mask's block map, two masks' difference (``other``), or a score mod's change.

    What ``attnlab.show`` calls for a bool tensor, a mask mod, a PreparedMask or a score mod;
    ``options`` are :func:`mask_view`'s or :func:`score_mod_view`'s.

    Example:
        >>> from attnlab import masks
        >>> show(masks.causal_mod(8, 8), masks.sliding_window_mod(8, 8, 2), size=(8, 8)).title
        'mask difference: CausalMod(offset=0) vs SlidingWindowMod(window=2, offset=0)'
    """
    if not shows(obj):
        raise TypeError(f"weights must be a float tensor to show options {sorted(options)}; "
                        f"those apply to masks and score mods, got {type(obj).__name__}")
    if _is_score_mod(obj) and not _is_mask(obj):
        if other is not None:
            raise ValueError("a score mod is shown alone: give q=..., k=... as keywords, not a second argument")
        return score_mod_view(obj, title=title, head=head, **options)
    if other is not None:
        return mask_diff_view(obj, other, title=title, head=head, **options)
    return mask_view(obj, title=title, head=head, **options)


_SPECS = {"causal": 0, "window": 1, "chunk": 1, "prefix": 1, "document": 1}


def parse_mask(spec: str, *, size: int) -> object:
    """A mask mod from a command-line spec: ``causal``, ``window:N``, ``chunk:N``, ``prefix:N``,
    ``document:L1,L2,...`` (document lengths summing to ``size``), joined by ``&`` (all of them).

    Raises:
        ValueError: a spec that is none of these, naming ``--mask`` and the spec.

    Example:
        >>> parse_mask("causal&window:4", size=16)
        CombinedMod(CausalMod(offset=0), SlidingWindowMod(window=4, offset=0), op='and')
    """
    parts = []
    for part in str(spec).split("&"):
        name, _, arg = part.strip().partition(":")
        if name not in _SPECS or bool(arg) != bool(_SPECS[name]):
            raise ValueError(f"--mask must be causal, window:N, chunk:N, prefix:N or document:L1,L2,... "
                             f"(joined by &), got {part.strip()!r}")
        try:
            numbers = [int(x) for x in arg.split(",")] if arg else []
        except ValueError:
            raise ValueError(f"--mask {part.strip()!r}: {arg!r} is not a number (or comma-separated numbers)") from None
        if any(n < (0 if name == "prefix" else 1) for n in numbers) or (name != "document" and len(numbers) > 1):
            raise ValueError(f"--mask {part.strip()!r}: give one positive number after {name}:")
        parts.append(_spec_mod(name, numbers, size, part.strip()))
    return parts[0] if len(parts) == 1 else _masks.and_masks(*parts)


def _spec_mod(name: str, numbers: list[int], size: int, part: str):
    if name == "causal":
        return _masks.causal_mod(size, size)
    if name == "window":
        return _masks.sliding_window_mod(size, size, numbers[0])
    if name == "chunk":
        return _masks.chunked_local_mod(size, size, numbers[0])
    if name == "prefix":
        return _masks.prefix_lm_mod(size, size, numbers[0])
    if sum(numbers) != size:
        raise ValueError(f"--mask {part!r}: the document lengths sum to {sum(numbers)}, not --size {size}")
    ids = torch.repeat_interleave(torch.arange(len(numbers)), torch.tensor(numbers))
    return _masks.document_mod(ids)
