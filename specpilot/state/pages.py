"""Which pages of a KV pool hold each request slot's positions, and who owns the free ones.

A slot is a request's address space of `max_len` positions (slot row = slot * max_len + position, what the
engine, the drafters and the step layout compute with); the K/V live in a pool of pages of `page_size`
positions, and `table[slot, p // page_size]` names the page holding position p. A request is given the
pages for every position it can reach (prompt + max new tokens + a verify pass's spill) when it is admitted,
so a step never allocates, rollback stays a length change, and CUDA graphs read the table as a fixed input.
Unused entries (and the scratch slot's whole row, where graph padding writes) name the scratch page.
Samples of one prompt share its whole pages (counted, freed with their last holder): nothing writes a
position below a request's prompt length after its prefill.

Every cache of an engine (the target's, its drafter's) is sized by one PageTable and reads it: a page
number means the same positions in each of them.
"""

from __future__ import annotations

import torch

from specpilot.kernels.kv_compact import physical_rows

PAGE_SIZE = 64  # positions per page (--page-size): one key tile of the invariant attention


def valid_page_size(page_size: object) -> bool:
    """A positive power of two: the kernels take the page size as a constexpr that divides slot positions (a
    shift and a mask only then); any such size gives the same bits (attention looks the page up per key lane)."""
    return isinstance(page_size, int) and not isinstance(page_size, bool) and page_size > 0 \
        and not page_size & (page_size - 1)


class PageTable:
    def __init__(self, num_slots: int, max_len: int, pool_tokens: int | None, device: torch.device,
                 page_size: int = PAGE_SIZE) -> None:
        """`max_len` is rounded up to whole pages; the pool holds `pool_tokens` positions in whole pages, and
        at least one slot's max_len (None: every slot's, the whole-slot pool)."""
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"a page table needs slots and positions, got {num_slots} slots of {max_len}")
        if not valid_page_size(page_size):
            raise ValueError(f"--page-size must be a positive power of two (positions per KV page), got {page_size!r}")
        self.page_size = page_size
        self.pages_per_slot = -(-max_len // page_size)
        self.max_len = self.pages_per_slot * page_size
        self.num_slots = num_slots
        whole = num_slots * self.pages_per_slot
        self.num_pages = whole if pool_tokens is None else min(whole, max(-(-pool_tokens // page_size),
                                                                          self.pages_per_slot))
        self.scratch_slot = num_slots
        self.scratch_page = self.num_pages
        self.table = torch.full((num_slots + 1, self.pages_per_slot), self.scratch_page, dtype=torch.int32,
                                device=device)
        self.flat = self.table.view(-1)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._held: dict[int, list[int]] = {}
        self._holders = [0] * self.num_pages  # slots holding each page

    @property
    def whole_slots(self) -> bool:
        """Every slot can hold max_len positions at once (the pool was not cut below that)."""
        return self.num_pages >= self.num_slots * self.pages_per_slot

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pages_for(self, length: int) -> int:
        return -(-min(length, self.max_len) // self.page_size)

    def _shared(self, length: int, share: tuple[int, int] | None) -> list[int]:
        """The whole pages of `share` = (slot, positions) within the first `length` positions."""
        if share is None:
            return []
        slot, positions = share
        return self._held[slot][: min(positions, length, self.max_len) // self.page_size]

    def can_hold(self, length: int, share: tuple[int, int] | None = None) -> bool:
        """A free slot and the pages for `length` positions (capped at max_len), but those of `share`."""
        return bool(self._free_slots) and self.pages_for(length) - len(self._shared(length, share)) <= len(self._free_pages)

    def allocate(self, length: int | None = None, share: tuple[int, int] | None = None) -> int:
        """A slot whose first `length` positions (default and at most max_len) have pages. `share` = (slot,
        positions): that slot's whole pages within its first `positions` are this one's too (the prompt of
        samples of one prompt, whose prefill this slot copies)."""
        length = self.max_len if length is None else length
        if not self._free_slots:
            raise RuntimeError("KV cache full: no free slot")
        shared = self._shared(length, share)
        need = self.pages_for(length) - len(shared)
        if need > len(self._free_pages):
            raise RuntimeError(f"KV cache full: {length} positions need {need} pages, {len(self._free_pages)} are free")
        slot = self._free_slots.pop()
        pages = shared + [self._free_pages.pop() for _ in range(need)]
        for page in pages:
            self._holders[page] += 1
        self._held[slot] = pages
        self.table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32).to(self.table.device, non_blocking=True)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise ValueError(f"slot {slot} is not allocated")
        pages = self._held.pop(slot)
        self.table[slot, : len(pages)] = self.scratch_page
        for page in reversed(pages):
            self._holders[page] -= 1
            if not self._holders[page]:
                self._free_pages.append(page)
        self._free_slots.append(slot)

    def physical(self, rows: torch.Tensor) -> torch.Tensor:
        """Slot rows as rows of the pool (page * page_size + position in the page). Device-side."""
        return physical_rows(rows, self.flat, self.page_size)

    def info(self) -> dict[str, int | bool]:
        return {"page_size": self.page_size, "num_pages": self.num_pages, "free_pages": self.free_pages,
                "pool_tokens": self.num_pages * self.page_size, "pages_per_slot": self.pages_per_slot,
                "num_slots": self.num_slots, "free_slots": self.num_free, "whole_slots": self.whole_slots}
