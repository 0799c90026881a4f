"""Building hf_dscale's C kernels: compiled on first use with the machine's C compiler, cached per source and flags.

The C source is the one declaration of a kernel's interface: `bind` reads each exported function's prototype from
it (every function named `hf_dscale_*` that is not `static`) and sets the ctypes argument and return types.

A kernel's shared library goes into the package's cache folder (`$HF_DSCALE_CACHE/kernels`, default
`~/.cache/hf_dscale/kernels`) under a name that holds a digest of its source, compiler and flags, so an edited source
or another compiler builds anew and a built one is loaded as it is. It is compiled aside and moved in whole, so a run
that stops half-way never leaves a broken library behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..cache import cache_dir


def cache_folder() -> Path:
    return Path(cache_dir()) / "kernels"


def compiler() -> str | None:
    """`$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path, stem: str, flags: tuple[str, ...]) -> ctypes.CDLL | str:
    """The library built from `source` with `flags` (named `<stem>-<digest>.so` in `cache_folder()`), loaded; or, where
    it cannot be built or loaded, why, in words."""
    cc = compiler()
    if cc is None:
        return "no C compiler found (set $CC, or install gcc)"
    digest = hashlib.sha256(source.read_bytes() + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    target = cache_folder() / f"{stem}-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved in whole
                built = Path(tmp) / target.name
                result = subprocess.run([cc, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
                if result.returncode != 0:
                    return f"compiling {source.name} with {cc} failed: {result.stderr.strip()[:300]}"
                os.replace(built, target)
        except OSError as error:  # a cache folder that cannot be written, a compiler that cannot be run
            return f"building {target.name} in {target.parent} failed: {error}"
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        return f"loading {target.name} failed: {error}"


# C parameter and return types -> ctypes; any pointer is an address (`ctypes.c_void_p`).
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
           "void": None}
_PROTOTYPE = re.compile(r"^(void|int64_t|int|float|double)\s+(hf_dscale_\w+)\s*\(([^)]*)\)\s*\{", re.MULTILINE)


def prototypes(source: Path) -> dict[str, tuple[object, list[object]]]:
    """{name: (return ctypes type, [argument ctypes types])} of the exported functions declared in `source`."""
    found = {}
    for returns, name, params in _PROTOTYPE.findall(source.read_text()):
        types = []
        for param in " ".join(params.split()).split(","):
            param = param.strip()
            if "*" in param:
                types.append(ctypes.c_void_p)
                continue
            words = [w for w in param.split() if w not in ("const", "unsigned")]
            if len(words) != 2 or words[0] not in C_TYPES or C_TYPES[words[0]] is None:
                raise ValueError(f"{source.name}: {name} takes {param!r}, which hf_dscale binds no ctypes type to.")
            types.append(C_TYPES[words[0]])
        found[name] = (C_TYPES[returns], types)
    return found


def bind(library: ctypes.CDLL, source: Path) -> ctypes.CDLL:
    """Set `argtypes` and `restype` of every function `source` exports, as its prototype declares them."""
    for name, (returns, types) in prototypes(source).items():
        function = getattr(library, name)
        function.argtypes, function.restype = types, returns
    return library
