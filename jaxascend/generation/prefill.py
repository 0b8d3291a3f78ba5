"""A prompt's prefill as cached calls of at most ``block`` tokens each.

    prefill_blocks(1300, 512, cache_length=2048)  # (Block(0, 512), Block(512, 512), Block(1024, 512))

One cached call over the whole prompt builds float32 attention scores ``[B, K, G, t, S]`` with
``t`` the (padded) prompt: 16k tokens against a 17k cache is 34 GiB at 32 heads. In blocks, each
call writes its ``t <= block`` keys and values into the cache and attends over the cache filled
so far (``cached_attention``: key index <= query index), so the scores are ``block x S`` per
head, whatever the prompt's length; the result is the one call's up to float32 summation order.

Compiled shapes: every block but the last is exactly ``block`` tokens; the last holds the
remainder padded to :func:`~jaxascend.generation.sampling.bucket_length` (at most ``block``), the
lengths a short prompt is padded to anyway. So a prompt of any length compiles at most the one
block shape beside the buckets below it. The padding lies past the prompt: its keys are masked
for the prompt's queries and overwritten by the tokens generated there.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxascend.generation.sampling import bucket_length

# 512 tokens per call: the training attention's block (models.blockwise_attention.BLOCK_Q), the
# matmuls at full speed on CPU, and one block's float32 scores 2 KiB x S per head (1 GiB at 32
# heads and a 16k cache, where 1024 would hold 2 GiB).
PREFILL_BLOCK = 512


class Block(NamedTuple):
    """One cached call of a prefill: cache indices ``[start, start + size)``, ``size`` padded."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def check_block(block) -> int:
    """``block`` as an int; ValueError naming ``prefill_block`` unless it is an integer >= 1."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"prefill_block: must be an integer >= 1, got {block!r}")
    return block


def prefill_blocks(length: int, block: int, cache_length: int) -> tuple[Block, ...]:
    """The calls that prefill a prompt of ``length`` tokens into a cache of ``cache_length``
    positions (``length <= cache_length``): full blocks of ``block`` tokens, then the remainder
    padded to a bucket (at most ``block``, and never past the cache's end)."""
    check_block(block)
    if not 1 <= length <= cache_length:
        raise ValueError(f"prompt: {length} tokens do not fit a cache of {cache_length} positions")
    full = (length - 1) // block  # the remainder holds 1..block tokens
    blocks = [Block(i * block, block) for i in range(full)]
    start = full * block
    size = min(bucket_length(length - start), block, cache_length - start)
    return tuple(blocks) + (Block(start, size),)
