"""jaxascend: full-parameter fine-tuning of LLMs in JAX/Flax with optimizer state on SSD.

The subpackages, from the bottom up (``docs/architecture.md`` states the order): ``ssd``
(arena, shard store, streams), ``models``, ``data``, ``hf`` (Hugging Face in and out), ``optim``
(optax AdamW, schedules, loss scaling, fused kernels), ``checkpoint`` (Orbax) and ``offload``
(the offloaded engine). The most used pieces are re-exported here, each loaded on its first
access (PEP 562), so that ``import jaxascend.config`` and ``python -m jaxascend.train --help``
load no JAX; the native extension registers its FFI targets when it is first used
(:mod:`jaxascend.native`):

* :class:`HostArena` / :class:`ArenaPlan` -- one pinned, preallocated host allocation;
* :class:`SsdStore` -- checksummed ``O_DIRECT`` shard files, streamed through the arena;
* :func:`fused_adamw_update` -- the fused host AdamW kernel;
* :func:`offload_on_backward` -- instant gradient offload inside the backward pass;
* :func:`grad_stats` -- fused overflow check + sum of squares;
* :func:`load_config` / :func:`run` -- the trainer behind ``python -m jaxascend.train``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Re-exported name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(("Config", "ConfigError", "load_config"), "jaxascend.config"),
    "offload_on_backward": "jaxascend.offload",
    **dict.fromkeys(("AdamHyperParams", "fused_adamw_update", "fused_adamw_update_numpy", "grad_stats",
                     "tree_grad_stats"), "jaxascend.optim"),
    **dict.fromkeys(("ArenaError", "ArenaPlan", "ChecksumError", "HostArena", "SsdStore", "StoreError",
                     "StoreLockedError"), "jaxascend.ssd"),
}

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time __getattr__ loads them
    from jaxascend.config import Config, ConfigError, load_config
    from jaxascend.offload import offload_on_backward
    from jaxascend.optim import (AdamHyperParams, fused_adamw_update, fused_adamw_update_numpy, grad_stats,
                                 tree_grad_stats)
    from jaxascend.ssd import ArenaError, ArenaPlan, ChecksumError, HostArena, SsdStore, StoreError, StoreLockedError


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def run(cfg: "Config"):
    """Trains with ``cfg`` (see :func:`jaxascend.trainer.run`)."""
    from jaxascend.trainer import run as _run

    return _run(cfg)


__all__ = sorted(["__version__", "run", *_EXPORTS])
