"""The architecture sweep: every causal-LM class the installed transformers registers, built tiny and random, decoded
greedily through hf_dscale's engine (`custom_generate`: its default, the chain, the own tree with the prompt lookup,
and D²SD) and through `assistant_model=`,
at batch 1 and as a left-padded batch of 3, and compared token for token with plain `generate()`.

Each class gets a verdict per way: "identical", "refused: ..." (a ValueError raised before the target's first
forward, naming what cannot be decoded), or a failure: "DIFFERS", "crashed: ...", "refused late: ..." (after a
forward) or "hang" (past the time limit). The suite fails on any failure (`tests/test_sweep.py`); the docs keep the
table `hf-dscale sweep --readme README.md` writes between its `<!-- targets:... -->` markers.

A class whose tiny configuration does not build, or that plain `generate()` cannot run from token ids, is listed
with why and left out of the counts. The drafter is a random `DScaleDrafter` sized by `DScaleConfig.from_target`
whose proposals are replaced by plain `generate()`'s own continuation with errors (`OracleDrafter`), so every
verify accepts and rejects at several depths; D²SD's variable-prefix drafter is a random one of the same size.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from .models.dscale import DScaleConfig, DScaleDrafter

VOCAB = 128
LAYERS = 4
NEW_TOKENS = 12
# Sizes a tiny config takes where its class has the key: widths, depths, heads, experts, ranks, state sizes.
TINY = dict(
    hidden_size=64, n_embd=64, d_model=64, n_embed=64, embed_dim=64, dim=64,
    intermediate_size=128, n_inner=128, ffn_dim=128, ffn_hidden_size=128, decoder_ffn_dim=128, mlp_dim=128,
    num_hidden_layers=LAYERS, n_layer=LAYERS, num_layers=LAYERS, n_layers=LAYERS, decoder_layers=LAYERS,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, decoder_attention_heads=4, encoder_attention_heads=4,
    encoder_layers=LAYERS, encoder_ffn_dim=128,
    num_key_value_heads=2, head_dim=16, attention_head_dim=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, n_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    mamba_d_state=16, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16,
    state_size=16, chunk_size=16, conv_L_cache=3, mamba_d_ssm=128, rotary_dim=8,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=32,
    max_position_embeddings=512, n_positions=512, n_ctx=512, vocab_size=VOCAB,
)
# Hybrids whose default layout, cut to `LAYERS`, would hold one kind of layer only: a layout with both kinds.
HYBRID = {
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
    "bamba": dict(attn_layer_indices=[1, 3]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "zamba2": dict(hybrid_layer_ids=[1, 3]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"]),
}
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
WAYS = ("engine", "engine chain", "engine tree", "engine d2sd", "assistant_model")


@dataclass
class Verdict:
    """What the sweep found for one model type: its class, and per way and batch ("engine b1", ...) a verdict."""

    model_type: str
    cls: str
    built: str = "ok"  # "ok", or why the tiny model or its plain generate() did not run
    ways: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    stateful: bool = False  # some layer keeps a conv window or recurrent state (trees verified path by path)

    @property
    def failures(self) -> dict[str, str]:
        return {way: v for way, v in self.ways.items()
                if not (v == "identical" or v.startswith("refused: ") or v.startswith("n/a: "))}


def causal_lm_types() -> dict[str, str]:
    """model_type -> causal-LM class name, as the installed transformers registers them (text decoders only:
    classes named *ForConditionalGeneration, and those whose config holds a `text_config`, take images or audio;
    their text models are registered under their own types, `qwen3_5_text` for `qwen3_5`)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {kind: name for kind, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
            if "ConditionalGeneration" not in name and kind in CONFIG_MAPPING
            and "text_config" not in (getattr(CONFIG_MAPPING[kind], "sub_configs", None) or {})}


