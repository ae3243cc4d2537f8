"""The engine's forwards as functions of tensors only: no Python values read from the GPU, no request
objects. That is what lets `graphs.py` compile them with `torch.compile(fullgraph=True)` (and, for the
decode path, run them on static buffers in CUDA graphs); eagerly they are the same code.

`DecodeSteps`, shapes fixed per batch bucket:
- `target`: the target model over T tokens per request (T = 1 plain decode, T = K+1 verify) and the tokens it
            chooses (`sampling.choose`: the token after input position i sits at position i + 1; penalized
            steps read `penalties`, the device counts of what each request emitted, `engine/penalties.py`).
- `draft`:  the MTP catch-up over a verify's positions, then the K-step draft chain from each request's
            accepted position (see speculative.py for the algorithm; K = 0: the catch-up alone).
- `chain`:  the draft chain alone (after a prefill, where the catch-up is the prefill's MTP pass).
Their caches are DECODE-kind (`batch_invariant`), so every linear computes each row on its own and a row's
numbers never depend on the other rows (padding rows included). Each takes the sampler's `mode` (a Python
constant: one graph per mode) and its per-request inputs (`sampling.row_fields(mode)`, none when greedy).

`PrefillSteps`, one request's prompt chunk of any length (compiled with the length dynamic, no graphs):
- `target`: the target model over the chunk (chunked delta rule, tiled causal attention).
- `mtp`:    the MTP head over the chunk's positions.
- `packed`: mixed steps: the target model over several requests' chunks laid end to end (`engine/packed.py`:
            batch-invariant linears over all tokens with the prefill plans, the GDN and attention per chunk).
            Eager only.
"""

from __future__ import annotations

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine import sampling
from qwen_mtp.engine.packed import PackedChunks, PackedStepCache
from qwen_mtp.engine.paged_cache import PagedStepCache, StepBatch, StepKind
from qwen_mtp.engine.penalties import PenaltyState
from qwen_mtp.engine.sampling import GREEDY, Mode
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.model.mtp import DraftLmHead
from qwen_mtp.ops.linear import prefill_rows


