"""``model.path`` as a Hugging Face hub id: ``Qwen/Qwen2.5-0.5B`` (or ``org/name@revision``) is
read from its snapshot folder in the Hugging Face cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``), downloaded there first when it is not cached and the hub is
online (not ``HF_HUB_OFFLINE``).

    source = locate_model("Qwen/Qwen2.5-0.5B")   # ModelSource: .folder is the snapshot
    model_config_from_hf(source.folder)

A folder of that name always wins. The cache comes first: a cached snapshot is read without the
network, whatever the hub holds now. A download fetches what a run reads and nothing else:
config.json, generation_config.json, the tokenizer files, and (``weights``) the safetensors files
the index names. huggingface_hub is imported here, and only when a hub id is looked up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from jaxascend import console
from jaxascend.config import ConfigError, HubId, parse_hub_id
from jaxascend.hf.config_map import CONFIG_FILE
from jaxascend.hf.safetensors_io import INDEX_FILE, SINGLE_FILE

# What a run reads besides the weights (the tokenizer's files in each format transformers loads).
SMALL_FILES = (CONFIG_FILE, "generation_config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "tiktoken.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
               "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class ModelSource:
    """Where ``model.path`` is read from: the folder it names, or the cache's snapshot of a hub id."""

    asked: str  # model.path as the user wrote it (what the run's config.yaml and checkpoints record)
    folder: str  # the folder read: the path itself, or <cache>/models--org--name/snapshots/<commit>
    hub: Optional[HubId] = None  # the hub id it was read as (None: a folder)
    name: str = "model.path"  # what the user set (a CLI flag: --checkpoint), for the notes

    @classmethod
    def of(cls, asked: str, folder: str) -> ModelSource:
        """The source of ``asked`` (``model.path``) read from ``folder`` (what :func:`locate_model`
        found): a hub id's snapshot unless ``asked`` is itself a folder."""
        return cls(asked, folder, None if os.path.isdir(os.path.expanduser(asked)) else parse_hub_id(asked))

    def note(self) -> Optional[str]:
        """The ``note:`` naming the snapshot a hub id is read from (None for a folder)."""
        if self.hub is None:
            return None
        return (f"{self.name}: {self.asked!r} is read from the Hugging Face cache's snapshot {self.folder} "
                f"(revision {self.hub.revision or 'main'})")

    def resume_note(self, saved_source: Optional[str], step: int) -> Optional[str]:
        """The ``note:`` for a hub id that now resolves to another snapshot than the one checkpoint
        ``step`` was made from (``saved_source``: its recorded model folder); None when the same."""
        if self.hub is None or not saved_source or os.path.normpath(saved_source) == os.path.normpath(self.folder):
            return None
        return (f"model.path: {self.asked!r} now resolves to snapshot {os.path.basename(self.folder)}; checkpoint "
                f"{step} was made from {saved_source}: the run resumes the checkpoint's weights and reads config.json "
                f"and the tokenizer from {self.folder} (to keep the old snapshot, set model.path to its folder)")


def locate_model(path: str, weights: bool = True, name: str = "model.path") -> ModelSource:
    """The folder ``model.path`` names: ``path`` itself when it is a folder, else the hub id's
    snapshot in the Hugging Face cache (downloaded there when missing and the hub is online;
    ``weights`` False: config.json and the tokenizer only, what the planner reads). Raises
    :class:`ConfigError` with one line, starting with ``name``, saying what is missing and what to do."""
    if os.path.isdir(os.path.expanduser(path)):
        return ModelSource(path, path)
    hub = parse_hub_id(path)
    if hub is None:
        raise ConfigError(f"{name}: {path!r} is not a directory")
    from huggingface_hub import constants, try_to_load_from_cache  # lazily: the CLIs' --help stays light

    cached = try_to_load_from_cache(hub.repo_id, CONFIG_FILE, revision=hub.revision)
    folder = os.path.dirname(cached) if isinstance(cached, str) else None
    missing = missing_files(folder, weights) if folder else [CONFIG_FILE]
    if not missing:
        return ModelSource(path, folder, hub, name)
    if constants.HF_HUB_OFFLINE:
        where = (f"is neither a folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE})" if folder is None
                 else f"is in the Hugging Face cache ({folder}) without {', '.join(missing[:3])}")
        raise ConfigError(f"{name}: {path!r} {where}, and the hub is offline ({_offline_setting()}): "
                          f"{_what_to_do(hub)}")
    what = "config.json, the tokenizer and the safetensors weights" if weights else \
        "config.json and the tokenizer (the plan reads no weights)"
    console.note(f"{name}: {path!r} is not in the Hugging Face cache: downloading {what} from the hub to "
                 f"{constants.HF_HUB_CACHE}")
    return ModelSource(path, _download(f"{name}: {path!r}", hub, weights, constants.HF_HUB_CACHE), hub, name)


def missing_files(folder: str, weights: bool) -> list[str]:
    """The files a run reads that ``folder`` lacks: config.json, and (``weights``) the safetensors
    file, or the index and every shard it names."""
    missing = [] if os.path.isfile(os.path.join(folder, CONFIG_FILE)) else [CONFIG_FILE]
    if weights:
        missing += [name for name in weight_files(folder) if not os.path.isfile(os.path.join(folder, name))]
    return missing


def weight_files(folder: str) -> list[str]:
    """The safetensors files of ``folder``'s model: the index and the shards it names, else the
    single file. An index that cannot be read counts as its own name (read_inputs says why)."""
    index = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index):
        return [SINGLE_FILE]
    try:
        with open(index, encoding="utf-8") as fh:
            shards = set(json.load(fh)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [INDEX_FILE]
    return [INDEX_FILE, *sorted(s for s in shards if isinstance(s, str))]


def _download(asked: str, hub: HubId, weights: bool, cache: str) -> str:
    """Downloads the run's files of ``hub`` into the cache; its snapshot folder. The small files
    first (the index names the shards), then the shards, at the commit the first call found.
    ``asked``: how the errors start (``model.path: 'org/name'``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        folder = snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=list(SMALL_FILES))
        if weights:
            snapshot_download(hub.repo_id, revision=os.path.basename(folder), allow_patterns=weight_files(folder))
    except GatedRepoError:
        raise ConfigError(f"{asked} is gated on the Hugging Face hub: accept its terms at "
                          f"https://huggingface.co/{hub.repo_id} and log in (hf auth login), or give a "
                          "folder") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{asked}: the hub's {hub.repo_id} has no revision {hub.revision!r}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{asked} is neither a folder nor a model on the Hugging Face hub (a private "
                          "one needs hf auth login)") from None
    except LocalEntryNotFoundError as err:  # the hub cannot be reached
        raise ConfigError(f"{asked} is neither a folder nor in the Hugging Face cache ({cache}), and "
                          f"the hub cannot be reached ({console.first_line(err)}): {_what_to_do(hub)}") from None
    except (HfHubHTTPError, OSError) as err:
        raise ConfigError(f"{asked}: the download from the Hugging Face hub to {cache} failed "
                          f"({console.first_line(err)})") from None
    return folder


def _what_to_do(hub: HubId) -> str:
    revision = f" --revision {hub.revision}" if hub.revision else ""
    return f"download it with `hf download {hub.repo_id}{revision}` or give a folder"


def _offline_setting() -> str:
    """The variable that keeps the hub offline, as set (huggingface_hub reads either)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return "HF_HUB_OFFLINE"