def tiny_config(model_type: str):
    """The class's default config at the sizes of `TINY`, with per-layer lists cut to `LAYERS` entries
    (a layer of each kind first, so a hybrid stays one) and special tokens inside the vocabulary."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    depth = next((defaults[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if
                  isinstance(defaults.get(k), int)), None)
    kwargs = {k: v for k, v in TINY.items() if k in defaults}
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: its head size is the rope part's, no groups
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    for key, value in defaults.items():
        if isinstance(value, list) and depth and len(value) == depth and key not in kwargs:
            kwargs[key] = [value[i] for i in _covering(value)]
    kwargs.update(HYBRID.get(model_type, {}))
    if "is_decoder" in defaults:  # an encoder family's causal-LM head is a decoder only when asked
        kwargs["is_decoder"] = True
    for key, value in SPECIAL.items():
        if key in defaults:
            kwargs[key] = value
    return config_class(**kwargs)


def _covering(per_layer: list) -> list[int]:
    """`LAYERS` indices into a per-layer list, in order: the first layer of each distinct kind, then the last ones."""
    firsts = {}
    for i, kind in enumerate(per_layer):
        firsts.setdefault(repr(kind), i)
    chosen = set(list(firsts.values())[:LAYERS])
    for i in reversed(range(len(per_layer))):
        if len(chosen) >= LAYERS:
            break
        chosen.add(i)
    return sorted(chosen)


def _prompts(batch: int, length: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    ids[:, length // 2:] = ids[:, : length - length // 2]  # a repeat: the prompt lookup finds matches
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        ids[b, : 2 * b + 1], mask[b, : 2 * b + 1] = SPECIAL["pad_token_id"], 0
    return ids, mask


class OracleDrafter(DScaleDrafter):
    """A `DScaleDrafter` whose forward runs as usual, but whose proposals are a known continuation (`oracle[b]`, by
    position id) with a random token instead at rate `error_rate`: verifies accept and reject at every depth."""

    oracle: list[list[int]] | None = None
    error_rate: float = 0.2
    boost: float = 30.0  # logit added to the proposed token: 30 = a near one-hot q, a few units = a smooth one

    def draft_logits(self, anchor_ids, taps, anchor_positions, context_position_ids, cache, context_valid=None,
                     vocab=None, compact=False):
        real = super().draft_logits(anchor_ids, taps, anchor_positions, context_position_ids, cache, context_valid,
                                    vocab)
        logits = torch.randn_like(real)
        for b in range(real.shape[0]):
            seq = self.oracle[b if len(self.oracle) > 1 else 0]
            for k in range(real.shape[1]):
                pos = int(anchor_positions[b]) + 1 + k
                token = seq[pos] if pos < len(seq) else 0
                if torch.rand(()) < self.error_rate:
                    token = int(torch.randint(0, real.shape[-1], ()))
                logits[b, k, token] += self.boost
        return restrict(logits, vocab, compact)


def restrict(logits: torch.Tensor, vocab, compact: bool = False) -> torch.Tensor:
    """A proposal confined to a `DraftVocab` (None: the whole vocabulary), as the real drafter's is; `compact`
    keeps only the vocabulary's columns, in its order, as `DScaleDrafter.block_logits(compact=True)` does."""
    if vocab is None:
        return logits
    return logits[..., vocab.ids] if compact else logits.masked_fill(~vocab.member, float("-inf"))


def oracle_from(sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Per row, the tokens of reference outputs with left padding removed: index = position id."""
    if attention_mask is None:
        return sequences.tolist()
    grown = sequences.shape[1] - attention_mask.shape[1]
    keep = torch.cat((attention_mask.bool(), attention_mask.new_ones(sequences.shape[0], grown).bool()), dim=1)
    return [sequences[b][keep[b]].tolist() for b in range(sequences.shape[0])]


class _Forwards:
    """Counts the target's decoding forwards (those handed a cache; a pre-hook), so that a refusal can be told apart
    from a late failure. The engine's structure probe (`engine/structure.py`) runs without one."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            self.count += 1


def _one_way(model, drafter, vp_drafter, way: str, ids, mask, plain) -> str:
    from .generation import custom_generate

    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    if way == "assistant_model":
        kwargs["assistant_model"] = drafter
    else:
        kwargs.update(custom_generate=custom_generate, drafter=drafter, draft_confidence=0.0)
        kwargs.update({"engine chain": dict(draft_tree=False), "engine tree": dict(draft_tree=True, prompt_lookup=True),
                       "engine d2sd": dict(vp_drafter=vp_drafter)}.get(way, {}))
    forwards = _Forwards(model)
    try:
        torch.manual_seed(3)
        out = model.generate(**kwargs)
    except ValueError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return f"refused: {first}" if forwards.count == 0 else f"refused late: {first}"
    except Exception as error:  # a crash is a verdict, not a sweep failure
        return f"crashed: {_said(error)}"
    finally:
        forwards.handle.remove()
    return "identical" if torch.equal(out, plain) else "DIFFERS"


def _said(error: Exception) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(error).splitlines()[0][:160] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def check(model_type: str, built=None) -> Verdict:
    """Build `model_type` tiny and random and decode it every way (see the module's docstring). `built()` is called
    once the model and its plain outputs are ready."""
    start = time.perf_counter()
    verdict = Verdict(model_type, causal_lm_types().get(model_type, "?"))
    try:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().eval()
        verdict.cls = type(model).__name__
        model.generation_config.pad_token_id = SPECIAL["pad_token_id"]
        model.generation_config.eos_token_id = SPECIAL["eos_token_id"]
        batches = {f"b{n}": _prompts(n) for n in (1, 3)}
        plains = {}
        for name, (ids, mask) in batches.items():
            try:
                plains[name] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                              do_sample=False)
            except Exception as error:
                if name == "b1":
                    raise
                verdict.ways.update({f"{way} {name}": f"n/a: plain generate() fails ({_said(error)})" for way in WAYS})
    except Exception as error:
        verdict.built = _said(error)
        verdict.seconds = time.perf_counter() - start
        return verdict
    if built is not None:
        built()
    try:
        torch.manual_seed(1)
        config = DScaleConfig.from_target(model.config, num_hidden_layers=1, mask_token_id=VOCAB - 1, block_size=8)
        drafter, vp_drafter = OracleDrafter(config).eval(), DScaleDrafter(config).eval()
    except Exception as error:  # a ValueError names what from_target cannot read: a refusal; anything else a failure
        said = f"refused: no drafter: {str(error).splitlines()[0]}" if isinstance(error, ValueError) else \
            f"no drafter: {_said(error)}"
        verdict.ways.update({f"{way} {name}": said for way in WAYS for name in plains})
        verdict.seconds = time.perf_counter() - start
        return verdict
    from .engine import structure

    verdict.stateful = bool(structure.of(model).stateful)  # the engine's probe (kept per target): the counter then
    # sees the decoding alone
    for name, (ids, mask) in batches.items():
        if name not in plains:
            continue
        drafter.oracle = oracle_from(plains[name], mask)
        for way in WAYS:
            verdict.ways[f"{way} {name}"] = _one_way(model, drafter, vp_drafter, way, ids, mask, plains[name])
    verdict.seconds = time.perf_counter() - start
    return verdict


