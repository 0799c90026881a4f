"""Every decision of the decode engine that is measured or chosen, made once, in one place: `calibrate() -> Plan`.

A speculative cycle's best shape depends on the hardware: on a CPU a verify of 16 tokens costs about twice one of
a single token, on a GPU about the same, so how much of a block to verify, how big a token tree may grow and
whether the LM head is applied in the transposed layout (`target_forward.py`) are measured, not guessed. The Plan
holds the answers and the reasons; the engine only reads it. It is returned in `DecodeStats.plan` and written into
`hf-dscale bench` reports, and a caller may build one (or `dataclasses.replace` a calibrated one) and pass it in.

Method choice (what a call with no method options gets): greedy decoding verifies the drafter's *own tree* sized
for throughput with a prompt-lookup path. Sized by the measured verify costs, that tree is the plain chain whenever
no branch pays for its width, so it is never slower than the chain by construction of the cut, and on the SmolLM2
benchmarks it is the fastest of the methods on a CPU (`hf-dscale bench --peers`). Sampling verifies a chain:
speculative sampling's rejection rule accepts a sampled chain's drafts more often than a tree's "sample, then
match" accepts a fixed tree's, and a sampled draft is what the rule needs. A second (variable-prefix) drafter means
D²SD. Whether the verify runs compiled (`compiled.py`) is chosen by device (`compile_by_default`): on a GPU it is,
as transformers compiles its own static-cache decoding there; on a CPU, where compiling takes tens of seconds, a
caller asks for it.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..kernels import cpu_linear as cpu_linear_kernel
from ..models.dscale.assistant import (
    AUTO,
    CPU_DRAFT_CONFIDENCE,
    DraftCut,
    cut_minimum,
    min_drafts_from,
    resolve_draft_confidence,
)
from . import direct_forward as direct_forward_module
from . import structure, target_forward
from .compiled import static_verify_for

BRANCH_POLICIES = ("vp", "distinct", "ranked")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How the engine decodes with one target and drafter on one device at one batch size."""

    device: str  # "cpu", "cuda", ...
    batch_size: int  # rows per verify the costs were measured at
    tree: bool  # verify a token tree (the drafter's own runner-ups, or a VP drafter's branches) instead of a chain
    prompt_lookup: bool  # one more tree path: the tokens after the latest earlier match of the sequence's tail
    num_branches: int  # K: branches a tree may hold
    branch_policy: str  # D²SD: how the VP drafter's branches leave the spine (`BRANCH_POLICIES`)
    draft_confidence: float | str  # AUTO: sized for throughput over `verify_costs`; c in (0, 1): confidence cut; 0
    min_drafts: int | None  # a confidence cut keeps at least this many drafts (None: no confidence cut)
    transposed: tuple[int, ...] | None  # widths the verify applies the LM head transposed (None: the model's forward)
    cpu_linear_widths: tuple[int, ...] | None = None  # widths whose products run the CPU kernel (`kernels/cpu_linear`)
    direct_widths: tuple[int, ...] | None = None  # widths run by `DirectForward` (the weights without the modules)
    verify_costs: dict[int, float] | None = None  # seconds of a verify of w tokens (anchor included), w = 1..max
    calibrate_s: float = 0.0  # what measuring cost
    compile_widths: tuple[int, ...] | None = None  # the verify runs compiled at these widths (None: eager)
    compile_s: float = 0.0  # what compiling cost (apart from calibrate_s)
    one_read: bool = False  # draft the next block before the cycle's read: one read a cycle (else two, fresher drafts)
    single_path: bool = False  # a tree is one path a row: the drafter's chain or the prompt lookup's, the likelier
    reasons: tuple[str, ...] = field(default_factory=tuple)  # one line per decision

    @property
    def max_width(self) -> int | None:
        """The widest verify the costs cover (a tree's node count is bounded by it)."""
        return max(self.verify_costs) if self.verify_costs else None

    @property
    def verify_path(self) -> str:
        if self.compile_widths is not None:
            return "compiled"
        return "model" if self.transposed is None else "split-head"

    def cut(self) -> DraftCut:
        """The chain's cut (and a D²SD tree's depth) as `DraftCut` reads it."""
        if self.draft_confidence == AUTO:
            return DraftCut(costs=dict(self.verify_costs))
        return DraftCut(float(self.draft_confidence), self.min_drafts)

    def forward(self, target: nn.Module, tap_ids=()) -> target_forward.TargetForward:
        """The verify forward this plan chose for `target`, returning the layers `tap_ids` where it runs direct."""
        return target_forward.TargetForward(target, None if self.transposed is None else frozenset(self.transposed),
                                            frozenset(self.cpu_linear_widths or ()),
                                            frozenset(self.direct_widths or ()), tap_ids)

    def static_verify(self, target: nn.Module, drafter: nn.Module, tap_ids: list[int]):
        """The compiled verify this plan chose (`compiled.StaticVerify`), or None for an eager one."""
        if self.compile_widths is None:
            return None
        return static_verify_for(target, drafter, tap_ids, self.compile_widths)

    def method(self, vp: bool = False) -> str:
        """The method's name as `hf-dscale bench` reports it."""
        if vp:
            return "d2sd"
        if self.single_path:
            return "dscale-path+lookup" if self.prompt_lookup else "dscale"
        if self.tree:
            return "dscale-tree+lookup" if self.prompt_lookup else "dscale-tree"
        return "dscale"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verify_path"] = self.verify_path
        out["transposed"] = None if self.transposed is None else list(self.transposed)
        out["cpu_linear_widths"] = None if self.cpu_linear_widths is None else list(self.cpu_linear_widths)
        out["direct_widths"] = None if self.direct_widths is None else list(self.direct_widths)
        out["compile_widths"] = None if self.compile_widths is None else list(self.compile_widths)
        out["reasons"] = list(self.reasons)
        if self.verify_costs is not None:
            out["verify_costs"] = {str(w): round(s, 6) for w, s in self.verify_costs.items()}
        return out


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def calibrate(target: nn.Module, drafter: nn.Module, *, vp_drafter: nn.Module | None = None, batch_size: int = 1,
              do_sample: bool = False, tree: bool | None = None, prompt_lookup: bool | None = None,
              num_branches: int = 4, branch_policy: str = "ranked",
              draft_confidence: float | str | None = None, compile: bool | None = None,
              compile_widths: tuple[int, ...] | None = None, cpu_linear: bool | None = None,
              direct_forward: bool | None = None, one_read: bool | None = None) -> Plan:
    """Measure what the engine needs on `target`'s device and choose the method: a Plan.

    Options given here are kept as given (they are the caller's choice); the rest are chosen, each with a line in
    `Plan.reasons`. Measuring costs a few seconds on a small CPU (~6 s for SmolLM2-135M on 2 cores) and
    milliseconds for tiny models; `plan_for` keeps one per target, batch size and options on the drafter.

    `compile=True` verifies through a compiled forward (`compiled.StaticVerify`) at `compile_widths` (default: the
    widest verify alone, so one compile serves every tree), and the tree is sized by the compiled costs. Compiling
    takes tens of seconds per width on a CPU (`Plan.compile_s`, kept apart from decode time) and pays only over
    long or many generations. `compile=None` decides by device (`compile_by_default`): compiled on a GPU, falling
    back to an eager verify (logged, and in `Plan.reasons`) where compiling fails; eager on a CPU.

    An eager verify measures each width every way it can run and keeps the cheapest: through the target's modules
    or `DirectForward` (its weights without the modules, for Llama-family float32 targets it probes equal;
    `Plan.direct_widths`), with torch's matrix products or, on a CPU, the CPU kernel's (`kernels/cpu_linear.py`,
    built on first use; `Plan.cpu_linear_widths`). `cpu_linear=False` / `direct_forward=False` leave a way out,
    `True` fails where it cannot run.

    `one_read=True` drafts each cycle's next block before the cycle reads anything back, so a cycle waits for the
    device once (the accepted paths and the next draft in one transfer); that draft misses what only the read tells
    (the cycle's new tokens in the draft vocabulary, and the rows' tokens where logits processors shape a sampled
    draft). False drafts after the read: two reads a cycle. None: one read on a GPU, where each read stalls the
    device; two on a CPU, where a read costs nothing and the fresher drafts are accepted more often.
    """
    if branch_policy not in BRANCH_POLICIES:
        raise ValueError(f"branch_policy must be one of {BRANCH_POLICIES}, got {branch_policy!r}.")
    if num_branches < 1:
        raise ValueError(f"num_branches must be at least 1, got {num_branches}.")
    start = time.perf_counter()
    device = _device(target)
    reasons = []
    reference = reference_forced()
    if reference:
        if cpu_linear or direct_forward:
            raise ValueError(f"{REFERENCE}=1 runs every verify through transformers' own forward with torch's "
                             "products; cpu_linear=True and direct_forward=True ask otherwise. Unset "
                             f"{REFERENCE} or those options.")
        cpu_linear, direct_forward = False, False
        reasons.append(f"{REFERENCE}=1: transformers' own forward, torch's products, the LM head as the target "
                       "applies it")
    found = structure.of(target)
    stateful = found.stateful
    by_paths = bool(stateful) or found.own_masks  # a tree's paths verified one row each (`Engine.verify_paths`)
    single_path = False
    if by_paths:
        why = (f"layers {list(stateful)} keep a conv window or recurrent state, rolled back per row to the accepted "
               "token" if stateful else "its attention is its own, outside transformers' interface, and takes 2D "
               "masks only")
        if compile or direct_forward:
            raise ValueError(
                f"{type(target).__name__}: {why}; hf_dscale verifies it with the target's own eager forward, as plain "
                "decoding runs it, not a compiled or direct one (compile=True, direct_forward=True). Leave those "
                "options unset.")
        single_path = vp_drafter is None and tree is None and (not do_sample or bool(prompt_lookup))
        if single_path:
            tree = True
            prompt_lookup = True if prompt_lookup is None else prompt_lookup
        compile, direct_forward = False, False
        reasons.append(f"eager: {why}; a token tree verifies each of its paths as a row of its own"
                       + ("; by default each row verifies one path, the drafter's chain or the prompt lookup's, "
                          "whichever is likelier (a tree's paths would each cost a row)" if single_path else ""))
    if vp_drafter is not None:
        tree, lookup_default = True, False
        reasons.append("tree: a VP drafter was given (D²SD)")
    elif tree is None and prompt_lookup:
        tree, lookup_default = True, True
        reasons.append("tree: a prompt lookup adds a path to a token tree")
    elif tree is None:
        tree, lookup_default = not do_sample, not do_sample
        reasons.append("tree: the own tree sized by verify costs (a chain where no branch pays)" if tree else
                       "chain: sampling, whose rejection rule accepts a sampled chain best")
    else:
        lookup_default = False  # a method given is kept as given
        if not by_paths:
            reasons.append(f"{'tree' if tree else 'chain'}: given")
    if prompt_lookup is None:
        prompt_lookup = lookup_default and tree
    elif prompt_lookup and not tree:
        raise ValueError("prompt_lookup adds a path to a token tree: drop draft_tree=False (or pass a vp_drafter).")

    confidence = resolve_draft_confidence(draft_confidence, device)
    if draft_confidence is None and tree and vp_drafter is None:
        confidence = AUTO  # the own tree is sized for throughput on every device
    if confidence == AUTO and vp_drafter is not None:
        confidence = CPU_DRAFT_CONFIDENCE  # a D²SD tree's width is not a chain's; its depth is cut by confidence
        reasons.append(f"draft_confidence {CPU_DRAFT_CONFIDENCE}: D²SD trees cut at that cumulative confidence")

    block = drafter.config.block_size
    max_width = block if device.type == "cpu" or not tree else 2 * block
    by_default = compile is None
    if by_default:
        compile, why = compile_by_default(device)
        reasons.append(why)
    compiled = _compiled_costs(target, drafter, vp_drafter, compile_widths or (max_width,), batch_size,
                               by_default, reasons) if compile else None
    transposed, kernel_widths, direct_widths, compile_widths, compile_s = None, None, None, None, 0.0
    if compiled is not None:  # a compiled verify fuses its head in the graph: no split head
        compile_widths, costs, compile_s = compiled
        max_width = compile_widths[-1]
        if confidence == AUTO:
            cut = DraftCut(costs=costs)
        else:  # a confidence cut's minimum from the compiled costs, not from eager verifies
            cut = DraftCut(confidence, min_drafts_from(costs) if confidence > 0 else None)
    else:
        if not reference and target_forward.splittable(target):
            faster = target_forward.faster_transposed(target.get_output_embeddings(), range(1, max_width + 1),
                                                       batch_size)
            transposed = tuple(sorted(faster)) or None
        reasons.append(f"LM head applied transposed at widths {list(transposed)}" if transposed else
                       "verify with the target's own forward")
        split = None if transposed is None else frozenset(transposed)
        ways = _eager_ways(target, cpu_linear, direct_forward, reasons)
        if ways != (target_forward.Way(False, False),):  # something to measure: which way, per width
            kernel_widths, direct_widths, costs = _eager_costs(target, split, ways, max_width, batch_size, reasons)
            if confidence == AUTO:
                cut = DraftCut(costs=costs)
            else:  # a confidence cut's minimum, measured as for the target's own forward, through the one chosen here
                forward = target_forward.TargetForward(target, split, frozenset(kernel_widths or ()),
                                                       frozenset(direct_widths or ()))
                try:
                    cut = DraftCut(confidence, cut_minimum(target, confidence, forward))
                finally:
                    forward.close()
        else:
            forward = target_forward.TargetForward(target, split)
            cut = DraftCut.for_target(target, confidence, max_width, batch_size, forward)  # measures what it needs
    if cut.costs is not None:
        reasons.append(f"draft_confidence auto: verify widths chosen each cycle from the costs of 1..{max_width} "
                       f"tokens at batch {batch_size}")
    elif cut.minimum is not None:
        reasons.append(f"draft_confidence {confidence}: at least {cut.minimum} drafts (the widest cheap verify)")
    if one_read is None:
        one_read = device.type == "cuda"
        reasons.append("one read a cycle: the next block is drafted before the cycle's read (a GPU, where a read "
                       "stalls it)" if one_read else "two reads a cycle: the next block is drafted after the cycle's "
                       "tokens are read, with them in its vocabulary (a CPU, where a read costs nothing)")
    return Plan(device=device.type, batch_size=batch_size, tree=tree, prompt_lookup=bool(prompt_lookup),
                num_branches=num_branches, branch_policy=branch_policy, draft_confidence=confidence,
                min_drafts=cut.minimum, transposed=transposed, cpu_linear_widths=kernel_widths,
                direct_widths=direct_widths, verify_costs=cut.costs,
                calibrate_s=time.perf_counter() - start - compile_s, compile_widths=compile_widths,
                compile_s=compile_s, one_read=bool(one_read), single_path=single_path, reasons=tuple(reasons))