class DecodeSteps:
    def __init__(self, model: QwenHybridForCausalLM, pages: PagePool, states: StatePool, k: int):
        self.model, self.pages, self.states, self.k = model, pages, states, k  # k: the most drafts a step makes
        # `mtp.draft_vocab` / `mtp.draft_lm_head: fp8`: what the drafts score with (None: the target's lm_head)
        self.draft_head: DraftLmHead | None = None
        self.penalties: PenaltyState | None = None  # what penalized steps read (set by the runner)

    def _cache(self, tokens, positions, rows, tables, lens) -> PagedStepCache:
        batch = StepBatch(StepKind.DECODE, tokens, positions, rows, tables, lens, fresh=False)
        return PagedStepCache(batch, self.pages, self.states)

    def _choose(
        self, hidden: torch.Tensor, mode: Mode, chosen_positions: torch.Tensor, sampling_rows: dict, penalty_inputs=None
    ):
        logits = self.model.logits(hidden, invariant=True)
        shard = self.model.vocab_shard
        return sampling.choose(
            logits, mode, chosen_positions, **sampling_rows, penalty_inputs=penalty_inputs, shard=shard
        )

    def _propose(
        self, hidden: torch.Tensor, mode: Mode, positions: torch.Tensor, sampling_rows: dict, penalty_inputs=None
    ):
        """The head's draft [B] from its post-norm output [B, H] for the token at `positions` [B], scored by the
        target's lm_head, or by `draft_head` when set. With a draft vocabulary: greedy, the argmax over its ids;
        sampled or penalized (coupled), its logits spread over the whole vocabulary (-inf elsewhere) so each id meets
        the same noise and penalties as in the target's choice."""
        head = self.draft_head
        if head is None:
            return self._choose(hidden, mode, positions, sampling_rows, penalty_inputs)[0]
        logits = head.logits(hidden)  # [B, N]
        shard = self.model.vocab_shard  # tensor parallel: this rank's part of the ids, the best over the ranks
        if head.ids is not None and mode.greedy:
            return head.ids[logits.float().argmax(dim=-1)] if shard is None else shard.argmax(logits.float(), head.ids)
        full = head.full_logits(logits, self.model.lm_head_weight.shape[0])  # [B, V] (V / tp under TP)
        return sampling.choose(full, mode, positions, **sampling_rows, penalty_inputs=penalty_inputs, shard=shard)[0]

    def target(
        self,
        tokens: torch.Tensor,  # [B, T] long
        positions: torch.Tensor,  # [B, T] long
        rows: torch.Tensor,  # [B] long: state pool rows
        tables: torch.Tensor,  # [B, W] int32: page tables
        lens: torch.Tensor,  # [B] int32: positions cached after the step
        mode: Mode = GREEDY,
        **sampling_rows: torch.Tensor,  # [B] each: `sampling.row_fields(mode)`
    ) -> tuple[torch.Tensor, torch.Tensor, sampling.Logprobs | None]:
        """Post-norm hidden states [B, T, H], the tokens chosen from them [B, T], and their logprobs when the
        mode reports them."""
        cache = self._cache(tokens, positions, rows, tables, lens)
        hidden = self.model.hidden_states(tokens, positions, cache)
        chosen_positions = positions + 1
        penalty_inputs = self.penalties.inputs(rows, chosen_positions, tokens) if mode.penalized else None
        chosen, logprobs = self._choose(hidden, mode, chosen_positions, sampling_rows, penalty_inputs)
        return hidden, chosen, logprobs

    def draft(
        self,
        tokens: torch.Tensor,  # [B, K+1] the verify's chosen tokens c_0..c_K (token i+1 of position i)
        hidden: torch.Tensor,  # [B, K+1, H] the verify's target hidden states
        positions: torch.Tensor,  # [B, K+1] the verified positions n..n+K
        rows: torch.Tensor,
        tables: torch.Tensor,  # pages must cover n + j + K positions (the scheduler grows them to n + 2K)
        lens: torch.Tensor,  # [B] n + K + 1
        accepted: torch.Tensor,  # [B] long: drafts accepted by the verify (j)
        override: torch.Tensor,  # [B, K] long: oracle tokens
        use_override: torch.Tensor,  # [B, K] bool: where the oracle replaces the head's proposal
        mode: Mode = GREEDY,  # the drafts' sampler (`Mode.for_drafts`)
        **sampling_rows: torch.Tensor,
    ) -> torch.Tensor:
        """MTP catch-up over the verified positions, then the chain from index j. Returns drafts [B, K'], K' the
        width of `override` (the drafts the next step verifies; the catch-up always covers the K+1 positions)."""
        cache = self._cache(tokens, positions, rows, tables, lens)
        mtp_hidden = self.model.mtp_hidden_states(tokens, hidden, positions, cache)
        index = accepted[:, None, None].expand(-1, 1, mtp_hidden.shape[-1])
        start = torch.gather(mtp_hidden, 1, index)[:, 0]
        first = positions[:, 0] + accepted + 1
        return self._chain(start, first, rows, tables, override, use_override, mode, sampling_rows)

    def chain(self, hidden, first, rows, tables, override, use_override, mode=GREEDY, **sampling_rows):
        """Drafts [B, K] from the MTP output `hidden` [B, H] at each request's last consumed position;
        `first` [B] = that position + 1, where the chain's second step sits."""
        return self._chain(hidden, first, rows, tables, override, use_override, mode, sampling_rows)

    def _chain(self, hidden, first, rows, tables, override, use_override, mode, sampling_rows) -> torch.Tensor:
        """K drafts, K = the width of `override` (0..k: a K = 0 step drafts nothing, only catches up)."""
        k = override.shape[1]
        if k == 0:
            return override
        drafts = []
        for step in range(k):
            # draft `step` proposes the token at position first + step + 1 (the noise of that position; penalized,
            # the counts with the chain's earlier drafts, as the target will count them if they are accepted)
            position = first + step + 1
            penalty_inputs = None
            if mode.penalized:
                earlier = torch.stack(drafts, dim=1) if drafts else rows.new_empty(rows.shape[0], 0)
                penalty_inputs = self.penalties.inputs_after(rows, position, earlier)
            proposed = self._propose(hidden, mode, position, sampling_rows, penalty_inputs)
            drafts.append(torch.where(use_override[:, step], override[:, step], proposed))
            if step == k - 1:
                break
            # The next draft sits one position further: MTP input (this draft, own output) at first + step.
            positions = (first + step)[:, None]
            cache = self._cache(drafts[-1][:, None], positions, rows, tables, (positions[:, 0] + 1).int())
            hidden = self.model.mtp_hidden_states(drafts[-1][:, None], hidden[:, None], positions, cache)[:, 0]
        return torch.stack(drafts, dim=1)


