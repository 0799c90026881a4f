"""The package's one cache folder: `$HF_DSCALE_CACHE`, default `~/.cache/hf_dscale` (converted targets, built
kernels). A leaf module: everything may import it, it imports nothing of the package."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("HF_DSCALE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_dscale"))
