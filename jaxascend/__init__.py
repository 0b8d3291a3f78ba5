"""jaxascend: full-parameter fine-tuning of LLMs in JAX/Flax with optimizer state on SSD.

Importing the package registers the native XLA FFI targets (``jaxascend._native``) for the CPU
platform. The subpackages, from the bottom up (``docs/architecture.md`` states the order):
``ssd`` (arena, shard store, streams), ``models``, ``data``, ``hf`` (Hugging Face in and out),
``optim`` (optax AdamW, schedules, loss scaling, fused kernels), ``checkpoint`` (Orbax) and
``offload`` (the offloaded engine). The most used pieces are re-exported here:

* :class:`HostArena` / :class:`ArenaPlan` -- one pinned, preallocated host allocation;
* :class:`SsdStore` -- checksummed ``O_DIRECT`` shard files, streamed through the arena;
* :func:`fused_adamw_update` -- the fused host AdamW kernel;
* :func:`offload_on_backward` -- instant gradient offload inside the backward pass;
* :func:`grad_stats` -- fused overflow check + sum of squares;
* :func:`load_config` / :func:`run` -- the trainer behind ``python -m jaxascend.train``.
"""

from jaxascend.config import Config, ConfigError, load_config
from jaxascend.offload import offload_on_backward
from jaxascend.optim import (AdamHyperParams, fused_adamw_update, fused_adamw_update_numpy, grad_stats,
                             tree_grad_stats)
from jaxascend.ssd import ArenaError, ArenaPlan, ChecksumError, HostArena, SsdStore, StoreError, StoreLockedError

__version__ = "0.1.0"


def run(cfg: Config):
    """Trains with ``cfg`` (see :func:`jaxascend.trainer.run`)."""
    from jaxascend.trainer import run as _run

    return _run(cfg)


__all__ = [
    "AdamHyperParams", "ArenaError", "ArenaPlan", "ChecksumError", "Config", "ConfigError", "HostArena",
    "SsdStore", "StoreError", "StoreLockedError", "__version__", "fused_adamw_update",
    "fused_adamw_update_numpy", "grad_stats", "load_config", "offload_on_backward", "run", "tree_grad_stats",
]
