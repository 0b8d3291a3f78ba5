"""jaxascend: full-parameter fine-tuning of LLMs in JAX/Flax with optimizer state on SSD."""

from jaxascend import native as _native_registration  # noqa: F401  (registers FFI targets)
from jaxascend.grad_stats import grad_stats, tree_grad_stats

__version__ = "0.1.0"

__all__ = ["grad_stats", "tree_grad_stats", "__version__"]
