"""Decoding masked-diffusion LMs: Fast-dLLM (threshold rule + dual cache) and BlockBatch.

Both fill a generation region of G masks after the prompt, greedily, and count NFE = model forwards
(one batched forward = 1 NFE). They share one stopping rule, so NFE compares fairly: stop as soon as
the region holds an EOS with no mask before it (or has no mask left); the answer ends at that EOS.

* **Fast-dLLM**: blocks of 32 left to right; per block one full forward (refreshes the dual cache),
  then block-only forwards over the cached prefix and stale suffix until the block is filled. Each
  step commits every masked position of the window whose confidence is >= 0.9, and at least the most
  confident one (`threshold_commit`); for a Dream-style model the full forward commits only the block's
  first token, as Fast-dLLM's Dream decoder does (`commit_first`).
* **BlockBatch**: one branch per block size (rows of one batch, one cache row each), all advanced by
  one batched block forward per step. Between steps: a confidence-gated merge (a branch adopts a token
  another compatible branch already holds when its own stored probability for it is > 0.5), a leader
  sync (a branch more than 8 tokens behind copies the leader's row and cache row, keeping its own
  block grid) and a periodic full refresh (one batched full forward once any branch advanced 32
  tokens since the last refresh; a plan may choose 64). This is the paper's periodic
  ("original_bulk") variant; `refresh_rows="leader"` has a refresh run the leader's row alone, which every branch
  then takes, as at the start (one row's full forward). A batched block forward runs only the branches' real window
  positions, packed (the paper's varlen packing): windows of 16 and 32 cost 48 queries, not 2 x 32.

A batched forward is not free where compute, not launches, bounds a step (a CPU, or a GPU at large batch), so
which branches pay for themselves is measured, not assumed: `plan_blockbatch` prices each forward shape the model
runs (`measure_step_costs`, or a table the caller passes), decodes a few calibration prompts with candidate branch
sets and refresh intervals (each run's forwards priced, plus the host time it spent between them) and returns a
`BlockBatchPlan` naming the one with the lowest expected seconds; `blockbatch_generate(..., plan=...)` decodes with
it. A full refresh runs each distinct row once: rows a sync made identical give identical logits and cache rows, so
one forward of the distinct rows is the same step at a fraction of its cost.

Between model calls both decoders commit, scan the rows for the stopping rule and (BlockBatch) merge. On a CPU a C
library does each in one call (`kernels/dllm_host.c`, built on first use) where torch runs a dozen small operations;
elsewhere, or with `host="torch"`, torch does (`host_kernel`). The decodes are the same either way.
"""

from .custom_generate import generate as dllm_generate
from .decode import blockbatch_generate, fast_dllm_generate
from .host import BLOCK_SIZES
from .plan import BlockBatchPlan, plan_blockbatch

__all__ = ["BLOCK_SIZES", "BlockBatchPlan", "blockbatch_generate", "dllm_generate", "fast_dllm_generate",
           "plan_blockbatch"]
