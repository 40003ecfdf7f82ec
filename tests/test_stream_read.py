"""The read-limit probe (kernels/stream_read.py): its checksum is the XOR of every 32-bit word, in torch and
(under the Triton interpreter, in a subprocess) in the kernel, whatever the grid and the tail."""

from __future__ import annotations

import json
from functools import reduce

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.kernels.stream_read import stream_read_reference

SIZES = [1, 7, 4096, 10_001]


def tensor(n: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("n", SIZES)
def test_reference_is_the_xor_of_every_word(n):
    x = tensor(n)
    assert stream_read_reference(x) == reduce(lambda a, b: a ^ b, x.tolist(), 0)
    assert stream_read_reference(x.view(torch.bfloat16)) == stream_read_reference(x)  # any dtype, as words


def test_a_tensor_of_partial_words_is_refused():
    with pytest.raises(ValueError, match="whole 32-bit words"):
        stream_read_reference(torch.zeros(3, dtype=torch.bfloat16))


def _triton_results() -> dict[str, bool]:
    from specpilot.kernels.stream_read import stream_read_triton

    return {str(n): all(stream_read_reference(stream_read_triton(tensor(n), programs=p, block=256))
                        == stream_read_reference(tensor(n)) for p in (1, 3)) for n in SIZES}


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("n", SIZES)
def test_triton_reads_every_word(triton_results, n):
    assert triton_results[str(n)]


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
