"""The `hf-dscale` command on a tiny target saved to disk (the JSON keys are a public contract)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import transformers

from hf_dscale.cli import main
from hf_dscale.kernels import cpu_linear
from hf_dscale.models.dscale.assistant import CPU_DRAFT_CONFIDENCE

from ..conftest import cpu_like_costs, tiny_drafter, tiny_target
from ..training.test_trainer import _tokenizer

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "data", "prompts.jsonl")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = tiny_target("qwen3")
    target.save_pretrained(root / "target")
    _tokenizer().save_pretrained(root / "target")
    tiny_drafter(target).save_pretrained(root / "drafter")
    return root


def test_bench_writes_the_contract_keys(folders, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--method", "dscale", "--prompts", PROMPTS, "--limit", "2", "--max-new-tokens", "12",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for key in ("method", "n_prompts", "tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "identical",
                "stage_ms"):
        assert key in report
    assert report["n_prompts"] == 2 and report["identical"] is True and report["tau"] >= 1.0
    assert set(report["stage_ms"]) == {"draft", "verify", "other"}
    # a cycle and a plain step against the time to read the target's weights once
    assert report["weights_read_ms"] > 0
    assert report["cycle_ms"] == pytest.approx(sum(report["stage_ms"].values()), abs=0.01)
    assert report["cycle_over_weights_read"] == pytest.approx(report["cycle_ms"] / report["weights_read_ms"], rel=1e-2)
    assert report["plain_step_ms"] == pytest.approx(1000 / report["baseline_tokens_per_s"], rel=1e-2)
    assert report["plain_step_over_weights_read"] == pytest.approx(
        report["plain_step_ms"] / report["weights_read_ms"], rel=1e-2)
    assert report["command"].startswith("hf-dscale bench")
    assert [p["id"] for p in report["per_prompt"]] == [json.loads(line)["id"] for line in open(PROMPTS)][:2]
    assert all(p["identical"] and p["tau"] >= 1.0 for p in report["per_prompt"])
    assert report["device"] == "cpu" and report["draft_confidence"] == "auto"  # the CPU's default cut
    machine = report["machine"]  # what the speedup was measured on
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == torch.get_num_threads()
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and "gpu" not in machine
    block_size = json.loads((folders / "drafter" / "config.json").read_text())["block_size"]
    assert report["verify_costs_ms"] == {str(w): round(1000 * s, 2) for w, s in cpu_like_costs(block_size).items()}
    kernel = cpu_linear.unavailable() is None  # the conftest makes the kernel the cheaper wherever it runs
    assert report["plan"]["cpu_linear_widths"] == (list(range(1, block_size + 1)) if kernel else None)
    assert report["plan"]["direct_widths"] == list(range(1, block_size + 1))  # the conftest makes it the cheaper
    assert report["min_drafts"] is None
    # the verify path the run took (the conftest makes every width transposed wherever the probe allows it)
    assert report["verify_forward"] == "split-head"
    assert report["verify_head_transposed"] == list(range(1, block_size + 1))
    assert report["compile_widths"] is None  # a CPU's default: eager, and the plan says why
    assert any(r.startswith("eager verify: the default on a CPU") for r in report["plan"]["reasons"])


@pytest.mark.parametrize("confidence", ["0", "0.5"])
def test_bench_draft_confidence_sets_the_verified_block(folders, tmp_path, confidence):
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--method", "dscale", "--prompts", PROMPTS, "--limit", "2", "--max-new-tokens", "12",
                 "--draft-confidence", confidence, "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    block_size = json.loads((folders / "drafter" / "config.json").read_text())["block_size"]
    assert report["identical"] is True and report["draft_confidence"] == float(confidence)
    assert report["min_drafts"] == (None if confidence == "0" else 4)  # 4: the conftest's minimum
    if confidence == "0":
        assert report["verify_tokens"] == block_size  # no cut: every forward verifies a whole block
    else:
        assert 4 + 1 <= report["verify_tokens"] < block_size  # anchor + the minimum, fewer than all


def test_bench_draft_confidence_takes_auto_and_rejects_other_words(folders, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"), "--prompts", PROMPTS,
            "--limit", "1", "--max-new-tokens", "8", "--json", str(out), "--draft-confidence"]
    assert main(args + ["AUTO"]) == 0
    assert json.loads(out.read_text())["draft_confidence"] == "auto"
    with pytest.raises(SystemExit) as error:
        main(args + ["fast"])
    assert error.value.code == 2 and "expected 'auto' or a number in [0, 1), got 'fast'" in capsys.readouterr().err


def test_bench_peers_side_by_side(folders, tmp_path, capsys):
    """Every peer on the same prompts in one process: greedy outputs identical to plain generate(), a speedup
    matrix that is each pair's tokens/s ratio, per-prompt rows in every peer, peak memory where readable."""
    from hf_dscale.models.dscale.compat import native_dflash_reads_layer_outputs

    target = tiny_target("qwen3")
    tiny_drafter(target, seed=6).save_pretrained(tmp_path / "vp")
    out, plot = tmp_path / "peers.json", tmp_path / "peers.png"
    code = main(["bench", "--peers", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--vp-drafter", str(tmp_path / "vp"), "--num-branches", "2", "--prompts", PROMPTS, "--limit", "2",
                 "--max-new-tokens", "10", "--json", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    names = ["generate", "generate-static", "transformers-prompt-lookup"]
    names += ["transformers-dflash", "transformers-dflash-static"] if native_dflash_reads_layer_outputs() else []
    names += ["assistant_model", "dscale-auto", "dscale", "dscale-tree", "dscale-tree-lookup"]
    names += ["dscale-auto-no-cpu-kernel"] if cpu_linear.unavailable() is None else []  # where the kernel runs
    names += ["dscale-auto-model-forward"]  # the direct forward runs Qwen3
    names += ["d2sd"]
    assert set(report["refused"]) <= {"transformers-dflash-static"}  # only where the installed transformers refuses it
    names = [n for n in names if n not in report["refused"]]
    assert list(report["peers"]) == names
    assert code == (0 if all(p["identical"] for p in report["peers"].values()) else 1)
    for name in names:
        if "static" not in name:  # a static cache's masks may round differently; reported, not assumed
            assert report["peers"][name]["identical"], name
        peer = report["peers"][name]
        assert peer["new_tokens"] == sum(row[name]["new_tokens"] for row in report["per_prompt"])
        assert peer["tokens_per_s"] == pytest.approx(peer["new_tokens"] / peer["seconds"], rel=1e-3)
        assert (peer["tau"] is not None) == name.startswith(("dscale", "d2sd"))
        assert peer["peak_memory_bytes"] is None or peer["peak_memory_bytes"] > 0
        # plain decoding's step (one forward a token) and hf_dscale's cycle, each against one read of the weights
        timed = "cycle" if name.startswith(("dscale", "d2sd")) else "step" if name.startswith("generate") else None
        assert {k for k in peer if k.endswith("_ms")} == ({f"{timed}_ms"} if timed else set())
        if timed:
            assert peer[f"{timed}_over_weights_read"] == pytest.approx(peer[f"{timed}_ms"] / report["weights_read_ms"],
                                                                        rel=1e-2)
        if timed == "step":
            assert peer["step_ms"] == pytest.approx(1000 * peer["seconds"] / peer["new_tokens"], rel=1e-2)
    assert report["weights_read_ms"] > 0
    for a in names:
        for b in names:
            ratio = report["peers"][a]["tokens_per_s"] / report["peers"][b]["tokens_per_s"]
            assert report["speedup"][a][b] == pytest.approx(ratio, rel=1e-3)
    assert [row["id"] for row in report["per_prompt"]] == [json.loads(line)["id"] for line in open(PROMPTS)][:2]
    assert report["machine"]["torch"] == torch.__version__ and plot.stat().st_size > 0
    assert main(["bench", "--peers", "--method", "dscale-tree", "--target", str(folders / "target"), "--drafter",
                 str(folders / "drafter"), "--prompts", PROMPTS]) == 2
    assert "--peers runs every method" in capsys.readouterr().err


def test_bench_peers_leaves_out_a_peer_transformers_refuses(folders):
    from transformers import AutoModelForCausalLM

    from hf_dscale.evaluation import Peer, bench_peers

    target = AutoModelForCausalLM.from_pretrained(folders / "target")
    ids = torch.tensor([[5, 6, 7, 8]])
    peers = [Peer("generate", {}), Peer("unknown-cache", {"cache_implementation": "no-such-cache"})]
    report = bench_peers(target, peers, [("p0", ids)], max_new_tokens=4)
    assert list(report["peers"]) == ["generate"] and "no-such-cache" in report["refused"]["unknown-cache"]
    with pytest.raises(ValueError, match="no-such-cache"):  # the first peer is the reference: never left out
        bench_peers(target, peers[::-1], [("p0", ids)], max_new_tokens=4)


def test_bench_d2sd(folders, tmp_path):
    target = tiny_target("qwen3")
    tiny_drafter(target, seed=6).save_pretrained(tmp_path / "vp")
    out = tmp_path / "d2sd.json"
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--vp-drafter", str(tmp_path / "vp"), "--method", "d2sd", "--prompts", PROMPTS, "--limit", "2",
                 "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["method"] == "d2sd" and report["identical"] is True and report["tree_tokens"] == report["verify_tokens"] > 1
    assert report["draft_confidence"] == CPU_DRAFT_CONFIDENCE and report["verify_costs_ms"] is None  # d2sd's "auto"
    assert set(report["stage_ms"]) == {"draft", "verify", "other"}


def test_bench_d2sd_draft_confidence_shrinks_the_tree(folders, tmp_path):
    tiny_drafter(tiny_target("qwen3"), seed=6).save_pretrained(tmp_path / "vp")
    reports = []
    for confidence in ("0", "0.2"):
        out = tmp_path / f"d2sd-{confidence}.json"
        code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                     "--vp-drafter", str(tmp_path / "vp"), "--method", "d2sd", "--prompts", PROMPTS, "--limit", "1",
                     "--max-new-tokens", "10", "--draft-confidence", confidence, "--json", str(out)])
        assert code == 0
        reports.append(json.loads(out.read_text()))
    full, capped = reports
    assert full["identical"] and capped["identical"] and capped["draft_confidence"] == 0.2
    assert capped["tree_tokens"] < full["tree_tokens"]


