"""Tolerances for comparing two float computations of the same values that differ only in the
order of their sums (blocks, fusion, another device count, another CPU's vector width), derived
from the computation instead of calibrated on one machine.

XLA's CPU code changes with the vector ISA: the same program sums in 8 lanes with AVX2 and in 16
with AVX-512, fuses differently, and uses other polynomial approximations of exp and tanh. A
tolerance read off one machine's figure (1e-5 for blocked prefill, where an AVX2 machine gave
5.4e-6) fails on the next (Intel AVX-512/AMX: 1.98e-5; an AMD EPYC with AVX-512: 2.27e-5).

The derivation. Summing n terms in any order rounds at most n - 1 times, each time by at most
u = eps/2 of the partial sum (Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2), so
two orders differ by at most ``(n - 1) * eps * S`` with S bounding the partial sums. In a chain of
``depth`` such levels (a layer's projections, attention and MLP feed the next layer; the head
comes last) whose values keep the scale of the output (norms and residual adds keep a
transformer's activations at the scale of its logits; relative errors pass through a norm
unchanged), the first-order errors of the levels add:

    atol = eps(dtype) * reduction * depth * scale

with ``reduction`` the longest dot product of a level (hidden size, MLP width, attended keys) and
``scale`` the largest magnitude of the reference. Rounding errors of a real order are not all of
one sign: their typical sum over n terms is ~sqrt(n) u, not n u (Higham & Mary, "A new approach to
probabilistic rounding error analysis", SISC 2019), so this bound sits sqrt(2 n depth / k)
standard deviations of that model above the expected difference (k: dot products chained per
level, about 6 in a transformer layer): ~12 for the Gemma 3 test model below, at least 5 whenever
n * depth >= 16 k. It needs no constant fitted to a machine.

Sums of positive terms (a softmax's or logsumexp's denominator, a sum of squares) have
Sigma|t| = |result| and errors relative to their result; pass the dot-product length as
``reduction`` for the chain they end, not the vocabulary's or the row's size.

Tight enough for bugs. The test models' weights are drawn at 0.15 (tests/models/test_models.py),
so a real bug moves the logits by O(1), four orders of magnitude above these tolerances
(tests/test_tolerances.py checks it). Measured on an AMD EPYC with AVX-512 (no AMX), against
the prefilled-in-blocks Gemma 3 test model (4 layers, hidden 64, MLP 96, logits up to 2.95;
tests/test_blocked_prefill.py, tests/test_tolerances.py):

    derived atol (logits_atol)                          1.6e-4 - 1.7e-4
    largest blocked-vs-one-call difference (4 prompts)  2.3e-5   (Intel AVX-512/AMX: 2.0e-5)
    the second block one position late (prompts 9, 21)  0.93 - 3.2
    the last layer missing                              2.7 - 3.0
    a sliding window one key wider                      4.5 - 4.9

so 7x above the noise of two ISAs, and every bug above 5000 tolerances (Llama's too).
"""

from __future__ import annotations

import numpy as np


def reordering_rtol(*, reduction: int, depth: int = 1, dtype=np.float32) -> float:
    """The relative tolerance ``eps(dtype) * reduction * depth`` of two computations that differ
    only in summation order (see the module docstring): the ``atol`` per unit of scale.

    >>> round(reordering_rtol(reduction=64, depth=2) / np.finfo(np.float32).eps)
    128
    """
    if reduction < 1 or depth < 1:
        raise ValueError(f"reduction and depth must be >= 1, got {reduction} and {depth}")
    return float(np.finfo(dtype).eps) * reduction * depth


def reordering_atol(reference, *, reduction: int, depth: int = 1, dtype=np.float32, scale=None) -> float:
    """The absolute tolerance for comparing a reordered computation against ``reference``:
    ``reordering_rtol(...) * scale``, ``scale`` the largest ``|reference|`` unless given (give
    it when the reference is much smaller than the values summed into it, e.g. a cancelling
    gradient)."""
    if scale is None:
        scale = float(np.max(np.abs(np.asarray(reference, np.float64))))
    return reordering_rtol(reduction=reduction, depth=depth, dtype=dtype) * scale


def model_reduction(cfg, length: int) -> int:
    """The longest dot product in one layer of ``cfg``'s model over ``length`` attended keys."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return max(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * head_dim, length)


def model_depth(cfg, *, backward: bool = False) -> int:
    """Levels of ``cfg``'s model: each layer and the head; the backward pass runs them again."""
    return (cfg.num_hidden_layers + 1) * (2 if backward else 1)


def logits_atol(cfg, reference, length: int) -> float:
    """The tolerance for the logits ``reference`` of ``cfg``'s model over ``length`` keys,
    computed another way (in blocks, from a cache, fused): see the module docstring."""
    return reordering_atol(reference, reduction=model_reduction(cfg, length), depth=model_depth(cfg))


def assert_reordered_close(got, want, atol: float, label: str = "") -> float:
    """``|got - want| <= atol`` everywhere; prints and returns the largest difference (the
    measured noise beside the derived tolerance, in the ``-s`` output)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    print(f"{label}: max |difference| {diff:.2e}, derived atol {atol:.2e}")
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=label)
    return diff
