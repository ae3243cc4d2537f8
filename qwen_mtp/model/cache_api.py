"""What a model forward asks of a cache. The model never owns cache memory; the engine passes an object with
these methods (`qwen_mtp.cache.SequenceCache` for plain generation, the paged pools for the engine). Stateful
steps (attention over cached keys, the GDN conv and recurrence) run through the cache, which owns the memory
and calls the matching op (`qwen_mtp.ops`) on it."""

from __future__ import annotations

from typing import Protocol

import torch


class ForwardCache(Protocol):
    batch_invariant: bool
    """Whether each row must be computed as it would be alone: decode, verify and MTP draft steps, whose tokens
    must not depend on what shares their batch. The layers pass it to every linear (`qwen_mtp::linear`)."""

    prefill_plans: bool
    """Whether the linears run the prefill plans (a packed prefill step, `ops.linear.prefill_rows`) rather than
    the decode path's products: with FP8 weights those are W8A16, so no op quantizes an input for W8A8."""

    def positions(self, num_tokens: int) -> torch.Tensor:
        """Positions [B, num_tokens] of the tokens about to be fed to the target model."""

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store k, v [B, KV, T, D] for attention layer `layer` after its cached context, then return causal
        attention of q [B, H, T, D] over the whole context: [B, H, T, D]."""

    def sequences(self) -> list[tuple[slice, ForwardCache]]:
        """The sequences of the forward's token dim, each as (its slice of the token dim, its own cache).
        A [B, T] batch (each row one sequence) is one entry, `(slice(None), self)`; a packed step (several
        requests' chunks laid end to end in a [1, N] batch) one per chunk. The GDN's chunked path runs the conv
        per entry and the delta rule from each entry's own state, so a sequence's state never mixes with
        another's."""

    def cu_seqlens(self) -> torch.Tensor:
        """[S + 1] int32 on the device: where each of the S `sequences()` starts in the token dim, then N. Asked
        only when there are several (a packed step), for the GDN's one varlen delta rule over all of them."""

    def gdn_recurrent(self, num_tokens: int) -> bool:
        """Whether GDN layers take the token-by-token path (decode, verify) rather than the chunked one."""

    # -- chunked path (prefill): the layer computes, the cache stores ----------------------------------------
    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv window [B, C, kernel-1], SSM state [B, Hv, dk, dv]) of GDN layer `layer`; None before prefill."""

    def set_gdn_state(self, layer: str, window: torch.Tensor, ssm: torch.Tensor) -> None:
        """Record the state after a chunk: its last kernel-1 conv inputs and its final SSM state (one per batch row;
        a packed step's cache takes one per sequence, in `sequences()` order)."""

    # -- token-by-token path (decode, verify): the cache runs the stateful ops on its memory -----------------
    def gdn_conv_update(self, layer: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """silu(causal conv) of the new raw inputs x [B, T, C] continuing the committed window: [B, T, C]."""

    def gdn_delta_rule(
        self,
        layer: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,  # noqa: N803
        dt_bias: torch.Tensor,
    ) -> torch.Tensor:
        """Gates + l2norm + recurrence from the committed state; keeps the state after every token (so a
        speculative verify can commit any accepted prefix). Returns [B, T, Hv, dv]."""


def sequences(cache: ForwardCache | None) -> list[tuple[slice, ForwardCache | None]]:
    """`cache.sequences()`; without a cache the batch is one set of whole sequences."""
    return [(slice(None), None)] if cache is None else cache.sequences()


def packed_gdn_states(
    cache: ForwardCache, layer: str
) -> tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """What GDN layer `layer` of a packed step starts from: (cu_seqlens [S + 1], each sequence's conv window
    [1, C, kernel-1] or None, the SSM states [S, Hv, dk, dv] of all S sequences or None). A fresh sequence's
    state is zeros (the very numbers the zero-initial path computes with); None when every sequence is fresh."""
    windows, states = zip(*(seq.gdn_state(layer) for _, seq in cache.sequences()), strict=True)
    known = next((ssm for ssm in states if ssm is not None), None)
    if known is None:
        return cache.cu_seqlens(), list(windows), None
    ssm = torch.cat([known.new_zeros(known.shape) if s is None else s for s in states])
    return cache.cu_seqlens(), list(windows), ssm


def batch_invariant(cache: ForwardCache | None) -> bool:
    """What a layer asks of its linears: batch invariance when the cache's step needs it (no cache: no)."""
    return cache is not None and cache.batch_invariant


def decode_rows(cache: ForwardCache | None) -> bool:
    """Whether the linears run the decode path's products (decode, verify, draft rows): batch-invariant and not
    the prefill plans. There an op may quantize a W8A8 product's input in its own launch (`Linear.w8a8_input`)."""
    return batch_invariant(cache) and not cache.prefill_plans