def _worker(tasks, results) -> None:
    torch.set_num_threads(1)
    while True:
        model_type = tasks.get()
        if model_type is None:
            return
        try:
            results.put(asdict(check(model_type, built=lambda: results.put({"ready": model_type}))))
        except Exception:  # the sweep's own bug: reported as the class's verdict
            results.put(asdict(Verdict(model_type, "?", built="sweep error: " + traceback.format_exc(limit=2))))


def sweep(model_types=None, *, workers: int = 2, timeout_s: float = 60.0, progress=None) -> list[Verdict]:
    """`check` every model type (default: all of `causal_lm_types`) in `workers` processes; a class still decoding
    `timeout_s` after its tiny model was built is a "hang" (one that takes a third of that to build is left out of
    the counts), and its worker is replaced. `progress(verdict)` is called as each one ends."""
    kinds = list(model_types or causal_lm_types())
    context = mp.get_context("spawn")
    results = context.Queue()
    pool: dict[int, tuple] = {}  # slot -> (process, tasks queue, model type, started)
    pending, done, ready = list(reversed(kinds)), [], set()

    def start(slot):
        tasks = context.Queue()
        process = context.Process(target=_worker, args=(tasks, results), daemon=True)
        process.start()
        pool[slot] = (process, tasks, None, 0.0)

    def feed(slot):
        process, tasks, _, _ = pool[slot]
        if pending:
            kind = pending.pop()
            tasks.put(kind)
            pool[slot] = (process, tasks, kind, time.monotonic())
        else:
            tasks.put(None)
            pool[slot] = (process, tasks, None, 0.0)

    for slot in range(min(workers, len(kinds))):
        start(slot)
        feed(slot)
    while len(done) < len(kinds):
        try:
            message = results.get(timeout=1.0)
        except queue.Empty:
            message = None
        if message is not None and "ready" in message:
            ready.add(message["ready"])
            for slot, (process, tasks, kind, _) in pool.items():  # the decoding's own time limit starts now
                if kind == message["ready"]:
                    pool[slot] = (process, tasks, kind, time.monotonic())
            continue
        found = None if message is None else Verdict(**message)
        if found is not None:
            done.append(found)
            if progress:
                progress(found)
            slot = next(s for s, (_, _, kind, _) in pool.items() if kind == found.model_type)
            feed(slot)
            continue
        for slot, (process, _, kind, began) in list(pool.items()):
            limit = timeout_s if kind in ready else timeout_s / 3  # building a tiny model takes seconds
            if kind is not None and time.monotonic() - began > limit:
                process.kill()
                hung = Verdict(kind, causal_lm_types().get(kind, "?"), ways={"all": "hang"}, seconds=timeout_s)
                if kind not in ready:  # the sweep's tiny size, not hf_dscale: left out of the counts
                    hung.built, hung.ways = f"the tiny model or its plain generate() took over {limit:.0f} s", {}
                done.append(hung)
                if progress:
                    progress(hung)
                start(slot)
                feed(slot)
    for process, tasks, _, _ in pool.values():
        process.kill()
    return sorted(done, key=lambda v: v.model_type)


