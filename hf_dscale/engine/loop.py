"""The decode engine: one loop for every speculative method, batch size >= 1.

    prefill, draft -> while a row runs: trees -> verify -> accept -> advance -> draft -> read -> commit
                                        (without `Plan.one_read`: ... -> advance -> read -> commit -> draft)

* **draft**: the block drafter proposes a block per row in one pass (`proposers.Draft`).
* **trees**: each row's candidate paths (the chain, the drafter's own runner-ups, a VP drafter's branches, the
  prompt lookup), as a `TokenTree`; a chain is a one-path tree. How wide, and which method, the `Plan` says.
* **verify**: one target forward over every row's nodes, padded to the widest tree, with each node at position
  anchor + depth and an ancestor-only mask (a batch of equal chains takes a plain padding mask).
* **accept**: the target walks each tree, on the device (`accept.py`).
* **advance**: each row's accepted path keeps its K/V, packed by index after the cache's columns, its taps go to
  the drafters and its last token becomes the next anchor, still on the device; then the next block is drafted.
* **read** and **commit**: one transfer brings back every row's path and the next draft; the rows take their tokens
  (stopping where a criterion fires), and the cache keeps as many columns as the longest path; the rest is cropped,
  which only shortens the view of buffers allocated ahead for the whole generation (`compat.position_cache`: the
  next verify writes over the rejected entries). Rows advance at different speeds,
  so the cache is a rectangle of *columns* with holes: a row whose path is shorter than the longest leaves masked
  columns. Position ids count only a row's valid tokens, so every row sees exactly the sequence plain `generate()`
  would feed it, and the drafters' context caches mirror the same columns. Targets with sliding-window layers get
  their masks by position (`engine/masks.py`). A row that stops leaves the batch (`Engine.compact`): the
  stages' slot b is row `batch.index[b]`, so later cycles verify and draft only the rows still decoding.
* **compiled** (`Plan.compile_widths`, `compiled.py`): the verify runs one compiled forward at a fixed width over a
  cache of fixed shape (`compat.column_cache`): each tree is padded to that width with nodes that see themselves
  only, the mask spans the cache's whole capacity, and the taps come back from the forward itself.

Logits processors and stopping criteria see each row as plain `generate()` lays it out, one position at a time.
With `Plan.one_read` (a GPU's default) the host waits for the device once a cycle (`Engine.read`): every row's
accepted path and the next draft, for every row and path, come back in one transfer; D²SD reads its VP pass once
more. That draft is made before the read, so it sees the rows as they were before the cycle's tokens where a
processor shapes it (a sampled chain under logits processors: its q is still the distribution its drafts were drawn
from, so sampling stays lossless) and its draft vocabulary gains the cycle's tokens a cycle later. Without it (a
CPU's default, where a read costs nothing) the draft follows the read and is read on its own: twice a cycle.
Length and EOS stops are answered on the host (`state.host_stop`); other stopping criteria are read once per row
(`Rows.commit`). The anchors and the draft vocabularies' members are kept on the host.
"""

from __future__ import annotations

import time

import torch

from ..kernels.tree_attention import triton_usable
from ..models.dscale import compat
from ..models.dscale.assistant import AUTO, TapRecorder, choose_tokens
from ..models.dscale.modeling_dscale import DraftContextCache
from . import proposers, structure
from .accept import accept
from .attention import register as register_tree_attention
from .lookup import PromptLookup
from .masks import TargetAttention, column_positions
from .plan import Plan, plan_for, tap_ids
from .state import Batch, Outcome, PathRows, Rows, Verify, Walk, lay_out
from .tree import TokenTree
from .types import DecodeStats


