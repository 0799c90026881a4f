"""Published drafter folders are complete and their remote code matches the package."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "model_cards")
PACKAGES = {  # model_type -> the package folder whose files a card ships as remote code
    "dscale": os.path.join(os.path.dirname(__file__), "..", "hf_dscale", "models", "dscale"),
    "hf_dscale_dlm": os.path.join(os.path.dirname(__file__), "..", "hf_dscale", "models", "dllm"),
}
CARDS = sorted(d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "config.json")))


@pytest.mark.parametrize("card", CARDS)
def test_card_folder_is_complete_and_in_sync(card):
    folder = os.path.join(ROOT, card)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] in PACKAGES
    package = PACKAGES[config["model_type"]]
    for module in {v.split(".")[0] for v in config["auto_map"].values()}:
        assert os.path.isfile(os.path.join(folder, module + ".py"))
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as a, open(os.path.join(package, name)) as b:
                assert a.read() == b.read(), f"{card}/{name} differs from the package: re-save the drafter"
    assert os.path.getsize(os.path.join(folder, "model.safetensors")) < 40 * 2**20
    card_text = open(os.path.join(folder, "README.md")).read()
    assert card_text.startswith("---\n") and "hf-dscale bench" in card_text  # the measured numbers' commands