class PrefillSteps:
    def __init__(self, model: QwenHybridForCausalLM, pages: PagePool, states: StatePool):
        self.model, self.pages, self.states = model, pages, states

    def _cache(self, tokens, positions, rows, tables, lens, fresh: bool) -> PagedStepCache:
        batch = StepBatch(StepKind.PREFILL, tokens, positions, rows, tables, lens, fresh)
        return PagedStepCache(batch, self.pages, self.states)

    def target(
        self,
        tokens: torch.Tensor,  # [1, T] long: the chunk
        positions: torch.Tensor,  # [1, T] long
        rows: torch.Tensor,  # [1] long: the request's state row
        tables: torch.Tensor,  # [1, W] int32: its pages, covering the chunk
        lens: torch.Tensor,  # [1] int32: positions cached after the chunk
        fresh: bool,  # the chunk starts the sequence: no conv window or SSM state to read
    ) -> torch.Tensor:
        """Post-norm hidden states [1, T, H]."""
        return self.model.hidden_states(tokens, positions, self._cache(tokens, positions, rows, tables, lens, fresh))

    def packed(self, batch: PackedChunks) -> torch.Tensor:
        """Post-norm hidden states [1, N, H] of the packed chunks: the invariant linears with the prefill plans
        (`ops.linear.prefill_rows`), made for N in the hundreds to thousands."""
        cache = PackedStepCache(batch, self.pages, self.states)
        with prefill_rows():
            return self.model.hidden_states(batch.token_ids, batch.positions, cache)

    def packed_alone(self, tokens, positions, rows, tables, lens, cu_seqlens, fresh: bool) -> torch.Tensor:
        """`packed` over one chunk (a packed step that holds a single request's chunk): the same forward, with
        every input a tensor, so that a full chunk can replay it from a CUDA graph (`graphs.ChunkGraphs`)."""
        length = tokens.shape[1]
        return self.packed(PackedChunks(tokens, positions, rows, tables, lens, cu_seqlens, (length,), (fresh,)))

    def mtp(self, tokens, hidden, positions, rows, tables, lens) -> torch.Tensor:
        """The MTP head over the chunk: `tokens` hold the *next* tokens (token i+1 at position i), `hidden`
        [1, T, H] the target's. Returns post-`mtp.norm` hidden [1, T, H]. The MTP layers are attention layers:
        no recurrent state, so no `fresh`."""
        cache = self._cache(tokens, positions, rows, tables, lens, fresh=False)
        return self.model.mtp_hidden_states(tokens, hidden, positions, cache)

    def mtp_packed(self, batch: PackedChunks, hidden: torch.Tensor) -> torch.Tensor:
        """`mtp` over packed chunks of several requests (`hidden` [1, N, H]): post-`mtp.norm` hidden [1, N, H]."""
        cache = PackedStepCache(batch, self.pages, self.states)
        with prefill_rows():
            return self.model.mtp_hidden_states(batch.token_ids, hidden, batch.positions, cache)