def test_bench_dscale_tree_verifies_more_than_the_block(folders, tmp_path):
    reports = {}
    for method in ("dscale", "dscale-tree"):
        out = tmp_path / f"{method}.json"
        code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                     "--method", method, "--num-branches", "3", "--draft-confidence", "0", "--prompts", PROMPTS,
                     "--limit", "1", "--max-new-tokens", "10", "--json", str(out)])
        assert code == 0
        reports[method] = json.loads(out.read_text())
    chain, tree = reports["dscale"], reports["dscale-tree"]
    assert tree["method"] == "dscale-tree" and tree["identical"] is True and "tree_tokens" not in chain
    assert tree["tree_tokens"] > chain["verify_tokens"]  # spine + 3 branches, not the block alone


def test_bench_batched_reports_the_batch_against_batch_one(folders, tmp_path):
    out = tmp_path / "batch.json"
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompts", PROMPTS, "--limit", "3", "--batch-size", "2", "--max-new-tokens", "10",
                 "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["identical"] is True and (report["batch_size"], report["n_prompts"]) == (2, 2)
    ways = {"plain_batched", "method_batched", "method_batch_1"}
    assert set(report["tokens_per_s"]) == ways and all(report["tokens_per_s"][w] > 0 for w in ways)
    assert report["new_tokens"]["method_batched"] == report["new_tokens"]["method_batch_1"] > 0  # the same outputs
    assert report["plan"]["batch_size"] == 2 and report["batched_over_batch_1"] > 0


