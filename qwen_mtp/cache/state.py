"""Recurrent-state pool for the GDN layers: conv windows and SSM states in rows at fixed addresses.

Each running request owns one row. A row holds `1 + K` SSM slots and a conv window `K` positions longer than
the kernel needs (K = MTP draft length, 0 without MTP): a verify over `[last, d1..dK]` writes the SSM state
after each of its K+1 tokens into slots 0..K and its conv inputs into the window; accepting j drafts then
commits slot j and window offset j by recording j. Rows are a budget: a request that finds none waits.
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(
        self,
        layers: list[str],
        num_rows: int,
        conv_dim: int,
        conv_kernel: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        spec_tokens: int,
        conv_dtype: torch.dtype,
        state_dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layer_index = {name: i for i, name in enumerate(layers)}
        self.num_rows = num_rows
        self.kernel = conv_kernel
        window, slots = conv_kernel - 1 + spec_tokens, 1 + spec_tokens
        # One row more than the budget: `scratch_row`, which no request owns, takes the writes of a CUDA
        # graph's padding rows.
        self.scratch_row = num_rows
        rows = num_rows + 1
        # [layers, rows, conv_dim, window]: raw conv inputs, oldest first; the committed window starts at offset j
        self.conv = torch.zeros(len(layers), rows, conv_dim, window, dtype=conv_dtype, device=device)
        # [layers, rows, slots, Hv, dk, dv]
        self.ssm = torch.zeros(
            len(layers), rows, slots, value_heads, key_dim, value_dim, dtype=state_dtype, device=device
        )
        # Per row: where the committed state sits. After a step that accepted j drafts it is j: the SSM state
        # is in slot j and the conv window starts at offset j. Committing is writing this index, nothing else.
        self.committed = torch.zeros(rows, dtype=torch.long, device=device)
        self._free = list(range(num_rows - 1, -1, -1))
        self.rows: dict[int, int] = {}

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    def allocate(self, request: int) -> int:
        """A zeroed row for a new sequence."""
        row = self._free.pop()
        self.conv[:, row].zero_()
        self.ssm[:, row].zero_()
        self.committed[row] = 0
        self.rows[request] = row
        return row

    def timing_rows(self, count: int) -> list[int]:
        """`count` rows for timing a step on padding rows with the state traffic of `count` requests: distinct
        rows no request owns (free rows; `allocate` zeroes a row before a request uses it, so these writes are
        harmless), then the scratch row for the rest. All on the scratch row, a large batch's step reads and
        writes one row's state from L2 and is timed far cheaper than it runs (27B: 151 MB of fp32 SSM state a
        request)."""
        free = self._free[::-1][:count]
        return free + [self.scratch_row] * (count - len(free))

    def release(self, request: int) -> None:
        row = self.rows.pop(request, None)
        if row is not None:
            self._free.append(row)

    def layer_conv(self, layer: str) -> torch.Tensor:
        """The layer's conv windows [rows, C, window] (a contiguous view, updated in place by the ops)."""
        return self.conv[self.layer_index[layer]]

    def layer_ssm(self, layer: str) -> torch.Tensor:
        """The layer's SSM slots [rows, 1+K, Hv, dk, dv] (a contiguous view, updated in place by the ops)."""
        return self.ssm[self.layer_index[layer]]

    def read(self, layer: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed (conv window [B, C, kernel-1], SSM state [B, Hv, dk, dv]) of `rows` (copies)."""
        i = self.layer_index[layer]
        start = self.committed[rows]
        conv = self.conv[i, rows]  # [B, C, window]
        index = (start[:, None] + torch.arange(self.kernel - 1, device=start.device))[:, None, :]
        window = torch.gather(conv, 2, index.expand(-1, conv.shape[1], -1))
        return window, self.ssm[i, rows, start]

    def write(self, layer: str, rows: torch.Tensor, window: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store the state after a prefill chunk: conv window [B, C, kernel-1] at offset 0, SSM state in slot 0
        (the commit that follows records 0)."""
        i = self.layer_index[layer]
        self.conv[i, rows, :, : window.shape[-1]] = window.to(self.conv.dtype)
        self.ssm[i, rows, 0] = ssm.to(self.ssm.dtype)

    def commit(self, rows: torch.Tensor, accepted: torch.Tensor) -> None:
        """The next step starts from the state after `accepted` [B] draft tokens (0 without speculation)."""
        self.committed[rows] = accepted


class StateSnapshots:
    """Copies of one row's committed GDN state (conv window, SSM state of every GDN layer) taken after a prefill
    chunk, in slots at fixed addresses: the prefix cache restores one into a new request's row so its prefill
    starts at that chunk boundary. A GDN state is a running summary of every token before it, so it can only
    be restored at exactly the position it was taken; prefill chunk boundaries never depend on the batch, which
    is what makes a snapshot there equal a cold run's state bit for bit. Slots are a budget of their own."""

    def __init__(self, states: StatePool, num_slots: int):
        self.states = states
        self.num_slots = num_slots
        layers, _, conv_dim, _ = states.conv.shape
        window = states.kernel - 1
        # [layers, slots, conv_dim, kernel - 1] and [layers, slots, Hv, dk, dv]
        self.conv = torch.zeros(layers, num_slots, conv_dim, window, dtype=states.conv.dtype, device=states.conv.device)
        self.ssm = torch.zeros(
            layers, num_slots, *states.ssm.shape[3:], dtype=states.ssm.dtype, device=states.ssm.device
        )
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    @property
    def slot_bytes(self) -> int:
        return self.bytes // max(self.num_slots, 1)

    def allocate(self) -> int | None:
        """A free slot, or None when all are taken."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def save(self, row: int, slot: int) -> None:
        """Copy `row`'s state after a prefill chunk (window at offset 0, SSM slot 0) into `slot` (device copies,
        ordered after the chunk on the device; no synchronisation)."""
        window = self.conv.shape[-1]
        self.conv[:, slot].copy_(self.states.conv[:, row, :, :window])
        self.ssm[:, slot].copy_(self.states.ssm[:, row, 0])

    def restore(self, slot: int, row: int) -> None:
        """Make `slot`'s state the committed state of `row`, as if its prefill had just reached the boundary."""
        window = self.conv.shape[-1]
        self.states.conv[:, row, :, :window].copy_(self.conv[:, slot])
        self.states.ssm[:, row, 0].copy_(self.ssm[:, slot])
        self.states.committed[row] = 0
