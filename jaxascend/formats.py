"""The names and defaults of the files jaxascend writes, with no JAX behind them.

:mod:`jaxascend.hf` defines its file formats with these (and re-exports them); the CLIs show them
in ``--help`` (``python -m jaxascend.export --help``), which therefore answers without loading
JAX, Flax or the native extension.
"""

from __future__ import annotations

# The run's own end-of-run weights (jaxascend.hf.params_file), in its output folder.
PARAMS_FILE = "params.safetensors"
# The largest safetensors shard of an export: transformers' historical max_shard_size="5GB".
DEFAULT_SHARD_BYTES = 5 * 10**9
# Our dtype names (ModelConfig.dtype, an export's dtype) -> safetensors' names.
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
