"""Sequence packing: a right-padded [B, T] micro-batch as one row of its real tokens.

Why it exists: a micro-batch is padded to its longest sequence, and a padded forward and
backward spend as much on each pad position as on a real token. Packed, the model reads one
row [1, N] (N = the real tokens) whose ``position_ids`` restart at 0 with each sequence::

    [B, T], right-padded      one row [1, N]              a per-token result, [B, T] again
    a0 a1 a2 .  .             a0 a1 a2 b0 b1 b2 b3 c0      0  a1 a2 0  0
    b0 b1 b2 b3 .    pack ->   0  1  2  0  1  2  3  0      0  b1 b2 b3 0    <- unpack
    c0 .  .  .  .             (position_ids)               0  0  0  0  0

transformers (5.x) reads the restarts as sequence boundaries when no ``attention_mask`` is
given: sdpa and eager attention get a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``), flash_attention_2 its varlen kernel (the
cu_seqlens come from the positions). A per-token result aligned like log-probs (token t's
from the output at t - 1) reads the previous sequence at each sequence's first token;
``unpack(..., shifted=True)`` zeroes it there, as the padded computation does at t = 0, and
zeroes the pads, so everything downstream of the model sees [B, T] as before.

The cost: sdpa and eager still score every (query, key) pair of the row, masked, N^2 for
B T^2 padded; on CPU, with a tiny model, that costs more than the padding saved (hence
``trainer.pack`` off by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from yatt.errors import ProtocolError


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded [B, T] batch sit in the packed row."""

    valid: Tensor  # [B, T] bool, the real tokens: a prefix of each row
    position_ids: Tensor  # [1, N] int64, each token's position in its own sequence


def padding_problem(attention: Tensor) -> str:
    """What keeps ``attention`` [B, T] (True on real tokens) from packing; '' if nothing."""
    if attention.dim() != 2:
        return f"attention_mask must be [B, T] (got shape {tuple(attention.shape)})"
    valid = attention.bool()
    right_padded = torch.arange(valid.shape[1], device=valid.device) < valid.sum(-1, keepdim=True)  # [B, T]
    bad = (valid != right_padded).any(-1).nonzero()
    if len(bad):
        return (
            f"attention_mask row {int(bad[0])} is not right-padded (a real token after a pad); "
            "trainer.pack needs right-padded rows, as MicroBatch has them"
        )
    return ""


def plan(attention: Tensor) -> Packing:
    """The packing of a batch with ``attention`` [B, T] (True on real tokens, right-padded)."""
    problem = padding_problem(attention)
    if problem:
        raise ProtocolError(problem)
    valid = attention.bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)  # [B, T]
    return Packing(valid=valid, position_ids=positions[valid].unsqueeze(0))


def pack(x: Tensor, packing: Packing) -> Tensor:
    """[B, T, ...] -> [1, N, ...]: the real tokens' entries, row after row."""
    return x[packing.valid].unsqueeze(0)


def unpack(y: Tensor, packing: Packing, *, shifted: bool = False) -> Tensor:
    """[1, N, ...] -> [B, T, ...], zeros at the pads; differentiable.

    ``shifted``: ``y`` is aligned like log-probs (token t's entry comes from the output at
    t - 1), so each sequence's first entry, which read the previous sequence, is 0 too."""
    row = y[0]
    if shifted:
        first = (packing.position_ids[0] == 0).view(-1, *[1] * (row.dim() - 1))
        row = row.masked_fill(first, 0)
    out = row.new_zeros((*packing.valid.shape, *row.shape[1:]))
    return out.index_put((packing.valid,), row)


# ------------------------------------------------------------------ a group's shared prompt
#
# GRPO's n samples of a prompt repeat it n times in the batch: padded or packed, its forward
# and backward are paid n times. With ``trainer.share_prompt`` the rows that share a prompt
# (the same token ids before their first loss token) run as one row: the prompt but its last
# token once, then each row's remainder from that last token on, each segment seeing the
# prompt and itself only, positions continuing from the prompt's::
#
#   rows (prompt p0 p1 p2)       one row                          positions
#   p0 p1 p2 a0 a1 .             p0 p1 | p2 a0 a1 | p2 b0 b1 b2   0 1 | 2 3 4 | 2 3 4 5
#   p0 p1 p2 b0 b1 b2
#
# The prompt's last token is repeated (one token a row) so that every segment is an ordinary
# causal sequence and each row's first completion token is read, as always, from the output
# just before it. The prompt's gradient is the sum of its rows' (autograd through the one
# copy). Each token's result is that of its padded row up to float rounding (a test holds it
# to 1e-6 in float32). The mask is [R, 1, S, S], given to the model as a prepared 4D mask:
# sdpa and eager attention read it; flash-attention's kernels cannot (refused at start).


