"""The architecture sweep over every causal-LM class the installed transformers registers (`hf_dscale.sweep`).

One run (two worker processes, a few minutes) decodes each class tiny and random through the engine (its default, the
chain, the own tree with the prompt lookup and D²SD, batch 1 and a left-padded batch of 3) and through
`assistant_model=`, against plain `generate()`. The engine must never differ, crash, hang or refuse after it started
decoding; what it cannot decode it refuses by name.
"""

from __future__ import annotations

import re

import pytest
import transformers

from hf_dscale.models.dscale import compat
from hf_dscale.sweep import sweep

from .test_docs import README

HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "falcon_h1", "bamba", "granitemoehybrid",
           "jamba", "zamba2", "nemotron_h", "olmo_hybrid")


@pytest.fixture(scope="module")
def verdicts():
    return {v.model_type: v for v in sweep(workers=2, timeout_s=120.0)}


def _engine(verdict) -> dict[str, str]:
    return {way: said for way, said in verdict.ways.items() if way.startswith("engine") or way == "all"}


def test_the_engine_never_differs_crashes_or_hangs(verdicts):
    failed = {kind: {way: said for way, said in v.failures.items() if way.startswith("engine") or way == "all"}
              for kind, v in verdicts.items() if v.built == "ok"}
    failed = {kind: ways for kind, ways in failed.items() if ways}
    assert not failed, failed
    assert not [kind for kind, v in verdicts.items() if "hang" in v.ways.values()]
    assert sum(v.built == "ok" for v in verdicts.values()) >= 100  # the sweep reached most of transformers


def test_parity_with_transformers_own_speculation(verdicts):
    """Of the classes `assistant_model=` decodes exactly (transformers speculates at batch 1 only), the engine decodes
    at least 95 % exactly at batch 1, every way, on the release the README's table is of (5.25: 138 of 145; 5.17: 110
    of 116; the rest keep indexed, chunked or windowed-recurrent layers, or, on 5.17, an encoder RoFormer, and are
    refused by name); every hybrid (recurrent, linear-attention and conv layers) among them also as a left-padded
    batch of 3, by default, with the own tree and the prompt lookup, and with D²SD."""
    exact = [k for k, v in verdicts.items() if v.built == "ok" and v.ways.get("assistant_model b1") == "identical"]
    ours = [k for k in exact if all(s == "identical" for w, s in _engine(verdicts[k]).items() if w.endswith("b1"))]
    share = 0.95 if transformers.__version__ == _table_version() else 0.9
    assert len(ours) >= share * len(exact), sorted(set(exact) - set(ours))
    for kind in HYBRIDS:
        if kind not in verdicts or verdicts[kind].built != "ok":
            continue
        for way in ("engine b3", "engine tree b3", "engine d2sd b3"):
            said = verdicts[kind].ways[way]
            if compat.records_recurrent_steps():
                assert said == "identical", (kind, verdicts[kind].ways)
            else:  # 5.17-5.24 keep no per-token recurrent state: refused by name (a conv-only model still decodes)
                assert said == "identical" or "per token" in said, (kind, said)


def _table_version() -> str:
    """The transformers release the README's table was generated on."""
    return re.search(r"on transformers ([\w.]+):", README.split("<!-- targets:start -->")[1]).group(1)


def test_the_readme_table_holds(verdicts):
    """Every model type the README lists as decoded identically is decoded identically here (where it built), on
    the transformers release the table was generated on (other releases change which families route their attention
    through transformers' interface; the first test holds on every release)."""
    if transformers.__version__ != _table_version():
        pytest.skip(f"the README's table is of transformers {_table_version()}, this is {transformers.__version__}")
    section = README.split("<!-- targets:start -->")[1].split("<!-- targets:end -->")[0]
    listed = set()
    for line in section.splitlines():
        if line.startswith("| identical"):
            listed |= set(re.findall(r"`([\w.-]+)`", line.split("|")[2]))
    assert len(listed) >= 80
    wrong = {k: _engine(verdicts[k]) for k in listed if k in verdicts and verdicts[k].built == "ok"
             and not all(s == "identical" or s.startswith("n/a") or s.startswith("refused: ") and "batch of 1" in s
                         for s in _engine(verdicts[k]).values())}
    assert not wrong, wrong
