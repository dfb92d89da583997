"""The C++ token-mask kernel (kernels/token_mask.h) against the torch path it replaces on
the CPU, on the same logits and bitmasks: every machine with the kernels compares both, so
neither can drift (a machine without them tests the torch path alone elsewhere)."""

from __future__ import annotations

import pytest
import torch

from zerohop.engine import kernels
from zerohop.engine.structured.masking import BITS, GrammarMask

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built")


def masked_both_ways(
    rows: int, vocab: int, constrained: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(original logits, masked by the kernel, masked by torch) for random bitmasks."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator)
    words = -(-vocab // BITS)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(constrained), words), generator=generator)
    bitmask = bitmask.to(torch.int32)
    index = torch.tensor(constrained, dtype=torch.long)
    mask = GrammarMask(vocab)
    by_kernel, by_torch = logits.clone(), logits.clone()
    kernels.load().apply_token_bitmask(by_kernel, bitmask, index)
    mask._apply_with_torch(by_torch, bitmask, index)
    return logits, by_kernel, by_torch


@pytest.mark.parametrize(
    ("rows", "vocab", "constrained"),
    [(1, 32, [0]), (4, 1000, [0, 2]), (7, 49_153, [6, 1, 3]), (32, 777, list(range(0, 32, 3)))],
)
def test_the_kernel_masks_exactly_as_torch_does(rows: int, vocab: int, constrained: list) -> None:
    for seed in range(3):
        logits, by_kernel, by_torch = masked_both_ways(rows, vocab, constrained, seed)
        assert torch.equal(by_kernel, by_torch)
        untouched = [r for r in range(rows) if r not in constrained]
        assert torch.equal(by_kernel[untouched], logits[untouched])  # other rows as they were
        assert torch.isinf(by_kernel[constrained]).any()  # the masks did ban tokens