REFERENCE = "HF_DSCALE_REFERENCE"  # =1: every verify through transformers' own forward with torch's products


def reference_forced() -> bool:
    """Whether `$HF_DSCALE_REFERENCE` is 1: the plan then leaves out every fast path of its own (the CPU kernel, the
    direct forward, the split head), so a run can be checked against transformers' own arithmetic."""
    return os.environ.get(REFERENCE, "") == "1"


def _cpu_linear_unavailable(target: nn.Module, wanted: bool | None) -> str | None:
    """Why a verify of `target` cannot use the CPU kernel (None: it can); raises if `wanted` is True and it cannot."""
    weight = next(target.parameters())
    if wanted is False:
        why = "cpu_linear=False"
    elif weight.device.type != "cpu" or weight.dtype != torch.float32:
        why = f"the CPU kernel takes float32 weights on the CPU, the target's are {weight.dtype} on {weight.device}"
    else:
        why = cpu_linear_kernel.unavailable()
    if wanted and why is not None:
        raise RuntimeError(f"cpu_linear=True, but the CPU kernel cannot run: {why}. Pass cpu_linear=None (measure) "
                           "or False.")
    return why


def _direct_unavailable(target: nn.Module, wanted: bool | None, kernel: bool) -> str | None:
    """Why a verify of `target` cannot run `DirectForward` (None: it can), probed with the CPU kernel's products where
    `kernel` (the way the plan would run it); raises if `wanted` is True and it cannot."""
    why = "direct_forward=False" if wanted is False else direct_forward_module.unavailable(target, kernel=kernel)
    if wanted and why is not None:
        raise RuntimeError(f"direct_forward=True, but the direct forward cannot run {type(target).__name__}: {why}. "
                           "Pass direct_forward=None (measure) or False.")
    return why


