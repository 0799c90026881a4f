"""The C sources are the one declaration of the kernels' interfaces: `build.bind` derives the ctypes types from them."""

from __future__ import annotations

import ctypes
import re

import pytest

from hf_dscale.kernels import build, cpu_linear, dllm_host


@pytest.mark.parametrize("module", [cpu_linear, dllm_host])
def test_every_exported_function_is_bound_as_declared(module):
    source = module.SOURCE.read_text()
    exported = set(re.findall(r"^(?:void|int64_t) (hf_dscale_\w+)\(", source, flags=re.MULTILINE))
    found = build.prototypes(module.SOURCE)
    assert set(found) == exported and exported
    for name, (_, types) in found.items():
        declared = re.search(rf"{name}\(([^)]*)\)", source).group(1)
        assert len(types) == declared.count(",") + 1, name
    if module.unavailable() is None:
        library = module._library()
        for name, (returns, types) in found.items():
            assert getattr(library, name).argtypes == types and getattr(library, name).restype is returns


def test_the_attention_call_is_read_parameter_by_parameter():
    returns, types = build.prototypes(cpu_linear.SOURCE)["hf_dscale_attention_f32"]
    assert returns is None and len(types) == 23
    assert types[0] is ctypes.c_void_p and types[1] is ctypes.c_int64 and types[20] is ctypes.c_float
    assert types[22] is ctypes.c_int
    assert build.prototypes(dllm_host.SOURCE)["hf_dscale_dllm_commit_merge"][0] is ctypes.c_int64


def test_a_parameter_without_a_binding_is_named(tmp_path):
    source = tmp_path / "k.c"
    source.write_text("void hf_dscale_odd(const float *x, short n) {\n}\n")
    with pytest.raises(ValueError, match=r"hf_dscale_odd takes 'short n'"):
        build.prototypes(source)
