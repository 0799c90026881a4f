"""Run a script the way a user without hf_dscale would: a fresh process in which `import hf_dscale` fails.

The package is installed in the test environment, so the script is prefixed with an import hook that refuses
`hf_dscale` and its submodules (a `ModuleNotFoundError`, as where it is not installed); transformers' own
check of a remote module's imports then fails too if shipped code needs hf_dscale. The process runs from an
empty folder with `PYTHONPATH` cleared, `HF_HUB_OFFLINE=1` and its own `HF_MODULES_CACHE`.
"""

from __future__ import annotations

import os
import subprocess
import sys

WITHOUT_HF_DSCALE = '''
import importlib.abc, sys


class _WithoutHfDscale(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_dscale" or name.startswith("hf_dscale."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _WithoutHfDscale())
try:
    import hf_dscale  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("hf_dscale is importable in the isolated process")
'''


def run_without_hf_dscale(script: str, *args: str, workdir, env: dict | None = None,
                          timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `script` (Python source) with `args` in a process where hf_dscale cannot be imported."""
    workdir = os.fspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    full_env = dict(os.environ, PYTHONPATH="", HF_HUB_OFFLINE="1",
                    HF_MODULES_CACHE=os.path.join(workdir, "modules"), **(env or {}))
    return subprocess.run([sys.executable, "-c", WITHOUT_HF_DSCALE + script, *args], cwd=workdir, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