def test_bench_and_run_with_prompt_lookup(folders, tmp_path, capsys):
    out = tmp_path / "lookup.json"
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--method", "dscale-tree", "--prompt-lookup", "--prompts", PROMPTS, "--limit", "1",
                 "--max-new-tokens", "10", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["identical"] is True and report["prompt_lookup"] is True
    code = main(["run", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt", "t5 t6 t7", "--max-new-tokens", "8", "--tree", "--prompt-lookup"])
    assert code == 0 and "identical to plain greedy: True" in capsys.readouterr().out
    # A lookup is a branch of a token tree: the chain takes none.
    assert main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt-lookup", "--prompts", PROMPTS]) == 2
    assert "--method dscale-tree" in capsys.readouterr().err
    assert main(["run", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt-lookup", "--chain"]) == 2
    assert "leave out --chain" in capsys.readouterr().err


def test_dscale_tree_with_a_vp_drafter_is_a_clear_error(folders, tmp_path, capsys):
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--vp-drafter", str(folders / "drafter"), "--method", "dscale-tree", "--prompts", PROMPTS])
    assert code == 2
    assert "dscale-tree take none" in capsys.readouterr().err


def test_d2sd_without_vp_drafter_is_a_clear_error(folders, capsys):
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--method", "d2sd", "--prompts", PROMPTS])
    assert code == 2
    assert "--vp-drafter" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_bench_runs(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it sees: ImportError
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompts", PROMPTS, "--limit", "1", "--max-new-tokens", "4", "--json", str(out),
                 "--plot", str(tmp_path / "tau.png")])
    assert code == 2 and "--plot needs matplotlib" in capsys.readouterr().err
    assert not out.exists()  # nothing was benched: the check comes first


def test_train_then_card(folders, tmp_path):
    data, out = tmp_path / "data", tmp_path / "drafter"
    code = main(["train", "--target", str(folders / "target"), "--prompts", PROMPTS, "--data-dir", str(data),
                 "--out", str(out), "--fusion", "shared", "--num-taps", "2", "--block-size", "4",
                 "--mask-token-id", "95", "--max-new-tokens", "8", "--steps", "3", "--save-every", "2",
                 "--num-anchors", "4", "--grad-accum", "1"])
    assert code == 0
    assert (out / "model.safetensors").exists() and (out / "checkpoint-2" / "trainer_state.pt").exists()
    assert len((out / "log.jsonl").read_text().splitlines()) == 3
    bench = tmp_path / "b.json"
    assert main(["bench", "--target", str(folders / "target"), "--drafter", str(out), "--prompts", PROMPTS,
                 "--limit", "1", "--max-new-tokens", "6", "--json", str(bench)]) == 0
    assert main(["card", "--drafter", str(out), "--bench", f"DFlash={bench}", "--training", "data=tiny"]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "DFlash (shared fusion)" in card and "hf-dscale bench" in card


@pytest.mark.parametrize("slowdown", [40.0, 1.5])
def test_bf16_asked_for_on_a_cpu_that_emulates_it_is_warned_about(folders, tmp_path, capsys, monkeypatch, slowdown):
    from hf_dscale.cli import common

    monkeypatch.setattr(common, "bf16_slowdown", lambda device: slowdown)  # as measured on such a CPU, or not
    code = main(["train", "--target", str(folders / "target"), "--prompts", PROMPTS, "--limit-per-file", "2",
                 "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--block-size", "4",
                 "--mask-token-id", "95", "--max-new-tokens", "4", "--steps", "0", "--dtype", "bfloat16"])
    assert code == 0
    err = capsys.readouterr().err
    assert ("--dtype bfloat16: this CPU has no native bfloat16" in err) == (slowdown > 8)
    assert ("40x slower than float32" in err) == (slowdown > 8)
    # (--mixed-precision bf16 is not run here: accelerate's state is per process and other tests set it)
    common.warn_if_slow_bf16("cpu", "--dtype bfloat16", "--mixed-precision bf16")
    err = capsys.readouterr().err
    assert ("--dtype bfloat16 and --mixed-precision bf16: this CPU" in err) == (slowdown > 8)
    common.warn_if_slow_bf16("cpu")  # nothing asked for bfloat16
    assert capsys.readouterr().err == ""


def test_bf16_slowdown_is_measured_on_a_cpu_only():
    from hf_dscale.cli.common import bf16_slowdown

    assert bf16_slowdown("cuda:0") == 1.0
    assert bf16_slowdown("cpu", size=32, repeats=1) > 0


def test_train_without_cached_taps_in_batches_and_resume(folders, tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "drafter"
    common = ["train", "--target", str(folders / "target"), "--prompts", PROMPTS, "--data-dir", str(data),
              "--out", str(out), "--block-size", "4", "--mask-token-id", "95", "--max-new-tokens", "8",
              "--num-anchors", "4", "--grad-accum", "1", "--batch-size", "2", "--save-every", "1",
              "--keep-checkpoints", "5", "--cache-taps", "no"]
    assert main(common + ["--steps", "2"]) == 0
    assert json.loads((data / "meta.json").read_text())["layer_ids"] is None
    from safetensors import safe_open

    with safe_open(str(next(data.glob("shard-*.safetensors"))), "pt") as shard:
        assert set(shard.keys()) == {"input_ids", "loss_mask", "offsets"}  # the answers only
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    assert main(common[:-2] + ["--steps", "3"]) == 0  # auto: the folder's own choice; resumes at step 2
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert main(common + ["--steps", "3", "--data-layer-ids", "0,1"]) == 2
    assert "goes with --cache-taps yes" in capsys.readouterr().err


def test_train_vp_drafter_from_a_drafter_then_card(folders, tmp_path):
    data, out = tmp_path / "data", tmp_path / "vp"
    code = main(["train", "--target", str(folders / "target"), "--prompts", PROMPTS, "--data-dir", str(data),
                 "--out", str(out), "--init-from", str(folders / "drafter"), "--vp-beta", "0.9",
                 "--max-new-tokens", "8", "--steps", "2", "--num-anchors", "4", "--grad-accum", "1",
                 "--full-vocab-loss"])  # the tiny word-level tokenizer reads these prompts as its unknown token,
    # so the restricted loss would have next to nothing to score; the whole vocabulary makes the step move weights
    assert code == 0
    from hf_dscale import DScaleConfig, DScaleDrafter

    config = DScaleConfig.from_pretrained(out)
    first = DScaleConfig.from_pretrained(folders / "drafter")
    assert config.prefix_prior == 0.9 and config.target_layer_ids == first.target_layer_ids
    recorded = json.loads((out / "train_args.json").read_text())  # the shape it really trained, not flag defaults
    assert recorded["num_taps"] == len(first.target_layer_ids) and recorded["block_size"] == first.block_size
    assert recorded["fusion"] == first.fusion and recorded["mask_token_id"] == first.mask_token_id
    start = DScaleDrafter.from_pretrained(folders / "drafter").state_dict()
    trained = DScaleDrafter.from_pretrained(out).state_dict()
    assert any(not (start[k] == trained[k]).all() for k in start)  # it trained from those weights
    assert main(["card", "--drafter", str(out), "--training", "data=tiny"]) == 0
    card = (out / "README.md").read_text()
    assert "variable-prefix" in card and "vp_drafter=vp_drafter" in card


def test_bad_input_gives_a_clear_error(folders, tmp_path, capsys):
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(tmp_path / "missing"),
                 "--prompts", PROMPTS])
    assert code == 2
    assert "No drafter at" in capsys.readouterr().err
    code = main(["bench", "--target", str(folders / "target"), "--drafter", str(folders / "target"),
                 "--prompts", PROMPTS])
    assert code == 2
    assert "not a DScale, DFlash or DFlare drafter" in capsys.readouterr().err


def test_run_prints_tau_and_speedup(folders, capsys):
    code = main(["run", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt", "t5 t6 t7", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "acceptance length tau" in out and "identical to plain greedy: True" in out
    assert "a token tree with a prompt-lookup path, sized for the most tokens expected per second" in out  # the plan
    code = main(["run", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt", "t5 t6 t7", "--max-new-tokens", "8", "--chain"])
    out = capsys.readouterr().out
    assert code == 0 and "identical to plain greedy: True" in out
    assert "a chain, sized for the most tokens expected per second" in out  # the CPU's throughput cut
    code = main(["run", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--prompt", "t5 t6 t7", "--max-new-tokens", "8", "--no-compile"])
    out = capsys.readouterr().out
    assert code == 0 and "identical to plain greedy: True" in out and "compiling" not in out


def test_train_dllm_then_bench_both_methods(tmp_path, capsys):
    out = tmp_path / "dlm"
    assert main(["train-dllm", "--out", str(out), "--steps", "3", "--save-every", "2", "--batch-size", "4",
                 "--hidden-size", "32", "--layers", "1", "--heads", "2", "--gen-length", "128"]) == 0
    assert (out / "checkpoint-2" / "trainer_state.pt").exists() and (out / "tokenizer.json").exists()
    for method in ("fast-dllm", "blockbatch"):
        report_path = tmp_path / f"{method}.json"
        dtype = ["--dtype", "bfloat16"] if method == "fast-dllm" else []
        assert main(["bench-dllm", "--model", str(out), "--method", method, "--seed", "5", "--limit", "2",
                     "--plan-check-prompts", "2", "--json", str(report_path), *dtype]) == 0
        report = json.loads(report_path.read_text())
        assert report["dtype"] == ("torch.bfloat16" if dtype else "torch.float32")
        for key in ("method", "n_prompts", "nfe", "accuracy", "tokens_per_s"):
            assert key in report
        assert report["method"] == method and report["n_prompts"] == 2 and report["nfe"] >= 1
        assert report["machine"]["transformers"] == transformers.__version__
        if method == "blockbatch":  # the plan's branches, refresh and sync are the ones decoded with
            assert report["refresh_tokens"] == report["plan"]["refresh_tokens"] in (32, 64)
            assert report["block_sizes"] == report["plan"]["block_sizes"]
            assert report["sync_threshold"] == report["plan"]["sync_threshold"] in (8, 4)
            assert "validated on 2 more prompts" in report["plan"]["reason"]
            assert report["plan"]["baseline"]["validated"] is not None
    assert main(["bench-dllm", "--model", str(out), "--method", "blockbatch", "--block-sizes", "16,64",
                 "--refresh-tokens", "64", "--sync-threshold", "4", "--seed", "5", "--limit", "1", "--json",
                 str(tmp_path / "set.json")]) == 0
    report = json.loads((tmp_path / "set.json").read_text())
    assert report["block_sizes"] == [16, 64] and report["refresh_tokens"] == 64 and "plan" not in report
    assert report["sync_threshold"] == 4
    assert main(["card", "--drafter", str(out), "--bench", f"a={tmp_path / 'fast-dllm.json'}",
                 f"b={tmp_path / 'blockbatch.json'}", "--training", "steps=3"]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "masked-diffusion" in card and "hf-dscale bench-dllm" in card
    assert main(["card", "--drafter", str(out), "--bench", str(tmp_path / "fast-dllm.json")]) == 2
    assert "--bench takes LABEL=REPORT.json" in capsys.readouterr().err


def test_train_dllm_init_from_continues_a_trained_model(tmp_path, capsys):
    from hf_dscale.models.dllm import DiffusionLM

    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train-dllm", "--out", str(first), "--steps", "2", "--batch-size", "2", "--hidden-size", "32",
                 "--layers", "1", "--heads", "2", "--gen-length", "128"]) == 0
    assert main(["train-dllm", "--init-from", str(first), "--out", str(second), "--steps", "3", "--batch-size", "2",
                 "--block-fraction", "0.5", "--seed", "1", "--hidden-size", "64"]) == 0  # the shape flags yield to the model's config
    before, after = DiffusionLM.from_pretrained(first), DiffusionLM.from_pretrained(second)
    assert after.config.hidden_size == 32 and after.config.gen_length == 128
    pairs = list(zip(before.state_dict().values(), after.state_dict().values()))
    assert any(not torch.equal(a, b) for a, b in pairs)  # trained (the first step is warm-up at lr 0) ...
    assert max(float((a - b).abs().max()) for a, b in pairs) < 0.01  # ... from the first model's weights
    assert (second / "tokenizer.json").exists()
    assert main(["train-dllm", "--init-from", str(first), "--out", str(tmp_path / "x"), "--task", "other"]) == 2
    assert "Unknown task 'other'" in capsys.readouterr().err

    # another task: its words are added to the vocabulary, every arithmetic token keeps its id and row
    third = tmp_path / "third"
    assert main(["train-dllm", "--init-from", str(first), "--out", str(third), "--task", "stories", "--steps", "1",
                 "--batch-size", "2"]) == 0
    grown = DiffusionLM.from_pretrained(third)
    old_size = before.config.vocab_size
    assert grown.config.task == "stories" and grown.config.vocab_size > old_size
    assert torch.equal(grown.embed.weight[:old_size], before.embed.weight)  # one step at lr 0 (warm-up)
    assert torch.equal(grown.lm_head.weight[:old_size], before.lm_head.weight)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(third)) == grown.config.vocab_size


@pytest.mark.parametrize("fused", [False, True])
def test_weights_read_reads_every_weight_once_per_repeat(fused):
    """The floor a bench sets cycles against: each parameter and buffer reduced once per repeat (tied weights
    once), per tensor or in one multi-tensor reduction (a GPU's default); the median of the repeats' seconds."""
    from torch.overrides import TorchFunctionMode

    from hf_dscale.evaluation import weights_read_seconds

    target = tiny_target("llama")
    target.config.tie_word_embeddings = True
    target.tie_weights()
    assert target.lm_head.weight is target.model.embed_tokens.weight
    expected = {t.data_ptr() for t in [*target.parameters(), *target.buffers()]}

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.tensors = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "sum":
                self.tensors.append(args[0].data_ptr())
            elif func is torch._foreach_norm:
                self.tensors += [t.data_ptr() for t in args[0]]
            return func(*args, **(kwargs or {}))

    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # repeats of 3 s, 1 s and 2 s: the median is 2 s
    with Reads() as reads:
        seconds = weights_read_seconds(target, repeats=3, clock=lambda: next(ticks), fused=fused)
    assert seconds == 2.0
    assert sorted(reads.tensors) == sorted(list(expected) * 4)  # a first read, then one per repeat
