"""Recurrent-state pool for the GDN layers: conv windows and SSM states in rows at fixed addresses.

Each running request owns one row. A row holds `1 + K` SSM slots and a conv window `K` positions longer than
the kernel needs (K = MTP draft length, 0 without MTP), so speculative verify can write the state after every
position and commit by index. Rows are a budget: a request that finds none waits.
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
        self.spec_tokens = spec_tokens
        self.window = conv_kernel - 1 + spec_tokens
        slots = 1 + spec_tokens
        # [layers, rows, conv_dim, window]: the last `window` raw inputs of the conv, oldest first
        self.conv = torch.zeros(len(layers), num_rows, conv_dim, self.window, dtype=conv_dtype, device=device)
        # [layers, rows, slots, Hv, dk, dv]
        self.ssm = torch.zeros(
            len(layers), num_rows, slots, value_heads, key_dim, value_dim, dtype=state_dtype, device=device
        )
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
        self.rows[request] = row
        return row

    def release(self, request: int) -> None:
        row = self.rows.pop(request, None)
        if row is not None:
            self._free.append(row)

    def read(self, layer: str, rows: torch.Tensor, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window [B, C, kernel-1], SSM state [B, Hv, dk, dv]) of `rows`, from SSM slot `slot`."""
        i = self.layer_index[layer]
        kernel_window = self.window - self.spec_tokens
        return self.conv[i, rows, :, self.window - kernel_window :], self.ssm[i, rows, slot]

    def write(self, layer: str, rows: torch.Tensor, window: torch.Tensor, ssm: torch.Tensor, slot: int = 0) -> None:
        i = self.layer_index[layer]
        kernel_window = window.shape[-1]
        self.conv[i, rows, :, self.window - kernel_window :] = window.to(self.conv.dtype)
        self.ssm[i, rows, slot] = ssm.to(self.ssm.dtype)