def _eager_ways(target: nn.Module, cpu_linear: bool | None, direct_forward: bool | None,
                reasons: list[str]) -> tuple[target_forward.Way, ...]:
    """The ways an eager verify of `target` can run, torch's products first. Where the direct forward runs, the
    target's own forward is left out: it runs the same ops (the probe found the same logits) with transformers'
    module machinery around them (`dscale-auto-model-forward` in `hf-dscale bench --peers` measures it)."""
    Way = target_forward.Way
    no_kernel = _cpu_linear_unavailable(target, cpu_linear)
    no_direct = _direct_unavailable(target, direct_forward, kernel=no_kernel is None)
    if no_kernel is not None:
        reasons.append(f"verify products by torch: {no_kernel}")
    if no_direct is not None:
        reasons.append(f"verify through the target's modules: {no_direct}")
    direct = no_direct is None
    return (Way(direct, False),) + ((Way(direct, True),) if no_kernel is None else ())


def width_span(widths) -> str:
    """Verify widths in words: "4-16", or "1, 3, 8" where they are not one run."""
    widths = list(widths)
    return f"{widths[0]}-{widths[-1]}" if widths == list(range(widths[0], widths[-1] + 1)) else \
        ", ".join(map(str, widths))


def _eager_costs(target: nn.Module, transposed: frozenset[int] | None, ways, max_width: int, batch_size: int,
                 reasons: list[str]) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, dict[int, float]]:
    """Each verify width measured every way: (the widths whose cheapest way uses the CPU kernel, or None; those it
    runs direct, or None; the cheapest cost of each width). Ties keep the earlier way."""
    widths = range(1, max_width + 1)
    costs = target_forward.verify_costs_ways(target, transposed, ways, widths, batch_size)
    best = {w: min(ways, key=lambda way: costs[way][w]) for w in widths}
    kernel = tuple(w for w in widths if best[w].kernel)
    direct = tuple(w for w in widths if best[w].direct)
    top, first = max_width, ways[0]
    for chosen, what in ((direct, "direct forward (the target's weights without its modules)"),
                         (kernel, f"CPU kernel ({cpu_linear_kernel.isa()}) for the verify's products")):
        if chosen:
            reasons.append(f"{what} at widths {width_span(chosen)}")
    if len(ways) > 1:
        reasons.append(f"a verify of {top} tokens: {1e3 * costs[best[top]][top]:.1f} ms by {best[top]}, against "
                       f"{1e3 * costs[first][top]:.1f} ms by {first}")
    return kernel or None, direct or None, {w: costs[best[w]][w] for w in widths}