class Engine:
    """The loop's fixed parts (models, plan, caches, processors) and its moving state (columns, anchors)."""

    def __init__(self, target, drafter, plan: Plan, rows: Rows, *, vp_drafter=None, processors=None, criteria=None,
                 do_sample: bool = False, streamer=None, capacity: int = 0):
        self.target, self.drafter, self.vp_drafter, self.plan = target, drafter, vp_drafter, plan
        self.batch = Batch.of(rows)  # the rows still in the batch: every method's slot b is row batch.index[b]
        self.processors, self.criteria, self.do_sample, self.streamer = processors, criteria, do_sample, streamer
        layer_ids = tap_ids(drafter, vp_drafter)
        self.forward, self.cut = plan.forward(target, layer_ids), plan.cut()
        self.stateful = bool(structure.of(target).stateful)  # layers with a conv window or recurrent state
        self.own_masks = structure.of(target).own_masks  # attention of its own, which takes 2D masks only
        self.attention = TargetAttention.of(target)  # what a decoded token sees
        self.prefill_attention = TargetAttention.of(target, prefill=True)  # what the prompt sees
        # A compiled verify (the plan's choice) needs fixed shapes: a cache of `capacity` columns, taps returned
        self.static = plan.static_verify(target, drafter, layer_ids) if capacity else None
        if self.static is not None:
            self.cache = compat.column_cache(capacity + self.static.widths[-1])
            self.recorder = self._taps = None
            self.compiled_s = self.static.compile_s
        elif self.stateful:  # attention layers as below; transformers' own layers for the conv and recurrent states
            self.cache = compat.hybrid_cache(target.config, capacity)
            self.recorder = TapRecorder(target, layer_ids)
        else:  # every position in every layer (the masks apply any window), written in place in buffers allocated ahead
            self.cache = compat.position_cache(capacity)
            self.recorder = TapRecorder(target, layer_ids)
        self.tap_index = [layer_ids.index(i) for i in drafter.config.target_layer_ids]
        self.dcache = DraftContextCache(drafter.config.num_hidden_layers, capacity)
        if vp_drafter is not None:
            self.vp_tap_index = [layer_ids.index(i) for i in vp_drafter.config.target_layer_ids]
            self.vp_cache = DraftContextCache(vp_drafter.config.num_hidden_layers, capacity)
        self.stats = DecodeStats(plan=plan)
        self.overhead_s = 0.0  # drafting and bookkeeping of the cycles so far: what the throughput cut adds to a verify
        # Moving state, set by prefill: valid [B, C] over cache columns; each row's anchor (last committed token, not
        # yet run through the target) and its position [B]; the taps [B, S, T, H] the drafters have not ingested yet
        # and their positions [B, S]; the draft vocabularies (`DraftVocab`) and each row's prompt lookup.
        self.valid = self.anchors = self.anchor_pos = self.taps = self.ctx_pos = None
        self.anchor_ids: list[int] = []  # the anchors on the host, kept with the tensor so no stage reads it back
        self.holes = False  # whether some column is masked (padding or a rejected node): drafters then take `valid`
        self.pending: proposers.Draft | None = None  # the next cycle's draft, made before the cycle's read
        self.advanced = (0, 0)  # the columns the last `advance` kept before the read: (first, how many)
        self.nodes = None  # [B, D] the last cycle's accepted nodes by depth, which `commit` packs in the cache
        self.unread = False  # between `advance` and `commit`: columns past every row's path may be held (masked)
        self.paths: PathRows | None = None  # the last verify's rows when it ran one per tree path
        self._path_taps = None  # that verify's taps per tree node
        self.vocab = self.vp_vocab = None
        self.lookups: list[PromptLookup | None] = [None] * rows.prompt.shape[0]
        self.proposals: list[tuple[list[int], int]] = [([], 0)] * rows.prompt.shape[0]

    @property
    def active(self) -> list[bool]:
        return [not f for f in self.batch.finished]

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """The prompt through the target; the first token; the drafters' context = the prompt's taps."""
        t0 = time.perf_counter()
        positions = column_positions(valid)
        causal = torch.ones(valid.shape[1], valid.shape[1], dtype=torch.bool, device=valid.device).tril()
        if self.static is not None:
            mask = self.static_mask(valid[:, None, :] & causal, positions, 0, prefill=True)
            out, self._taps = self.static.prefill(input_ids, positions, mask, self.cache)
            logits = out[:, -1].float()  # [B, V]
        else:
            mask = valid.long()
            if self.prefill_attention.sliding:
                mask = self.prefill_attention.masks(valid[:, None, :] & causal, positions, positions,
                                                    self.target.dtype)
            out = self.target(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                              use_cache=True, logits_to_keep=1, **compat.cache_kwargs(self.target, self.cache))
            logits = out.logits[:, -1].float()  # [B, V]
            if self.stateful:  # from here on each forward keeps every token's state, for `keep_states`
                compat.record_states(self.cache, 2 * self.drafter.config.block_size)
        if self.processors:
            logits = torch.cat([self.batch.processors_for(self.processors, b)(self.batch.sequence(b), logits[b : b + 1])
                                for b in range(logits.shape[0])])
        first = torch.multinomial(logits.softmax(-1), 1)[:, 0] if self.do_sample else logits.argmax(-1)
        self.anchor_ids = first.tolist()
        for b, token in enumerate(self.anchor_ids):
            self.batch.commit(b, [token], logits[b : b + 1], self.criteria)
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
            self.streamer.put(first.cpu())
        context = torch.cat((input_ids, first[:, None]), dim=1)
        self.vocab = self.drafter.draft_vocab_for(context)
        if self.vp_drafter is not None:
            self.vp_vocab = self.vp_drafter.draft_vocab_for(context)
        if self.plan.prompt_lookup:
            self.lookups = [PromptLookup(input_ids[b][valid[b]].tolist() + self.batch.rows.generated[b])
                            for b in range(input_ids.shape[0])]
        self.valid, self.anchors, self.anchor_pos = valid, first, valid.sum(-1)
        self.taps, self.ctx_pos = self.latest_taps(), positions
        self.holes = not bool(valid.all())
        self.stats.other_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.pending = self.draft()
        self.pending.read_with(self.options_read())  # what the first trees read, read here: a cycle reads once
        self.stats.draft_s += time.perf_counter() - t0

    def cycle(self) -> None:
        """Trees from the draft read last cycle, verify every row in one target forward, accept and keep the
        accepted paths on the device, draft the next block, then the cycle's one read (every row's path and the new
        draft together) and the commit on the host."""
        t0 = time.perf_counter()
        draft, self.pending = self.pending, None
        trees = self.trees(draft)
        t1 = time.perf_counter()
        verify = Verify.of(trees, self.anchor_pos)
        logits = self.verify(verify)
        t2 = time.perf_counter()
        if self.static is not None:  # a shape met for the first time compiles: not decode time
            compiled, self.compiled_s = self.static.compile_s - self.compiled_s, self.static.compile_s
            self.stats.compile_s += compiled
            t1 += compiled
        active = self.active
        sampled = self.do_sample and draft.q_logits is not None  # a sampled chain: speculative sampling's rule
        q = draft.q_logits[:, : logits.shape[1] - 1] if sampled else None
        outcome = accept(verify, logits, self.batch, self.processors, self.do_sample, q, active)
        self.advance(outcome, active)
        if self.plan.one_read:  # draft first: the paths and the draft come back in one read
            t3 = time.perf_counter()
            self.pending = self.draft()
            t4 = time.perf_counter()
            self.commit(verify, self.read(outcome, active))
        else:  # read first: the draft knows the cycle's tokens (the next trees read it: a second read)
            self.commit(verify, self.read(outcome, active))
            t3 = time.perf_counter()
            if not all(self.batch.finished):
                self.pending = self.draft()
            t4 = time.perf_counter()
        if self.static is None and 0 < sum(self.active) < len(active):  # a compiled verify keeps its batch's shape
            self.compact()
        t5 = time.perf_counter()
        self.stats.draft_s += (t1 - t0) + (t4 - t3)
        self.stats.verify_s += t2 - t1
        self.stats.other_s += (t5 - t2) - (t4 - t3)
        self.overhead_s += (t5 - t0) - (t2 - t1)

    # ----------------------------------------------------------------------------------------------- stages
    def draft(self) -> proposers.Draft:
        """The block drafter's block for every row. A tree's spine is greedy (its logits over the draft vocabulary's
        columns suffice); a sampled chain draws its drafts under the processors and keeps that q."""
        sampled_chain = not self.plan.tree and (self.do_sample or bool(self.processors))
        logits = self.drafter.draft_logits(self.anchors[:, None], self.taps[:, :, self.tap_index], self.anchor_pos,
                                           self.ctx_pos, self.dcache, self.valid if self.holes or self.unread else None,
                                           self.vocab,
                                           compact=not sampled_chain)
        if sampled_chain:
            picked = [choose_tokens(logits[b : b + 1], self.batch.sequence(b),
                                    self.batch.processors_for(self.processors, b), self.do_sample)
                      for b in range(logits.shape[0])]
            spine, q = torch.cat([t for t, _ in picked]), torch.cat([s for _, s in picked])
            return proposers.Draft(spine, q.softmax(-1).amax(-1), q, None, q)
        logits = logits.float()
        confidences, spine = logits.softmax(-1).max(-1)
        columns = None if self.vocab is None else self.vocab.ids
        return proposers.Draft(spine if columns is None else columns[spine], confidences, logits, columns)

    def trees(self, draft: proposers.Draft) -> list[TokenTree]:
        """Each row's candidate paths as a token tree (a finished row: its anchor alone)."""
        active, anchors = self.active, self.anchor_ids
        overhead = self.overhead_s / self.stats.cycles if self.stats.cycles else 0.0
        plan, k = self.plan, self.plan.num_branches
        if not plan.tree:  # one length for every row, so the batch verifies as plain chains
            width = draft.spine.shape[1]
            rows = draft.on_host(width)  # the one read: every row's spine and chances, which the cut reads too
            n = self.cut.length_of([row[2] for row, on in zip(rows, active) if on], width, overhead)
            return [TokenTree.from_candidates(a, [rows[b][0][:n]]) for b, a in enumerate(anchors)]
        sized = plan.draft_confidence == AUTO and self.vp_drafter is None
        depth = draft.spine.shape[1]
        if not sized:  # a confidence cut, from the chances of the draft's one read (the paths read it too)
            read = draft.on_host(depth, 0 if self.vp_drafter is not None else k)
            depth = self.cut.length_of([row[2] for row, on in zip(read, active) if on], depth)
        vp = self.vp_branches(draft, depth) if self.vp_drafter is not None else None
        trees = []
        for b, anchor in enumerate(anchors):
            if not active[b]:
                trees.append(TokenTree([anchor], [-1], [0], [{}]))
                continue
            extra, self.proposals[b] = proposers.lookup_paths(self.lookups[b], depth)
            if plan.single_path:  # the likelier of the drafter's chain and the lookup's, cut along it
                paths = [proposers.likeliest(proposers.chain_paths(draft, b, depth) + extra)]
            elif vp is None:
                paths = proposers.own_tree_paths(draft, b, depth, k) + extra
            else:
                spine, confidences, _, _ = read[b]
                paths = proposers.vp_paths(spine, confidences, depth, vp[0][b], vp[1][b], k, plan.branch_policy)
                paths += extra
            chosen = proposers.select_nodes(paths, plan.verify_costs if sized else None, overhead)
            trees.append(TokenTree.from_candidates(anchor, chosen))
        return trees

    def vp_branches(self, draft: proposers.Draft, depth: int):
        """D²SD: the VP drafter re-drafts every row from its `m` likeliest rejection boundaries in one batched pass.
        Returns (prefixes per row, each row's `vp_options` on the host: the VP stage's one read)."""
        b, k = draft.spine.shape
        read = draft.on_host(k)  # the boundaries come from the confidences of the draft's one read
        prefixes = [proposers.top_prefixes(read[i][1][:depth], self.plan.num_branches) for i in range(b)]
        m, gamma = len(prefixes[0]), self.drafter.config.block_size
        kept = torch.arange(1, gamma, device=draft.spine.device) <= torch.tensor(prefixes, device=draft.spine.device
                                                                                  )[..., None]  # [B, m, γ-1]
        rows = torch.cat((self.anchors[:, None, None].expand(b, m, 1),
                          torch.where(kept, draft.spine[:, None, : gamma - 1], self.vp_drafter.config.mask_token_id)),
                         dim=2)  # [anchor, t_1..t_i, mask, ...]
        columns = None if self.vp_vocab is None else self.vp_vocab.ids
        vp_logits = self.vp_drafter.block_logits(rows.view(b * m, gamma), self.anchor_pos.repeat_interleave(m),
                                                 self.taps[:, :, self.vp_tap_index], self.ctx_pos, self.vp_cache,
                                                 self.valid if self.holes else None, self.vp_vocab,
                                                 compact=columns is not None)
        options = proposers.vp_options(vp_logits.view(b, m, *vp_logits.shape[1:]), prefixes, draft.spine,
                                       self.plan.num_branches, columns)
        return prefixes, proposers.options_on_host(options)

    def latest_taps(self) -> torch.Tensor:
        """The tapped layers' outputs [B, N, T, H] for the N positions of the latest target forward."""
        if self.static is not None:
            return self._taps
        if self.paths is not None:
            return self._path_taps
        return self.forward_taps()

    def forward_taps(self) -> torch.Tensor:
        """The tapped layers' outputs of the latest eager forward, as it ran: from the forward itself (a direct
        forward returns them) or from the recorder's hooks."""
        return self.forward.taps if self.forward.taps is not None else self.recorder.taps()

    def static_mask(self, allowed: torch.Tensor, positions: torch.Tensor, start: int, prefill: bool = False):
        """A compiled forward's mask: queries at `positions` [B, Q], written at columns start..start+Q, that see the
        valid cache columns before `start` and the new ones `allowed` [B, Q, Q] lets them; every other column of the
        cache's capacity is hidden. Sets the columns the forward writes."""
        b, q = positions.shape
        capacity = self.cache.columns.capacity
        if start + q > capacity:  # rows that advanced unevenly left holes: more room (the capacity is dynamic)
            capacity = 2 * (start + q)
            compat.grow_columns(self.cache, capacity)
        seen = allowed.new_zeros(b, q, capacity)
        seen[:, :, start : start + q] = allowed
        key_pos = positions.new_zeros(b, capacity)
        key_pos[:, start : start + q] = positions
        if start:
            seen[:, :, :start] = self.valid[:, None, :]
            key_pos[:, :start] = column_positions(self.valid)
        self.cache.columns.write = torch.arange(start, start + q, device=positions.device)
        self.cache.columns.length = start + q
        attention = self.prefill_attention if prefill else self.attention
        return attention.masks(seen, positions, key_pos, self.target.dtype)

    def verify(self, verify: Verify) -> torch.Tensor:
        """The target's logits [B, N, V] after every node of every row's tree."""
        n = verify.ids.shape[1]
        self.paths = None
        if self.stateful and any(max(tree.depths) != len(tree) - 1 for tree in verify.trees) or \
                self.own_masks and verify.allowed is not None:
            return self.verify_paths(verify)
        if self.static is not None:  # padded to the compiled width with nodes that see themselves only
            ids, positions, allowed = verify.padded(self.static.width(n))
            mask = self.static_mask(allowed, positions, self.valid.shape[1])
            logits, taps = self.static(ids, positions, mask, self.cache)
            self._taps = taps[:, :n]
            return logits[:, :n]
        mask = self.mask_after(self.valid, verify.positions, verify.allowed)
        return self.forward(self.cache, input_ids=verify.ids, attention_mask=mask, position_ids=verify.positions,
                            use_cache=True)

    def mask_after(self, valid: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None):
        """The target's mask for new tokens at `positions` [B, Q] after the cache's valid columns (valid [B, C]):
        `allowed` [B, Q, Q] among the new ones (tree ancestry), or None for chains, which need only a 2D padding
        mask unless some layer attends through a window."""
        b, q = positions.shape
        if allowed is None and not self.attention.sliding:
            return torch.cat((valid, valid.new_ones(b, q)), dim=1).long()
        if allowed is None:
            allowed = torch.ones(q, q, dtype=torch.bool, device=valid.device).tril().expand(b, q, q)
        return self.attention.after_cache(valid, positions, allowed, self.target.dtype)

    def verify_paths(self, verify: Verify) -> torch.Tensor:
        """A tree verify on a target with conv or recurrent states, or with attention of its own (which takes a 2D
        mask, no tree mask): every path of every tree as a chain of its own (`PathRows`), each from a copy of its
        row's cache, so each layer steps a path's tokens in order as plain decoding would. The logits and taps come
        back per tree node; `advance` keeps the accepted path's row."""
        paths = self.paths = PathRows.of(verify)
        compat.select_rows(self.cache, paths.source)  # a copy of its row's K/V and states per path
        mask = self.mask_after(self.valid[paths.source], paths.positions, None)  # every path row is a chain
        logits = self.forward(self.cache, input_ids=paths.ids, attention_mask=mask, position_ids=paths.positions,
                              use_cache=True)
        self._path_taps = paths.nodes(self.forward_taps())
        return paths.nodes(logits)

    def advance(self, outcome: Outcome, active: list[bool]) -> None:
        """What the next draft needs of each row's accepted path, on the device: its taps, its columns as valid, its
        last token as the next anchor. Until the read says how long the longest path is (`commit`), every row keeps
        as many columns as the deepest tree has nodes on a path, masked past its own path; the target's cache keeps
        the paths' K/V at the commit (the next verify is the first to read it)."""
        start, device = self.valid.shape[1], self.valid.device
        on = torch.tensor(active, device=device)
        length = torch.where(on, outcome.length, 0)  # a finished row keeps nothing
        width = outcome.nodes.shape[1]
        self.valid = torch.cat((self.valid, torch.arange(width, device=device) < length[:, None]), dim=1)
        taps = self.latest_taps()  # [B, N, T, H]
        self.taps = taps.gather(1, outcome.nodes[:, :, None, None].expand(-1, -1, *taps.shape[2:]))
        self.ctx_pos = self.anchor_pos[:, None] + torch.arange(width, device=device)
        last = outcome.tokens.gather(1, (length - 1).clamp_min(0)[:, None])[:, 0]
        self.anchors = torch.where(on, last, self.anchors)
        self.anchor_pos = self.anchor_pos + length
        if self.stateful:  # each row's conv windows and recurrent states as after its own accepted tokens
            kept = length if self.paths is None else length[self.paths.source]
            self.stats.state_bytes = max(self.stats.state_bytes, compat.keep_states(self.cache, kept))
        if self.paths is not None:  # each row keeps the path row its accepted path ends on (K/V in path order)
            ends = outcome.nodes.gather(1, (length - 1).clamp_min(0)[:, None])[:, 0]
            compat.select_rows(self.cache, self.paths.rows_of(ends))
        self.advanced, self.unread, self.nodes = (start, width), True, outcome.nodes

    def options_read(self) -> int:
        """The own options per draft position the trees read (`Draft.on_host`'s k): the own tree's branches."""
        return self.plan.num_branches if self.plan.tree and not self.plan.single_path and self.vp_drafter is None \
            else 0

    def read(self, outcome: Outcome, active: list[bool]) -> list[Walk | None]:
        """Every row's accepted path (a `Walk` per active row), and, when the next draft is already made
        (`Plan.one_read`), that draft as the trees will read it (`Draft.on_host`): one host synchronisation."""
        width = outcome.nodes.shape[1]
        paths = torch.cat((outcome.length[:, None], outcome.tokens, outcome.nodes), 1)  # [B, 1 + 2D]
        drafted = self.pending is not None
        rows = self.pending.read_with(self.options_read(), paths) if drafted else paths.tolist()
        walks = []
        for b, row in enumerate(rows):
            if not active[b]:
                walks.append(None)
                continue
            n = int(row[0])
            path = [int(node) for node in row[1 + width : 1 + width + n]]
            walks.append(Walk([int(token) for token in row[1 : 1 + n]], path, outcome.logits[b, path]))
        return walks

    def commit(self, verify: Verify, walks: list[Walk | None]) -> None:
        """Append each row's tokens (until a stopping criterion fires); keep as many columns as the longest path."""
        anchors = list(self.anchor_ids)
        for b, walk in enumerate(walks):
            if walk is None:
                continue
            committed = self.batch.commit(b, walk.tokens, walk.scores, self.criteria)
            self.stats.committed.append(committed)
            if self.streamer is not None:
                self.streamer.put(torch.tensor(walk.tokens[:committed]))
            if self.lookups[b] is not None:
                self.lookups[b].record(*self.proposals[b], walk.tokens)
                self.lookups[b].extend(walk.tokens[:committed])
            for vocab in (self.vocab, self.vp_vocab):
                if vocab is not None:
                    vocab.add(walk.tokens[:committed])
            anchors[b] = walk.tokens[-1]
        start, kept = self.advanced
        width = max([len(w.path) for w in walks if w is not None] or [1])
        if self.paths is None and any(w is not None and w.path != list(range(len(w.path))) for w in walks):
            # a path off the first nodes (a path row's K/V is already in path order)
            compat.keep_paths(self.cache, start, self.nodes[:, :width])
        compat.crop_to(self.cache, start + width)  # the next verify writes over what no path kept
        if width < kept:  # columns no row's path reached
            self.valid, self.taps, self.ctx_pos = self.valid[:, : start + width], self.taps[:, :width], \
                self.ctx_pos[:, :width]
            if self.plan.one_read:  # the next draft has read them (the VP drafter reads only the kept ones)
                self.dcache.crop(kept - width)
        self.holes = self.holes or not all(w is not None and len(w.path) == width for w in walks)
        self.advanced, self.unread = (start, width), False
        self.anchor_ids = anchors
        self.stats.cycles += 1
        self.stats.verified.append(verify.ids.shape[1])

    def compact(self) -> None:
        """The rows that stopped leave the batch: every batched state (columns, anchors, taps, the target's and the
        drafters' caches) keeps the rows still decoding, so the next verifies and drafts run only those."""
        slots = [b for b, on in enumerate(self.active) if on]
        index = torch.tensor(slots, device=self.valid.device)
        self.batch.keep(slots)
        self.valid, self.anchors, self.anchor_pos = self.valid[index], self.anchors[index], self.anchor_pos[index]
        self.taps, self.ctx_pos = self.taps[index], self.ctx_pos[index]
        self.anchor_ids = [self.anchor_ids[b] for b in slots]
        self.lookups, self.proposals = [self.lookups[b] for b in slots], [self.proposals[b] for b in slots]
        self.pending = self.pending.select(slots)
        compat.select_rows(self.cache, index)  # each layer keeps those rows
        self.dcache.select_rows(index)
        if self.vp_drafter is not None:
            self.vp_cache.select_rows(index)


