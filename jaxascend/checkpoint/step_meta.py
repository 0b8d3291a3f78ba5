"""The items of a checkpoint step and its ``meta`` record: names, format, crc32c, reading it back.

The ``meta`` item (Orbax's ``JsonSave``) holds the step, the run config, the caller's meta and
the crc32c of every array leaf; its own crc32c guards the record, since a garbled byte may still
parse as JSON. :func:`read_meta` is how a resume, a restore and an export read it;
:func:`jsonable` makes the caller's meta JSON-serialisable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import jax
import numpy as np

from jaxascend.native import extension as _native
from jaxascend.checkpoint.checksums import ORBAX_ITEMS
from jaxascend.checkpoint.errors import CorruptCheckpointError
from jaxascend.config import Config

PARAMS, OPT_STATE, RNG = ORBAX_ITEMS  # the items Orbax writes; their files get crc32c records
OFFLOADED, META = "offloaded", "meta"
META_FILE = "metadata"  # the file Orbax's JsonSave writes in the item directory
FORMAT = "jaxascend-checkpoint/1"


def read_meta(step_dir: Union[str, Path]) -> dict:
    """The ``meta`` item of a step directory (format, step, items, config, meta), checked."""
    path = Path(step_dir) / META / META_FILE
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"format is {record.get('format') if isinstance(record, dict) else None!r}, "
                             f"expected {FORMAT!r}")
        missing = [key for key in ("step", "items", "config", "meta", "crc32c") if key not in record]
        if missing:
            raise ValueError(f"it lacks {missing}")
        saved_crc = record.pop("crc32c")
        if saved_crc != record_crc(record):
            raise ValueError(f"its contents have crc32c {record_crc(record):#010x}, it recorded {saved_crc:#010x}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from None
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupt ({err})") from None
    return record


def record_crc(record: dict) -> int:
    """The crc32c of a meta record (its JSON with sorted keys), which the record itself keeps."""
    return _native.crc32c(np.frombuffer(json.dumps(record, sort_keys=True).encode(), np.uint8))


def jsonable(value: Any, where: str) -> Any:
    """``value`` with numpy/JAX scalars and small arrays turned into Python numbers/lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(value).tolist()
    raise TypeError(f"checkpoint {where}: {type(value).__name__} is not JSON-serialisable; "
                    f"save arrays as params/opt_state/rng")


def as_dict(run_config: Union[Config, dict]) -> dict:
    """A run config as the plain dict a meta record holds."""
    return run_config.to_dict() if isinstance(run_config, Config) else dict(run_config)