def compile_by_default(device: torch.device) -> tuple[bool, str]:
    """Whether a call that does not say compiles its verify, and why: on a GPU, where an eager forward of a small
    target is bound by kernel launches and transformers' own static-cache `generate()` compiles by default too; not
    on a CPU, where compiling costs tens of seconds (about 40 s for SmolLM2-135M on 2 cores) and a compiled verify
    saves about a quarter of each cycle, so it pays back only after thousands of tokens."""
    if device.type == "cuda":
        return True, "compiled verify: the default on a GPU (compile=False for eager)"
    return False, (f"eager verify: the default on a {device.type.upper()}, where compiling costs tens of seconds and "
                   "pays back over thousands of tokens (compile=True to pay it)")


def _compiled_costs(target: nn.Module, drafter: nn.Module, vp_drafter: nn.Module | None, widths: tuple[int, ...],
                    batch_size: int, fall_back: bool, reasons: list[str]):
    """Compile the verify at `widths` and measure it: (widths, costs of 1..widest tokens, seconds compiling). A
    compile that fails raises, or, when compiling was the default (`fall_back`), is logged and gives None: eager."""
    widths = tuple(sorted(set(widths)))
    try:
        static = static_verify_for(target, drafter, tap_ids(drafter, vp_drafter), widths)
        before = static.compile_s
        measured = static.measure(batch_size)
    except Exception as error:  # inductor needs a C++ compiler on a CPU, Triton on a GPU; some taps cannot compile
        failure = f"{type(error).__name__}: {error}"
        if not fall_back:
            raise RuntimeError(f"Compiling the verify forward failed ({failure}); decode without compile=True (eager "
                               "verifies are exact too).") from error
        logger.warning("hf_dscale: compiling the verify forward failed (%s); decoding with an eager verify, which is "
                       "exact too. Pass compile=False to skip the attempt.", failure)
        reasons.append(f"eager verify: compiling failed ({failure.splitlines()[0][:200]})")
        return None
    compile_s = static.compile_s - before
    reasons.append(f"compiled verify at widths {list(widths)} ({compile_s:.1f} s to compile)")
    return widths, {w: measured[static.width(w)] for w in range(1, widths[-1] + 1)}, compile_s


def tap_ids(drafter: nn.Module, vp_drafter: nn.Module | None = None) -> list[int]:
    """The target layers the drafters read, in order."""
    return sorted(set(drafter.config.target_layer_ids)
                  | set(() if vp_drafter is None else vp_drafter.config.target_layer_ids))


def plan_for(target: nn.Module, drafter: nn.Module, **options) -> Plan:
    """`calibrate(target, drafter, **options)`, measured once per target, device, dtype and options and kept on the
    drafter (its `_plans`, held weakly by target), so that repeated `generate()` calls do not measure again, while a
    target moved to another device or dtype is measured anew."""
    plans = drafter.__dict__.setdefault("_plans", weakref.WeakKeyDictionary())
    known = plans.setdefault(target, {})
    weight = next(target.parameters())
    key = (str(weight.device), weight.dtype, reference_forced(),
           *sorted((name, id(value) if isinstance(value, nn.Module) else value) for name, value in options.items()))
    if key not in known:
        known[key] = calibrate(target, drafter, **options)
    return known[key]