def _check_inputs(drafter, vp_drafter, input_ids, attention_mask, streamer, cache) -> None:
    if attention_mask is not None and attention_mask.shape[1] > 1:
        mask = attention_mask.bool()
        right = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)
        if bool(right.any()):
            rows = right.nonzero().flatten().tolist()
            raise ValueError(
                f"Rows {rows} of the attention mask are right-padded (a 0 after a 1); hf_dscale appends each row's "
                "new tokens after its last column, so it decodes left-padded batches only. Set "
                "tokenizer.padding_side = 'left' (as plain generate() also expects for decoder-only models).")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(f"The cache passed in already holds {cache.get_seq_length()} positions; hf_dscale decodes from "
                         "the prompt with a cache of its own: pass no past_key_values (or an empty cache).")
    if input_ids.shape[0] > 1 and streamer is not None:
        raise ValueError("Streamers support batch size 1 only.")
    if vp_drafter is not None:
        if vp_drafter.config.block_size != drafter.config.block_size:
            raise ValueError(
                f"The VP drafter's block_size ({vp_drafter.config.block_size}) differs from the first drafter's "
                f"({drafter.config.block_size}); D²SD verifies branches of the first drafter's width.")
        if vp_drafter.config.mask_token_id is None:
            raise ValueError("The VP drafter has no mask_token_id; set it in its config.")


