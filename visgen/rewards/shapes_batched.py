"""The shapes checker (``visgen.tasks.shapes``) as batched tensor code on the images' device.

The numpy checker (``find_components`` / ``check_image``) loops over images, colours and components in Python and
scipy; this module computes the same quantities for a whole batch at once with torch, on whatever device the images
are on (CPU, CUDA):

1. colour masks: the checker's HSV rule with the same float32 / float64 operations (so the masks are bit-identical);
2. connected components (8-connectivity) of every colour mask at once: min-label hooking along the same-colour edges
   between neighbouring foreground pixels, with full pointer jumping between rounds (Shiloach-Vishkin style); a
   component's label is its first pixel in raster order, which is the order ``scipy.ndimage.label`` numbers them in;
3. per component of ``MIN_AREA`` pixels or more: area, centroid, the 90th-percentile brightness (numpy's linear
   quantile formula, float32 like numpy), the soft mask over the component grown by two pixels, and the angular
   moments |m3|, |m4| of that soft mask (``angular_moments``), hence the shape class;
4. per (image, colour): the component count and the two largest components (ties: first in raster order, as the
   checker's stable sort), which is all the per-prompt checks read.

Equality with the numpy checker (tests/visgen/test_shapes_batched.py): masks, labels, areas, centroids, the
percentile and the soft masks are bit-identical; the moments differ in the last bits only (the soft mask's total is
summed in a different order than numpy's float32 pairwise sum, and ``(dx + i dy)^k`` replaces
``r^k exp(i k theta)``), about 1e-7 relative, so the boolean checks (``shapes``, ``shapes_strict``) are identical and
``shapes_soft`` equal to float rounding.

One analysis per images tensor: :func:`analyse` keeps the last few results keyed by the tensor itself (identity,
version counter, layout), so ``shapes`` and ``shapes_soft`` scoring the same images in one reward call of the domain
(``VisgenDomain.score`` calls each configured reward on the same tensor) find the components once. A tensor changed
in place gets a new version and is analysed again; inference-mode tensors carry no version counter and are never
cached.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from visgen.tasks import shapes as task

COLOR_NAMES: tuple[str, ...] = tuple(task.COLOR_HUES)  # the checker's colour order (its masks dict)
SHAPE_CODES: dict[str, int] = {name: i for i, name in enumerate(task.SHAPES)}
_CIRCLE, _SQUARE, _TRIANGLE = SHAPE_CODES["circle"], SHAPE_CODES["square"], SHAPE_CODES["triangle"]
POSITION_CODES: dict[str | None, int] = {None: -1, **{name: i for i, name in enumerate(task.POSITIONS)}}
_MAX_OBJECTS = 2  # object phrases per prompt in the task grammar


@dataclass
class ShapesAnalysis:
    """What the checks read, for a batch of ``B`` images (tensors on the images' device).

    ``count[b, c]``: components of colour ``COLOR_NAMES[c]`` with at least ``MIN_AREA`` pixels. ``top_*[b, c, j]``:
    the j-th largest of them (j < 2; shape code -1 / NaN where there is none). ``comp_*``: every such component,
    ordered like ``find_components``' list (image, colour, first pixel) — for tests and inspection.
    """

    finite: torch.Tensor  # [B] bool: images without NaN/Inf (the others score NaN)
    width: int  # the checker's ``size`` (image width; its halves split left/right and top/bottom alike)
    count: torch.Tensor  # [B, 4] int64
    top_shape: torch.Tensor  # [B, 4, 2] int64 SHAPE_CODES, -1 = none
    top_cx: torch.Tensor  # [B, 4, 2] float64
    top_cy: torch.Tensor
    top_threefold: torch.Tensor
    top_fourfold: torch.Tensor
    comp_image: torch.Tensor  # [K] int64
    comp_color: torch.Tensor  # [K] int64 index into COLOR_NAMES
    comp_area: torch.Tensor  # [K] int64
    comp_cx: torch.Tensor  # [K] float64
    comp_cy: torch.Tensor
    comp_threefold: torch.Tensor
    comp_fourfold: torch.Tensor
    comp_shape: torch.Tensor  # [K] int64 SHAPE_CODES

    def components(self, b: int) -> list[task.Component]:
        """Image ``b``'s components as the numpy checker's ``find_components`` returns them (same order)."""
        rows = (self.comp_image == b).nonzero().flatten().tolist()
        out = []
        for k in rows:
            comp = task.Component(COLOR_NAMES[int(self.comp_color[k])], int(self.comp_area[k]),
                                  float(self.comp_cx[k]), float(self.comp_cy[k]), float(self.comp_threefold[k]),
                                  float(self.comp_fourfold[k]))
            comp.shape = task.SHAPES[int(self.comp_shape[k])]
            out.append(comp)
        return out


# ------------------------------------------------------------------------------------------------------ masks
def _f32(value: float, device: torch.device) -> torch.Tensor:
    """A float32 constant: numpy compares/divides a float32 array by a Python float in float32 (weak scalar)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values.reshape(-1)[index]`` (``index_select``: several times faster than advanced indexing on a CPU)."""
    return values.reshape(-1).index_select(0, index.reshape(-1)).view(index.shape)


def color_pixels(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pixels of every colour mask of ``task.color_masks`` for contiguous float32 images ``[B,3,H,W]``, bit for
    bit: ``(index, value, pixels, colors)`` with ``index`` ``[B,H,W]`` int8 (colour index into COLOR_NAMES, -1 =
    none), ``value`` the float32 HSV value ``[B,H,W]``, ``pixels`` the flat positions ``b*H*W + y*W + x`` of the
    coloured pixels in raster order and ``colors`` their colour indices.

    The checker's float32 HSV and float64 hue distances, computed only where needed: the saturation on pixels bright
    enough, the hue on bright and saturated ones; the nearest colour is the first on ties, as ``np.argmin``."""
    B, _, H, W = images.shape
    HW = H * W
    dev = images.device
    value = images.amax(1)
    bright = (value.reshape(-1) >= _f32(task.FG_VALUE, dev)).nonzero().flatten()
    v = _take(value, bright)
    chroma = v - _take(images.amin(1), bright)
    # v >= FG_VALUE > 1e-6 here, so the checker's where(value > 1e-6, chroma / maximum(value, 1e-6), 0) is chroma / v
    saturated = (chroma / v >= _f32(task.FG_SATURATION, dev)).nonzero().flatten()
    pix, v, chroma = bright.index_select(0, saturated), v.index_select(0, saturated), chroma.index_select(0, saturated)
    red_at = pix // HW * (3 * HW) + pix % HW  # the pixel's red value in the flat images
    r, g, b = _take(images, red_at), _take(images, red_at + HW), _take(images, red_at + 2 * HW)
    safe = torch.maximum(chroma, _f32(1e-6, dev))
    hue = torch.where(v == r, torch.remainder((g - b) / safe, _f32(6.0, dev)),
                      torch.where(v == g, (b - r) / safe + _f32(2.0, dev), (r - g) / safe + _f32(4.0, dev)))
    hue = (hue * _f32(60.0, dev)).double()  # float64 distances like numpy (a float32 hue minus a float64 array)
    best = best_at = None
    for i, name in enumerate(COLOR_NAMES):
        distance = (torch.remainder((hue - task.COLOR_HUES[name]) + 180.0, 360.0) - 180.0).abs()
        if best is None:
            best, best_at = distance, torch.zeros_like(pix)
        else:
            closer = distance < best
            best, best_at = torch.where(closer, distance, best), torch.where(closer, i, best_at)
    close = (best <= task.HUE_TOLERANCE).nonzero().flatten()
    pixels, colors = pix.index_select(0, close), best_at.index_select(0, close)
    index = torch.full((B * HW,), -1, dtype=torch.int8, device=dev)
    index.index_copy_(0, pixels, colors.to(torch.int8))
    return index.view(B, H, W), value, pixels, colors


# ------------------------------------------------------------------------------------------------------ components
@dataclass
class _Runs:
    """Connected components as horizontal runs of one colour (raster order)."""

    of_pixel: torch.Tensor  # [N] each coloured pixel's run
    first: torch.Tensor  # [R] flat position of the run's first pixel
    length: torch.Tensor  # [R]
    component: torch.Tensor  # [R] the run's component (components numbered in raster order of their first pixel)
    component_first: torch.Tensor  # [C] flat position of each component's first pixel (ascending)


def label_components(index: torch.Tensor, pixels: torch.Tensor, colors: torch.Tensor) -> _Runs:
    """Connected components (8-connectivity, ``scipy.ndimage.label`` with a 3x3 structure) of each colour of
    ``index`` ``[B,H,W]``, all images and colours at once; ``pixels``/``colors`` as :func:`color_pixels` returns them.

    The nodes are the horizontal runs of one colour. Two runs in consecutive rows touch when their column ranges
    overlap or are diagonally adjacent; each touching pair is found once, at its leftmost touching pixels (p above,
    q below): p is the upper run's first pixel (q at p-1, p or p+1 below it), or q is the lower run's first pixel and p
    its upper-left neighbour but not its run's first pixel. Runs are merged by hooking the larger root under the
    smaller along the edges still joining two trees, and pointer jumping to the roots, until none is left (a handful
    of rounds). A component's root is its first run, so components come numbered in raster order of their first
    pixel, the order ``ndimage.label`` numbers them in."""
    B, H, W = index.shape
    dev = index.device
    n = pixels.numel()
    x = pixels % W
    left = _take(index, (pixels - 1).clamp_min(0))
    starts = ((x == 0) | (left.long() != colors)).nonzero().flatten()  # positions in ``pixels``
    of_pixel = torch.zeros(n, dtype=torch.int64, device=dev)
    of_pixel.index_fill_(0, starts, 1)
    of_pixel = torch.cumsum(of_pixel, 0) - 1
    first = pixels.index_select(0, starts)
    length = torch.diff(starts, append=torch.tensor([n], device=dev))
    color = colors.index_select(0, starts)
    fx, fy = first % W, first // W % H
    run_map = torch.full((B * H * W,), -1, dtype=torch.int64, device=dev)
    run_map.index_copy_(0, pixels, of_pixel)

    def neighbour_runs(ok: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        other = run_map.index_select(0, torch.where(ok, where, 0))
        ok = ok & (other >= 0)
        other = other.clamp_min(0)
        return ok & (color.index_select(0, other) == color), other

    us, vs = [], []
    for dx in (-1, 0, 1):  # p = the upper run's first pixel, q below it
        ok, other = neighbour_runs((fy + 1 < H) & (fx + dx >= 0) & (fx + dx < W), first + (W + dx))
        ok &= fx + dx == torch.maximum(fx.index_select(0, other), fx - 1)
        sel = ok.nonzero().flatten()
        us.append(sel)
        vs.append(other.index_select(0, sel))
    ok, other = neighbour_runs((fy > 0) & (fx > 0), first - (W + 1))  # q = the lower run's first pixel, p up-left
    sel = (ok & (fx.index_select(0, other) < fx - 1)).nonzero().flatten()
    us.append(other.index_select(0, sel))
    vs.append(sel)
    u, v = torch.cat(us), torch.cat(vs)
    n_runs = first.numel()
    parent = torch.arange(n_runs, device=dev)
    while True:
        # parent is fully compressed here: every run points at its tree's root
        pu, pv = parent.index_select(0, u), parent.index_select(0, v)
        open_ = (pu != pv).nonzero().flatten()
        if open_.numel() == 0:
            break
        # an edge whose ends share a root keeps sharing one (trees only merge), so it is dropped for good
        u, v, pu, pv = (t.index_select(0, open_) for t in (u, v, pu, pv))
        parent.scatter_reduce_(0, torch.maximum(pu, pv), torch.minimum(pu, pv), "amin")  # hook the larger root
        while True:  # pointer jumping until every run points at a root
            up = parent.index_select(0, parent)
            if torch.equal(up, parent):
                break
            parent = up
    is_root = parent == torch.arange(n_runs, device=dev)
    component = (torch.cumsum(is_root, 0) - 1).index_select(0, parent)
    return _Runs(of_pixel, first, length, component, first[is_root])


# ------------------------------------------------------------------------------------------------------ features
def _linear_quantile(sorted_values: torch.Tensor, start: torch.Tensor, n: torch.Tensor, q: float) -> torch.Tensor:
    """``np.quantile(x, q)`` (method 'linear', float32 input) of each segment ``sorted_values[start:start+n]``:
    numpy's float64 virtual index and float32 lerp (``_lerp``: from below when gamma < 0.5, from above otherwise)."""
    virtual = (n - 1).double() * q
    below = virtual.floor()
    gamma = virtual - below
    i = start + below.long()
    last = i + 1 >= start + n  # numpy takes the last value when the index reaches it
    a = sorted_values.index_select(0, i)
    b = sorted_values.index_select(0, torch.where(last, i, i + 1))
    diff = b - a
    lerp = torch.where(gamma >= 0.5, b - diff * (1.0 - gamma).float(), a + diff * gamma.float())
    return torch.where(last, a, lerp)


def _dilate2(mask: torch.Tensor) -> torch.Tensor:
    """Binary dilation of ``[K,H,W]`` masks by the 3x3 square twice (= the 5x5 square), zero outside:
    ``ndimage.binary_dilation(comp, np.ones((3, 3)), iterations=2)``."""
    out = mask.clone()
    for s in (1, 2):
        out[..., s:] |= mask[..., :-s]
        out[..., :-s] |= mask[..., s:]
    rows = out.clone()
    for s in (1, 2):
        out[..., s:, :] |= rows[..., :-s, :]
        out[..., :-s, :] |= rows[..., s:, :]
    return out


_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


def float32_pairwise_sums(values: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """``values[start[i] : start[i] + length[i]].sum()`` for float32 ``values`` as numpy computes it, bit for bit:
    numpy's pairwise summation (``FLOAT_pairwise_sum``: below 8 elements a running sum from -0.0; up to 128 eight
    running sums over the multiple-of-8 prefix, combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the rest one by
    one; longer runs split at half rounded down to a multiple of 8 and the halves' sums added), for every segment at
    once: the split tree is built level by level, its leaves summed in lock step, and its nodes combined bottom-up."""
    dev = values.device
    n_seg = start.numel()
    starts, lengths, internal = [start], [length], []
    level_ids, cur_start, cur_len, next_id = torch.arange(n_seg, device=dev), start, length, n_seg
    while True:
        split = cur_len > _PAIRWISE_BLOCK
        if not bool(split.any()):
            break
        ids, s, n = level_ids[split], cur_start[split], cur_len[split]
        half = n // 2
        half = half - half % 8
        m = ids.numel()
        left = torch.arange(next_id, next_id + m, device=dev)
        internal.append((ids, left, left + m))
        next_id += 2 * m
        level_ids, cur_start, cur_len = torch.cat([left, left + m]), torch.cat([s, s + half]), torch.cat([half, n - half])
        starts.append(cur_start)
        lengths.append(cur_len)
    node_start, node_len = torch.cat(starts), torch.cat(lengths)
    leaf = torch.ones(next_id, dtype=torch.bool, device=dev)
    for ids, _, _ in internal:
        leaf[ids] = False
    leaves = leaf.nonzero().flatten()
    s, n = node_start[leaves], node_len[leaves]
    cols = torch.arange(_PAIRWISE_BLOCK, device=dev)
    inside = cols[None] < n[:, None]
    block = torch.where(inside, values[(s[:, None] + cols[None]).clamp(max=max(values.numel() - 1, 0))], 0.0) \
        if values.numel() else torch.zeros(len(leaves), _PAIRWISE_BLOCK, dtype=values.dtype, device=dev)
    running = torch.full_like(n, -0.0, dtype=values.dtype)  # fewer than 8: one running sum from -0.0
    for j in range(7):
        running = torch.where(j < n, running + block[:, j], running)
    acc = block[:, :8]  # 8 to 128: eight running sums
    whole = n - n % 8
    for i in range(8, _PAIRWISE_BLOCK, 8):
        acc = torch.where((i < whole)[:, None], acc + block[:, i:i + 8], acc)
    blocked = ((acc[:, 0] + acc[:, 1]) + (acc[:, 2] + acc[:, 3])) + ((acc[:, 4] + acc[:, 5]) + (acc[:, 6] + acc[:, 7]))
    for t in range(7):
        tail = (whole + t).clamp(max=_PAIRWISE_BLOCK - 1)
        blocked = torch.where(whole + t < n, blocked + block.gather(1, tail[:, None]).squeeze(1), blocked)
    node = torch.empty(next_id, dtype=values.dtype, device=dev)
    node[leaves] = torch.where(n < 8, running, blocked)
    for ids, left, right in reversed(internal):
        node[ids] = node[left] + node[right]
    return node[:n_seg] + 0.0  # the reduction starts from add's identity, 0.0 (so -0.0 becomes 0.0)


def _moments(soft: torch.Tensor, total: torch.Tensor, top: torch.Tensor, left: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``task.angular_moments`` of ``[K,h,w]`` soft masks, each a window of its image at row ``top[k]``, column
    ``left[k]`` (zero outside it), whose weights numpy sums to ``total`` (float32): (|m3|, |m4|) in float64.

    numpy's ``dx = xs - (w * xs).sum() / w.sum()``: the float32 total divides exact float64 sums (the weights are
    float32 multiples of 2^-24 at most 1 — ``(q - 0.25) / 0.5`` with ``q`` a float32 >= 0.25 — so every sum of
    ``w * x`` below 2^15 is exact in any order), so the centroid is numpy's bit for bit. ``r^k exp(i k theta) =
    (dx + i dy)^k``: the angular sums are sums of ``w dx^a dy^b``, computed as one batched matrix product per
    window; only ``r^3`` needs the per-pixel square root."""
    K, h, w = soft.shape
    dev = soft.device
    weight = soft.double()
    xs = (left[:, None] + torch.arange(w, device=dev)).double()
    ys = (top[:, None] + torch.arange(h, device=dev)).double()
    total = total.double()
    dx = xs - ((weight.sum(1) * xs).sum(1) / total)[:, None]
    dy = ys - ((weight.sum(2) * ys).sum(1) / total)[:, None]
    def powers(d: torch.Tensor) -> torch.Tensor:  # [K, n, 5]: d^0 .. d^4
        d2 = d * d
        return torch.stack([torch.ones_like(d), d, d2, d2 * d, d2 * d2], 2)

    p = torch.einsum("kya,kyb->kab", torch.bmm(weight, powers(dx)), powers(dy))  # p[k, a, b] = sum w dx^a dy^b
    re3, im3 = p[:, 3, 0] - 3.0 * p[:, 1, 2], 3.0 * p[:, 2, 1] - p[:, 0, 3]
    re4, im4 = p[:, 4, 0] - 6.0 * p[:, 2, 2] + p[:, 0, 4], 4.0 * (p[:, 3, 1] - p[:, 1, 3])
    r3 = (dy * dy)[:, :, None] + (dx * dx)[:, None, :]
    r3.mul_(r3.sqrt())
    norm3 = torch.einsum("kyx,kyx->k", weight, r3)
    norm4 = p[:, 4, 0] + 2.0 * p[:, 2, 2] + p[:, 0, 4]
    out = []
    for re, im, norm in ((re3, im3, norm3), (re4, im4, norm4)):
        out.append(torch.where(norm > 0, torch.hypot(re, im) / torch.where(norm > 0, norm, 1.0), 0.0))
    empty = total <= 0
    return out[0].masked_fill(empty, 0.0), out[1].masked_fill(empty, 0.0)


# Components are processed in windows of the image grouped by size (largest bounding-box side up to 12, up to 20,
# larger), each window its bounding box plus two pixels each side, so a batch with one large blob does not make
# every small component's window the whole image.
_SIZE_GROUPS = (12, 20)


def _shape_moments(index: torch.Tensor, value: torch.Tensor, image: torch.Tensor, peak: torch.Tensor,
                   box: tuple[torch.Tensor, ...], pix: torch.Tensor, cid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """|m3|, |m4| of each component's soft mask (``find_components``): the pixel value relative to the component's
    90th percentile ``peak``, ramped from 0 at 25% to 1 at 75%, over the component grown by two pixels minus every
    other object. ``box``: each component's (top, left, bottom, right); ``pix``/``cid``: its pixels."""
    B, H, W = index.shape
    dev = index.device
    top, left, bottom, right = box
    K = top.numel()
    extent = torch.maximum(bottom - top, right - left) + 1
    size_group = torch.bucketize(extent, torch.tensor(_SIZE_GROUPS, device=dev))
    group_of_pixel = size_group.index_select(0, cid)
    windows, weights, counts = [], [], []
    for g, bound in enumerate(_SIZE_GROUPS + (max(H, W),)):
        members = (size_group == g).nonzero().flatten()
        m = members.numel()
        if m == 0:
            continue
        h, w = min(H, bound + 4), min(W, bound + 4)
        # the window inside the image: an edge inside the image is >= 2 pixels from the component (growth whole)
        wtop = (top.index_select(0, members) - 2).clamp(0, H - h)
        wleft = (left.index_select(0, members) - 2).clamp(0, W - w)
        rows = wtop[:, None] + torch.arange(h, device=dev)
        cols = wleft[:, None] + torch.arange(w, device=dev)
        where = (image.index_select(0, members) * (H * W))[:, None, None] + rows[:, :, None] * W + cols[:, None, :]
        local = torch.full((K,), -1, dtype=torch.int64, device=dev)
        local.index_copy_(0, members, torch.arange(m, device=dev))
        mine = (group_of_pixel == g).nonzero().flatten()
        p, c = pix.index_select(0, mine), local.index_select(0, cid.index_select(0, mine))
        comp = torch.zeros(m * h * w, dtype=torch.bool, device=dev)
        comp.index_fill_(0, c * (h * w) + (p // W % H - wtop.index_select(0, c)) * w + (p % W - wleft.index_select(0, c)), True)
        comp = comp.view(m, h, w)
        region = _dilate2(comp) & ~((_take(index, where) >= 0) & ~comp)
        soft = (_take(value, where) * region / peak.index_select(0, members)[:, None, None] - _f32(0.25, dev)) \
            / _f32(0.5, dev)
        soft = soft.clamp(0.0, 1.0)
        positive = soft > 0
        windows.append((members, soft, wtop, wleft))
        weights.append(soft.reshape(-1).index_select(0, positive.reshape(-1).nonzero().flatten()))
        counts.append(positive.sum((1, 2)))
    threefold = torch.zeros(K, dtype=torch.float64, device=dev)
    fourfold = torch.zeros_like(threefold)
    if not windows:
        return threefold, fourfold
    # numpy's float32 sums of the weights (its raster order: a window's is the image's), all windows at once
    count = torch.cat(counts)
    totals = float32_pairwise_sums(torch.cat(weights), torch.cumsum(count, 0) - count, count)
    for (members, soft, wtop, wleft), total in zip(windows, totals.split([len(c) for c in counts])):
        m3, m4 = _moments(soft, total, wtop, wleft)
        threefold.index_copy_(0, members, m3)
        fourfold.index_copy_(0, members, m4)
    return threefold, fourfold


def _analyse(images: torch.Tensor) -> ShapesAnalysis:
    x = images.detach().float().contiguous()
    B, _, H, W = x.shape
    dev = x.device
    HW = H * W
    # one sum per image: NaN or Inf anywhere makes it non-finite (finite values are in [0, 1], check_batch)
    finite = x.flatten(1).sum(1).isfinite()
    if not bool(finite.all()):
        x = torch.where(finite[:, None, None, None], x, 0.0)  # analysed as black, scored NaN
    index, value, pixels, colors = color_pixels(x)
    runs = label_components(index, pixels, colors)
    area = torch.zeros(runs.component_first.numel(), dtype=torch.int64, device=dev)
    area.index_add_(0, runs.component, runs.length)
    keep = area >= task.MIN_AREA
    kept_id = torch.where(keep, torch.cumsum(keep, 0) - 1, -1)
    first, area = runs.component_first[keep], area[keep]
    K = first.numel()
    comp_image, comp_color = first // HW, _take(index, first).long()
    # per run of a kept component: exact integer sums for the centroid and the bounding box
    run_comp = kept_id.index_select(0, runs.component)
    kept_runs = (run_comp >= 0).nonzero().flatten()
    rc = run_comp.index_select(0, kept_runs)
    rlen = runs.length.index_select(0, kept_runs)
    rfirst = runs.first.index_select(0, kept_runs)
    rx, ry = rfirst % W, rfirst // W % H
    zeros = torch.zeros(K, dtype=torch.int64, device=dev)
    cx = zeros.index_add(0, rc, rlen * rx + rlen * (rlen - 1) // 2).double() / area + 0.5
    cy = zeros.index_add(0, rc, rlen * ry).double() / area + 0.5
    box = (torch.full_like(zeros, H).scatter_reduce(0, rc, ry, "amin"),
           torch.full_like(zeros, W).scatter_reduce(0, rc, rx, "amin"),
           zeros.scatter_reduce(0, rc, ry, "amax"), zeros.scatter_reduce(0, rc, rx + rlen - 1, "amax"))
    # the kept components' pixels
    pixel_comp = run_comp.index_select(0, runs.of_pixel)
    mine = (pixel_comp >= 0).nonzero().flatten()
    pix, cid = pixels.index_select(0, mine), pixel_comp.index_select(0, mine)
    # 90th percentile of the component's brightness: one sort of (component, value) as int64 keys (a component's
    # values are >= FG_VALUE > 0, and positive float32s order as their bit patterns)
    key = torch.sort((cid << 31) | _take(value, pix).view(torch.int32).long())[0]
    sorted_values = (key & 0x7FFFFFFF).to(torch.int32).view(torch.float32)
    peak = torch.maximum(_linear_quantile(sorted_values, torch.cumsum(area, 0) - area, area, 0.9), _f32(1e-6, dev))
    threefold, fourfold = _shape_moments(index, value, comp_image, peak, box, pix, cid)
    shape = torch.where(threefold >= task.TRIANGLE_MIN_THREEFOLD, _TRIANGLE,
                        torch.where(fourfold >= task.SQUARE_MIN_FOURFOLD, _SQUARE, _CIRCLE))
    # per (image, colour): count and the two largest (ties: first pixel first, as the checker's stable sort)
    group = comp_image * len(COLOR_NAMES) + comp_color
    G = B * len(COLOR_NAMES)
    order = torch.argsort((group * (HW + 1) + (HW - area)) * HW + first % HW)
    count = torch.bincount(group, minlength=G)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(K, device=dev) - (torch.cumsum(count, 0) - count)[group[order]]
    top = rank < 2
    slot = group[top] * 2 + rank[top]

    def table(values: torch.Tensor, fill: float | int) -> torch.Tensor:
        out = torch.full((G * 2,), fill, dtype=values.dtype, device=dev)
        out[slot] = values[top]
        return out.view(B, len(COLOR_NAMES), 2)

    listed = torch.argsort((comp_image * len(COLOR_NAMES) + comp_color) * HW + first % HW)  # find_components' order
    return ShapesAnalysis(
        finite=finite, width=W, count=count.view(B, len(COLOR_NAMES)), top_shape=table(shape, -1),
        top_cx=table(cx, float("nan")), top_cy=table(cy, float("nan")),
        top_threefold=table(threefold, float("nan")), top_fourfold=table(fourfold, float("nan")),
        comp_image=comp_image[listed], comp_color=comp_color[listed], comp_area=area[listed], comp_cx=cx[listed],
        comp_cy=cy[listed], comp_threefold=threefold[listed], comp_fourfold=fourfold[listed],
        comp_shape=shape[listed])


class _Cache:
    """The last few analyses, keyed by the images tensor (identity via a weak reference, version counter, layout).
    Shared across threads: the reward guard calls each reward in a thread of its own."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.entries: list[tuple[weakref.ref, tuple, ShapesAnalysis]] = []
        self.lock = threading.Lock()
        self.computed = 0  # analyses computed (tests: once per images tensor)

    def get(self, images: torch.Tensor) -> ShapesAnalysis:
        if images.is_inference():  # no version counter: an in-place change could not be seen
            self.computed += 1
            return _analyse(images)
        key = (images._version, images.data_ptr(), tuple(images.shape), images.stride(), images.dtype, images.device)
        with self.lock:
            for ref, k, analysis in self.entries:
                if ref() is images and k == key:
                    return analysis
        analysis = _analyse(images)
        with self.lock:
            self.computed += 1
            self.entries = [e for e in self.entries if e[0]() is not None and e[0]() is not images]
            self.entries = (self.entries + [(weakref.ref(images), key, analysis)])[-self.size:]
        return analysis


_CACHE = _Cache()


def analyse(images: torch.Tensor) -> ShapesAnalysis:
    """The batch's :class:`ShapesAnalysis`, computed once per images tensor (see the module docstring)."""
    return _CACHE.get(images)


# ------------------------------------------------------------------------------------------------------ checks
@dataclass
class _Objects:
    """The prompts' requested objects as ``[B, 2]`` tensors (colour -1: no such object phrase)."""

    color: torch.Tensor
    shape: torch.Tensor
    count: torch.Tensor
    position: torch.Tensor


_ROWS: dict[task.PromptSpec, tuple[int, ...]] = {}  # spec -> its flat row (specs are frozen, hashable)


def _row(spec: task.PromptSpec) -> tuple[int, ...]:
    row = _ROWS.get(spec)
    if row is None:
        objs = [(COLOR_NAMES.index(o.color), SHAPE_CODES[o.shape], o.count, POSITION_CODES[o.position])
                for o in spec.objects]
        row = tuple(v for o in objs + [(-1, -1, 0, -1)] * (_MAX_OBJECTS - len(objs)) for v in o)
        if len(_ROWS) >= 4096:
            _ROWS.clear()
        _ROWS[spec] = row
    return row


def _objects(specs: Sequence[task.PromptSpec], device: torch.device) -> _Objects:
    t = torch.tensor([_row(s) for s in specs], dtype=torch.int64).reshape(len(specs), _MAX_OBJECTS, 4).to(device)
    return _Objects(*t.unbind(2))


def _attribute_checks(a: ShapesAnalysis, objs: _Objects, j: int) -> tuple:
    """Object slot ``j``'s checks as ``[B]`` tensors: (present, color, count, shape, has_position, position, mine)
    with ``mine`` the indices to gather this object's colour from the per-colour tables."""
    present = objs.color[:, j] >= 0
    c = objs.color[:, j].clamp_min(0)[:, None]
    n = a.count.gather(1, c).squeeze(1)
    top_shape = a.top_shape.gather(1, c[:, :, None].expand(-1, 1, 2)).squeeze(1)
    s, want = objs.shape[:, j], objs.count[:, j]
    color_ok = n > 0
    count_ok = n == want
    shape_ok = (n > 0) & (top_shape[:, 0] == s) & ((want < 2) | (n < 2) | (top_shape[:, 1] == s))
    cx = a.top_cx.gather(1, c[:, :, None].expand(-1, 1, 2)).squeeze(1)[:, 0]
    cy = a.top_cy.gather(1, c[:, :, None].expand(-1, 1, 2)).squeeze(1)[:, 0]
    half = a.width / 2.0
    pos = objs.position[:, j]
    where = torch.stack([cx < half, cx > half, cy < half, cy > half], 1).gather(1, pos.clamp_min(0)[:, None])
    position_ok = (n > 0) & where.squeeze(1)
    return present, color_ok, count_ok, shape_ok, pos >= 0, position_ok, c


def _no_extra(a: ShapesAnalysis, objs: _Objects) -> torch.Tensor:
    named = torch.zeros_like(a.count, dtype=torch.bool)
    for j in range(_MAX_OBJECTS):
        c = objs.color[:, j]
        named |= (c[:, None] == torch.arange(len(COLOR_NAMES), device=c.device)[None]) & (c[:, None] >= 0)
    return (a.count * ~named).sum(1) == 0


def _check_specs(a: ShapesAnalysis, specs: Sequence[task.PromptSpec]) -> None:
    if len(specs) != a.count.shape[0]:
        raise ValueError(f"{len(specs)} prompt specs for {a.count.shape[0]} images")
    if any(not 1 <= len(s.objects) <= _MAX_OBJECTS for s in specs):
        raise ValueError(f"shapes prompts have 1 to {_MAX_OBJECTS} objects")


def score(a: ShapesAnalysis, specs: Sequence[task.PromptSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """``task.score_batch``: (fraction of attributes right, all-right flag) as float32 ``[B]`` tensors on the
    analysis' device; NaN for non-finite images."""
    _check_specs(a, specs)
    objs = _objects(specs, a.count.device)
    right = torch.zeros(len(specs), dtype=torch.int64, device=a.count.device)
    total = torch.zeros_like(right)
    for j in range(_MAX_OBJECTS):
        present, color_ok, count_ok, shape_ok, has_pos, position_ok, _ = _attribute_checks(a, objs, j)
        right += present * (color_ok.long() + count_ok + shape_ok + (has_pos & position_ok))
        total += present * (3 + has_pos.long())
    right += _no_extra(a, objs)
    total += 1
    frac = (right.double() / total.double()).float()  # Python's int / int, then float32 like score_batch
    strict = (right == total).float()
    nan = torch.tensor(float("nan"), device=frac.device)
    return torch.where(a.finite, frac, nan), torch.where(a.finite, strict, nan)


def shape_margin(shape: torch.Tensor, threefold: torch.Tensor, fourfold: torch.Tensor) -> torch.Tensor:
    """``shapes_soft.shape_margin`` for tensors (shape codes)."""
    t3, t4 = task.TRIANGLE_MIN_THREEFOLD, task.SQUARE_MIN_FOURFOLD
    return torch.where(shape == _TRIANGLE, threefold - t3,
                       torch.where(shape == _SQUARE, torch.minimum(t3 - threefold, fourfold - t4),
                                   torch.minimum(t3 - threefold, t4 - fourfold)))


def soft_score(a: ShapesAnalysis, specs: Sequence[task.PromptSpec], temperature: float) -> torch.Tensor:
    """``shapes_soft.soft_score`` of each image as float32 ``[B]`` (NaN for non-finite images): the checker's
    attributes with each shape check replaced by the mean sigmoid margin of the object's ``count`` largest
    components, summed in the checker's attribute order in float64."""
    _check_specs(a, specs)
    dev = a.count.device
    objs = _objects(specs, dev)
    temp = torch.tensor(temperature, dtype=torch.float64, device=dev)  # a tensor: true division on every device
    acc = torch.zeros(len(specs), dtype=torch.float64, device=dev)
    total = torch.zeros(len(specs), dtype=torch.int64, device=dev)
    for j in range(_MAX_OBJECTS):
        present, color_ok, count_ok, _, has_pos, position_ok, c = _attribute_checks(a, objs, j)
        n = a.count.gather(1, c).squeeze(1)
        idx = c[:, :, None].expand(-1, 1, 2)
        m3 = a.top_threefold.gather(1, idx).squeeze(1)
        m4 = a.top_fourfold.gather(1, idx).squeeze(1)
        want = objs.shape[:, j][:, None].expand(-1, 2)
        sig = 1.0 / (1.0 + torch.exp(-shape_margin(want, m3, m4) / temp))
        used = torch.minimum(n, objs.count[:, j])  # mine[:count]
        pair = (sig[:, 0] + torch.where(used >= 2, sig[:, 1], 0.0)) / used.clamp_min(1)
        shape_soft = torch.where(used > 0, pair, 0.0)
        # the checker's attribute order: color, count, shape, position (Python's left-to-right sum)
        for term in (color_ok.double(), count_ok.double(), shape_soft):
            acc = torch.where(present, acc + term, acc)
        acc = torch.where(present & has_pos, acc + position_ok.double(), acc)
        total += present * (3 + has_pos.long())
    acc = acc + _no_extra(a, objs).double()
    out = (acc / (total + 1).double()).float()
    return torch.where(a.finite, out, torch.tensor(float("nan"), device=dev))
