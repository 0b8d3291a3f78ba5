"""The plan's anchor: what DeepSpeed's own estimator says the same model needs, printed beside
jaxascend's figures so a reader can place them."""

from __future__ import annotations


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int) -> tuple[int, int]:
    """(host, GPU) bytes of DeepSpeed's ``estimate_zero3_model_states_mem_needs`` with parameters
    and optimizer offloaded to CPU, one GPU, ``zero_init`` and its default 1.5x buffer factor:
    18 B/param of model states on the host, the largest layer in fp32 on the GPU."""
    return int(total_params * 18 * 1.5), 4 * largest_layer_params