def _check_attention(attn: str, plan: Plan) -> None:
    if plan.tree and (attn.startswith("flash") or attn == "flex_attention"):
        raise ValueError(
            f"D²SD and draft_tree verify a token tree with a 4D attention mask, which the target's attn_implementation "
            f"{attn!r} does not take: load the target with attn_implementation='sdpa' (or 'eager'), or decode a chain "
            "(draft_tree=False).")


@torch.no_grad()
def decode(
    target,
    drafter,
    input_ids: torch.LongTensor,  # [B, P], left-padded
    attention_mask: torch.LongTensor | None = None,  # [B, P]
    *,
    vp_drafter=None,
    plan: Plan | None = None,
    logits_processor=None,
    stopping_criteria=None,
    do_sample: bool = False,
    pad_token_id: int = 0,
    cache=None,
    streamer=None,
    tree_kernel: bool | None = None,
    **options,
) -> tuple[torch.LongTensor, DecodeStats]:
    """Speculative decoding until every row meets a stopping criterion: sequences [B, P + N] and stats.

    Exact for greedy decoding, lossless for sampling. `cache`: an empty cache `generate()` prepared, or None; the
    engine decodes with its own (`compat.position_cache`, sized from a `max_length` stopping criterion). `plan`: how
    to decode (`calibrate`); without one, the plan for this target, batch size and `options` (`tree`,
    `prompt_lookup`, `num_branches`, `branch_policy`, `draft_confidence`; see `calibrate`) is measured once and kept
    on the drafter (`plan_for`). It is returned in `stats.plan`. Rows that stop early are padded with
    `pad_token_id`, as plain `generate()` does. `tree_kernel` runs the target's attention with the Triton cascade
    kernel during the call (default: on CUDA when Triton is installed and the plan verifies trees).
    """
    if plan is not None and any(value is not None for value in options.values()):
        raise ValueError(f"Pass either a plan or method options ({sorted(options)}), not both: a plan fixes the method.")
    _check_inputs(drafter, vp_drafter, input_ids, attention_mask, streamer, cache)
    TargetAttention.of(target)  # refuses a target whose layers the engine cannot decode, before any decoding forward
    if input_ids.shape[0] > 1 and not structure.of(target).positions:
        raise ValueError(
            f"{type(target).__name__} counts positions from its cache's columns, not from the position_ids it is "
            "given; in a batch, rows that accept different lengths leave masked columns that would shift them, so "
            "hf_dscale decodes it one prompt at a time: pass a batch of 1.")
    for model in (drafter, vp_drafter):
        if model is not None and model.target is not target:
            model.bind_target(target)
    if plan is None:
        options = {name: value for name, value in options.items() if value is not None}
        plan = plan_for(target, drafter, vp_drafter=vp_drafter, batch_size=input_ids.shape[0], do_sample=do_sample,
                        **options)
    attn = compat.attention_implementation(target)
    _check_attention(attn, plan)
    if tree_kernel is None:  # a compiled verify keeps the attention it was compiled with
        tree_kernel = plan.tree and input_ids.device.type == "cuda" and triton_usable(input_ids.device) and \
            attn in ("sdpa", "eager") and plan.compile_widths is None
    valid = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
    # Plain generate() pads the rows that stop only when it stops on EOS (a criterion with `eos_token_id`); a single
    # row ends where it stops either way.
    pad_finished = input_ids.shape[0] == 1 or stopping_criteria is None or \
        any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    rows = Rows.start(input_ids, pad_finished)
    lengths = [c.max_length for c in stopping_criteria or () if isinstance(getattr(c, "max_length", None), int)]
    capacity = min(lengths) + drafter.config.block_size * 2 if lengths else 0  # + the widest verify beyond the end
    engine = Engine(target, drafter, plan, rows, vp_drafter=vp_drafter, processors=logits_processor,
                    criteria=stopping_criteria, do_sample=do_sample, streamer=streamer, capacity=capacity)
    if tree_kernel:
        target.set_attn_implementation(register_tree_attention())
    try:
        engine.prefill(input_ids, valid)
        while not all(rows.finished):
            engine.cycle()
    finally:
        if engine.recorder is not None:
            engine.recorder.remove()
        engine.forward.close()
        if tree_kernel:
            target.set_attn_implementation(attn)
        if streamer is not None:
            streamer.end()
    return lay_out(input_ids, rows.outputs(), pad_token_id), engine.stats

