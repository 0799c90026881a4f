"""`hf-dscale export`: every layout from the command line, and its errors."""

from __future__ import annotations

import json

import pytest

from hf_dscale import DScaleDrafter
from hf_dscale.cli import main

from ..conftest import tiny_drafter, tiny_target
from ..models.test_layouts import FUSION_OF, assert_same_forward


@pytest.mark.parametrize("layout", ["native", "dflash", "dflare", "transformers"])
def test_export_writes_a_folder_that_reloads_with_the_same_forward(tmp_path, capsys, layout):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, fusion=FUSION_OF[layout])
    drafter.save_pretrained(tmp_path / "src")
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out"), "--layout", layout]) == 0
    out = capsys.readouterr().out
    assert f"({layout} layout," in out and "config.json" in out and "model.safetensors" in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"][0] in out and repr(config["model_type"]) in out
    assert_same_forward(drafter, DScaleDrafter.from_pretrained(tmp_path / "out"), target)


def test_export_chain_from_an_upstream_layout(tmp_path, capsys):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, fusion="shared")
    drafter.save_pretrained(tmp_path / "src")
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "zlab"), "--layout", "dflash"]) == 0
    assert main(["export", str(tmp_path / "zlab"), str(tmp_path / "hf"), "--layout", "transformers"]) == 0
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "back"), "--layout", "native"]) == 0
    assert_same_forward(drafter, DScaleDrafter.from_pretrained(tmp_path / "back"), target)


def test_export_errors_name_the_problem(tmp_path, capsys):
    tiny_drafter(tiny_target("qwen3"), fusion="layerwise").save_pretrained(tmp_path / "src")
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out"), "--layout", "dflash"]) == 2
    assert "layer-wise" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out"), "--layout", "dflare"]) == 2
    assert "neither a local folder nor a Hub model id" in capsys.readouterr().err
