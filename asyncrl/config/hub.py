"""Models and adapters named by their Hugging Face Hub id (``"Qwen/Qwen2.5-1.5B-Instruct"``),
found in the local Hugging Face cache.

A path value (``model.path``, ``lora.init_path``) that is not a directory relative to the config
file, and is shaped like a Hub id (``owner/name``), is looked up in the cache that
``huggingface_hub`` uses (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) and replaced by its snapshot directory. That directory names the
commit (``.../models--Qwen--Qwen2.5-1.5B-Instruct/snapshots/<commit>``), so a checkpoint's
config pins the exact files the run started from, and a worker on another node finds the same
commit in its own cache (:func:`local_snapshot`).

Nothing is downloaded: a run of many ranks must not race to fetch the same files, and a typo in
a config must not start a download of tens of gigabytes. A model that is not in the cache is
refused, naming the id, the cache and the command that fetches it (``hf download``, the
``huggingface_hub`` command line). Offline mode (``HF_HUB_OFFLINE=1``) changes nothing here.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from asyncrl.config.root import Config
from asyncrl.errors import config_error as fail

__all__ = ["hub_id", "local_snapshot", "localize", "resolve_hub"]

_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
"""A repository id as the Hub spells it, ``owner/name``: letters, digits, ``-``, ``_`` and
``.``, at most 96 characters each. A bare ``name`` is a path (a directory next to the config
is the likelier meaning; the Hub's old owner-less ids redirect to ``owner/name`` ones)."""

_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


def hub_id(value: str) -> bool:
    """Whether ``value`` reads as a Hub repository id rather than a path: ``owner/name`` (no
    ``./``, ``~``, ``..``, leading ``/`` or second ``/``)."""
    return bool(_ID.match(value)) and ".." not in value and not value.endswith((".", "-"))


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_hub(field: str, value: str, revision: str = "") -> str:
    """The snapshot directory of Hub id ``value`` (at ``revision``: a branch, tag or commit;
    ``""``: ``main``) in the local Hugging Face cache.

    Raises:
        ConfigError: the cache holds no snapshot of it (naming ``field``, the id, the cache and
            the command that fetches it).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return str(snapshot_download(value, revision=revision or None, local_files_only=True))
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        fetch = f"hf download {value}" + (f" --revision {revision}" if revision else "")
        raise fail(
            field,
            f"{value!r} is no directory next to the config, so it was taken for a Hugging Face "
            f"Hub id, and the Hugging Face cache ({_cache()}) holds no snapshot of it{at}",
            f"fetch it with `{fetch}` (HF_HOME or HF_HUB_CACHE choose the cache), or set "
            f"{field} to the model's directory",
        ) from None


def local_snapshot(field: str, path: str) -> str:
    """``path`` if it exists here; else, for a snapshot directory of another machine's cache
    (``.../models--<owner>--<name>/snapshots/<commit>``), the same commit in this machine's
    cache: a worker on another node is sent the controller's path.

    Raises:
        ConfigError: neither exists here (naming ``field``, the id, the commit and the command
            that fetches it).
    """
    if Path(path).is_dir():
        return path
    found = _SNAPSHOT.search(path)
    if found is None:
        return path
    return resolve_hub(field, found["repo"].replace("--", "/", 1), found["commit"])


def localize(config: Config) -> Config:
    """``config`` (as the controller sent it) with its Hub snapshots found in this machine's
    cache (:func:`local_snapshot`); the same config where they are where the controller has
    them."""
    model = local_snapshot("model.path", config.model.path)
    init = local_snapshot("lora.init_path", config.lora.init_path) if config.lora.init_path else ""
    if model == config.model.path and init == config.lora.init_path:
        return config
    return msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, path=model),
        lora=msgspec.structs.replace(config.lora, init_path=init),
    )