@dataclass(frozen=True)
class Layout:
    """How a right-padded [B, T] batch runs through the model ([R, S] rows), and where each
    token's shifted result (log-prob, entropy, value: read from the output before it) lies."""

    input_ids: Tensor  # [R, S]
    position_ids: Tensor  # [R, S]
    attention_mask: Tensor  # [R, 1, S, S] bool, True where a query (dim 2) sees a key (dim 3)
    where: Tensor  # [B, T] int64: index into the flattened [R * S] result; -1: none (0 there)
    shared: int  # the prompt tokens computed once instead of once a row (the saving)

    def back(self, x: Tensor) -> Tensor:
        """A shifted per-token result [R, S, ...] -> [B, T, ...], zeros where ``where`` is -1;
        differentiable (a row's prompt positions all read the one copy)."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat[self.where.clamp(min=0)]
        keep = (self.where >= 0).view(*self.where.shape, *[1] * (out.dim() - 2))
        return out.masked_fill(~keep, 0)


def forward_flops(shape: tuple[int, ...], parameters: float, layers_x_hidden: float) -> float:
    """A forward's FLOPs over rows [R, S]: 2 a parameter a position (the dense part) and
    4 x layers x hidden a (query, key) pair (scores and their sum over values), every pair of
    a row, masked or not, as sdpa computes a masked row. The backward is about twice this."""
    rows, width = shape
    return 2 * parameters * rows * width + 4 * layers_x_hidden * rows * width * width


def share_prompts(ids: Tensor, attention: Tensor, loss_mask: Tensor, *, one_row: bool = False) -> Layout:
    """The layout of ``ids`` [B, T] (right-padded, ``attention`` True on real tokens) in which
    the rows with the same prompt (ids before the row's first ``loss_mask`` token) share it:
    a row per prompt, padded to the longest; ``one_row``: all of them in one row (packed)."""
    problem = padding_problem(attention)
    if problem:
        raise ProtocolError(problem)
    lengths = attention.sum(-1).tolist()
    firsts = torch.where(loss_mask.any(-1), loss_mask.int().argmax(-1), attention.sum(-1)).tolist()
    cpu = ids.cpu()
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, (n, first) in enumerate(zip(lengths, firsts, strict=True)):
        if n > 0:
            groups.setdefault(tuple(cpu[b, : min(max(first, 1), n)].tolist()), []).append(b)
    # Per output row: token ids, positions, each token's segment and the prompt segment it
    # also sees; per input row: (output row, the index in it of each token's shifted result).
    rows: list[tuple[list[int], list[int], list[int], list[int]]] = []
    placed: list[tuple[int, int, list[int]]] = []
    segment, shared = 0, 0
    for prompt_ids, members in groups.items():
        p = len(prompt_ids)
        segment += 1
        prompt_seg = segment
        toks, pos = list(prompt_ids[:-1]), list(range(p - 1))
        seg, sees = [prompt_seg] * (p - 1), [prompt_seg] * (p - 1)
        first_start = p - 1  # the first segment's start
        for b in members:
            n, start = lengths[b], len(toks)
            segment += 1
            tail = cpu[b, p - 1 : n].tolist()  # from the prompt's last token on
            toks += tail
            pos += range(p - 1, n)
            seg += [segment] * len(tail)
            sees += [prompt_seg] * len(tail)
            # token t < p - 1: the prompt's copy; t = p - 1: the first segment's start (it
            # reads the prompt's last output, as each row's would); t >= p: the row's own.
            placed.append((b, len(rows), list(range(p - 1)) + [first_start] + list(range(start + 1, start + n - p + 1))))
        shared += (len(members) - 1) * (p - 1)
        rows.append((toks, pos, seg, sees))
    if one_row and rows:
        offsets = [0]
        for row in rows[:-1]:
            offsets.append(offsets[-1] + len(row[0]))
        placed = [(b, 0, [offsets[r] + i for i in index]) for b, r, index in placed]
        toks, pos, seg, sees = ([x for row in rows for x in row[k]] for k in range(4))
        rows = [(toks, pos, seg, sees)]
    width = max((len(row[0]) for row in rows), default=1)
    shape = (max(len(rows), 1), width)
    input_ids = torch.zeros(shape, dtype=torch.int64)
    position_ids = torch.zeros(shape, dtype=torch.int64)
    seg_of = -torch.arange(1, shape[0] * width + 1).view(shape)  # pads: a segment each
    sees_of = seg_of.clone()
    for r, (toks, pos, seg, sees) in enumerate(rows):
        k = len(toks)
        input_ids[r, :k], position_ids[r, :k] = torch.tensor(toks), torch.tensor(pos)
        seg_of[r, :k], sees_of[r, :k] = torch.tensor(seg), torch.tensor(sees)
    where = torch.full(ids.shape, -1, dtype=torch.int64)
    for b, r, index in placed:
        where[b, 1 : lengths[b]] = torch.tensor(index[1:], dtype=torch.int64) + r * width
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    sees_key = (seg_of[:, None, :] == seg_of[:, :, None]) | (seg_of[:, None, :] == sees_of[:, :, None])  # [R, S, S]
    mask = (sees_key & causal)[:, None]  # [R, 1, S, S]: query dim 2, key dim 3
    device = ids.device
    return Layout(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=mask.to(device),
        where=where.to(device),
        shared=shared,
    )
