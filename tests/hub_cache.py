"""An offline Hugging Face cache laid out as huggingface_hub lays it out, for Hub-id tests.

    <cache>/models--<org>--<name>/
        blobs/<sha256 of the file>          the file's bytes
        snapshots/<revision>/<path>         a relative symlink to ../../blobs/<sha256>
        refs/main                           the revision the branch points to

Tests set `HF_HUB_CACHE=<cache>` (or pass `cache_dir=`) and `HF_HUB_OFFLINE=1`, then load `"<org>/<name>"`.
"""

from __future__ import annotations

import hashlib
import os


def add_to_hub_cache(cache: str | os.PathLike, repo_id: str, folder: str | os.PathLike,
                     revision: str = "0123456789abcdef0123456789abcdef01234567", branch: str = "main") -> str:
    """Copy every file under `folder` into `cache` as the snapshot `revision` of model repo `repo_id`, with
    `refs/<branch>` pointing at it. Returns the snapshot folder."""
    repo = os.path.join(os.fspath(cache), "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", revision)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for root, _, files in os.walk(folder):
        for name in files:
            source = os.path.join(root, name)
            relative = os.path.relpath(source, folder)
            with open(source, "rb") as f:
                data = f.read()
            blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
            if not os.path.exists(blob):
                with open(blob, "wb") as f:
                    f.write(data)
            link = os.path.join(snapshot, relative)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", branch), "w") as f:
        f.write(revision)
    return snapshot
