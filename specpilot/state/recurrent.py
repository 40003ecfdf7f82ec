"""Hybrid targets' recurrent state, beside the KV cache: per request slot and Gated DeltaNet layer, the
convolution's last inputs and the delta rule's state matrices (float32). A request's state is its slot's,
zeroed when the slot is taken; a pass reads it and writes it back (after a verify, only the accepted
path's, so rollback needs no snapshots: a verify leaves what its commit needs in `pending`)."""

from __future__ import annotations

from typing import Any

import torch


class RecurrentCache:
    def __init__(self, num_layers: int, num_slots: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.conv = torch.zeros(num_slots + 1, num_layers, *conv_shape, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_slots + 1, num_layers, *ssm_shape, dtype=torch.float32, device=device)
        # layer -> a verify's tree pass and its requests' (slot, first row, rows), until its commit
        self.pending: dict[int, Any] = {}

    def reset(self, slot: int) -> None:
        """A new request in `slot`: nothing before its first token."""
        self.conv[slot].zero_()
        self.ssm[slot].zero_()
