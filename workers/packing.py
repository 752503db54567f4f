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
