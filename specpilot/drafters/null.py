"""The null drafter: a block of one fixed token, which the target almost never agrees with. Each step
then commits what the verify pass's first row decides - stock decoding, but through the verify path's
wider passes - so token forcing can measure how often that path alone flips a near-tie (the bound of
its statistical mode, specpilot/forcing)."""

from __future__ import annotations

import torch

from specpilot.drafters.base import Drafter
from specpilot.state.draft import Draft
from specpilot.state.request import Request


class NullDrafter(Drafter):
    name = "null"

    def __init__(self, block_size: int, token: int = 0) -> None:
        super().__init__(block_size)
        self.token = token

    def propose(self, reqs: list[Request]) -> Draft:
        return Draft(torch.full((len(reqs), self.num_proposals), self.token, dtype=torch.int64))