def summary(verdicts: list[Verdict]) -> dict[str, int]:
    """Counts over the classes that built: decoded identically by the engine (both ways, both batches), refused
    by it, failed by it; identical through `assistant_model=` at batch 1."""
    built = [v for v in verdicts if v.built == "ok"]

    def engine(v):
        return [s for way, s in v.ways.items() if way.startswith("engine")] or ["hang"]

    return dict(
        built=len(built),
        engine_identical=sum(all(s == "identical" for s in engine(v)) for v in built),
        engine_refused=sum(not v.failures and any(s.startswith("refused") for s in engine(v)) for v in built),
        engine_failed=sum(any(way.startswith("engine") or way == "all" for way in v.failures) for v in built),
        assistant_identical=sum(v.ways.get("assistant_model b1") == "identical" for v in built),
    )


def _reason(said: str) -> str:
    """A refusal's reason without the class name, layer numbers, asides and the advice after it: what groups
    classes."""
    said = re.sub(r"^refused: ", "", said)
    said = re.sub(r"Unsupported target class \w+: |\w+For\w+'s |\w+For\w+ ", "", said)
    said = re.sub(r" ?\[(?:None|\d+)?(?:, (?:None|\d+))*\]", "", said)  # layer numbers and windows
    said = re.sub(r"\b(a|an) \w+Config\b", "its config", said)
    while re.search(r"\([^()]*\)", said):
        said = re.sub(r" ?\([^()]*\)", "", said)
    return re.split(r";| Decode | Load |, so ", said)[0].strip().rstrip(".:")


def groups(verdicts: list[Verdict]) -> dict[str, list[str]]:
    """Model types by what the engine does with them: identical every way; identical at batch 1 (refused batched);
    refused, by reason; failed. Only classes that built."""
    out: dict[str, list[str]] = {}
    for v in verdicts:
        if v.built != "ok":
            continue
        engine = {way: said for way, said in v.ways.items() if way.startswith("engine") or way == "all"}
        if v.failures and any(way in engine for way in v.failures):
            key = "FAILED: " + next(said for way, said in v.failures.items() if way in engine)[:80]
        elif all(said == "identical" or said.startswith("n/a") for said in engine.values()):
            key = "identical" + (" (layers with a recurrent or conv state)" if v.stateful else "")
        elif all(said == "identical" for way, said in engine.items() if way.endswith("b1")):
            key = "identical at batch 1; " + _reason(next(s for s in engine.values() if s != "identical"))
        else:
            key = "refused: " + _reason(next(s for s in engine.values() if s.startswith("refused")))
        out.setdefault(key, []).append(v.model_type)
    return dict(sorted(out.items(), key=lambda item: (not item[0].startswith("identical"), -len(item[1]))))


def readme_section(verdicts: list[Verdict], transformers_version: str) -> str:
    """The README's table of targets: the counts, then the model types by verdict."""
    counts = summary(verdicts)
    lines = [
        f"Generated by `hf-dscale sweep --readme README.md` on transformers {transformers_version}: each causal-LM "
        f"class built tiny and random, decoded greedily through the engine (its default, the chain, the own tree with "
        f"the prompt lookup and D²SD, batch 1 and a left-padded batch of 3) and through `assistant_model=`, against "
        f"plain `generate()`. Of {counts['built']} "
        f"classes that build, the engine decodes {counts['engine_identical']} identically every way and refuses "
        f"{counts['engine_refused']} by name before decoding; `assistant_model=` is identical on "
        f"{counts['assistant_identical']} at batch 1.",
        "",
        "| through the engine | model types |",
        "|---|---|",
    ]
    for key, kinds in groups(verdicts).items():
        lines.append(f"| {key} | " + ", ".join(f"`{k}`" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def replace_section(text: str, section: str) -> str:
    """`text` with what lies between `<!-- targets:start -->` and `<!-- targets:end -->` replaced by `section`."""
    start, end = "<!-- targets:start -->\n", "<!-- targets:end -->"
    if start not in text or end not in text:
        raise ValueError(f"The file has no {start.strip()} ... {end} markers to write the table between.")
    head, rest = text.split(start, 1)
    return head + start + section + end + rest.split(end, 1)[1]
