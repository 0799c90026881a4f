"""Self-distillation data: the target answers training prompts, and its tapped hidden states are cached.

Layout of a data folder (every file is written atomically, so an interrupted run resumes where it
stopped and loses at most the batch in flight):

    meta.json                   target, tapped layer ids, chat template settings
    shard-00000.safetensors     input_ids [N] int32, loss_mask [N] uint8, offsets [S+1] int64,
                                taps [N, T, H] float16 (target hidden states at the tapped layers)
    shard-00000.json            the prompt ids in that shard (the resume index)

Caching the taps trades disk for compute: about 10 KB per token for SmolLM2's 9 taps (6 GB for 2,000
answers), against one target forward per sequence during training. On a CPU that forward is the
expensive part, so the taps are cached; on a GPU it is cheap, and a folder made with
`cache_taps=False` (meta `layer_ids: null`) holds only the tokens: the trainer then runs the target on
each batch for exactly the taps its drafter needs.

Responses are the target's own greedy answers (as the DFlash/DScale recipes regenerate responses with
the target). The loss mask is 1 on response tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..models.dscale.assistant import TapRecorder


def read_prompts(path: str, limit: int | None = None) -> list[dict]:
    """JSON lines with at least `prompt` (and ideally `id`)."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                if "prompt" not in row:
                    raise ValueError(f"{path}:{i + 1} has no `prompt` field.")
                row.setdefault("id", f"{os.path.basename(path)}:{i}")
                rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def write_prompts(path: str, rows: list[dict]) -> None:
    """`rows` as JSON lines of `id` and `prompt` (other fields dropped), the format `read_prompts` reads."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"id": row["id"], "prompt": row["prompt"]}) + "\n")


def render_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn of the target's chat template, ready for the assistant's answer."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def shard_names(folder: str) -> list[str]:
    """Finished shards ("shard-00000", ...), in order: a shard counts once its index file is written."""
    return sorted(n[:-5] for n in os.listdir(folder) if n.startswith("shard-") and n.endswith(".json"))


def _done_ids(folder: str) -> set[str]:
    done = set()
    for name in shard_names(folder):
        with open(os.path.join(folder, name + ".json")) as f:
            done.update(json.load(f))
    return done


def _next_shard(folder: str) -> int:
    return 1 + max((int(n[6:]) for n in shard_names(folder)), default=-1)


def _atomic_json(obj, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, W] and attention mask [N, W] of token lists padded on the left to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def length_sorted_batches(lengths: list[int], batch_size: int, window: int = 8) -> list[list[int]]:
    """Indices into `lengths` in batches of `batch_size`: each run of `window` batches' worth of items is
    sorted by length (stably) before it is cut, so a batch holds items of about one length and pads little.

    A left-padded batch costs its size times its longest prompt in the prefill, and the padding stays in the
    attention of every decoding step; on a mix of 56-512-token prompts, batches of 64, sorting within 8
    batches cut the padded prompt tokens to a third. Windows keep the order coarse: stopping early has
    answered about the first prompts of the file. `window` <= 1 keeps the file order.
    """
    span = batch_size * max(window, 1)
    batches = []
    for start in range(0, len(lengths), span):
        idx = range(start, min(start + span, len(lengths)))
        if window > 1:
            idx = sorted(idx, key=lambda i: lengths[i])
        idx = list(idx)
        batches += [idx[j : j + batch_size] for j in range(0, len(idx), batch_size)]
    return batches


@torch.no_grad()
def _answer_batch(target, prompts: list[list[int]], max_new_tokens: int, pad_id: int):
    """Greedy answers for a batch of rendered prompts -> list of response id lists (EOS kept)."""
    ids, mask = left_pad(prompts, pad_id)
    width = ids.shape[1]
    device = target.device
    out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=pad_id)
    eos = set(target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, list)
              else [target.generation_config.eos_token_id])
    responses = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


@torch.no_grad()
def padded_taps(target, recorder: TapRecorder, sequences, width: int | None = None) -> torch.Tensor:
    """Tapped hidden states [B, width, T, H] of unpadded sequences (token lists or tensors), on the target's
    device and in its own precision (autocast off).

    The batch is padded on the right: in a causal target no position sees the padding after it, so every
    real position gets exactly its own taps; positions past a sequence's end hold the padding's.
    """
    width = width or max(len(seq) for seq in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.as_tensor(seq)
    device = target.device
    with torch.autocast(device.type, enabled=False):
        target(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
    return recorder.taps()


def generate_data(
    target,
    tokenizer,
    prompt_files: list[str],
    out_dir: str,
    layer_ids: list[int] | None,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    limit_per_file: int | None = None,
    max_prompt_tokens: int = 512,
    progress: bool = False,
    sort_window: int = 8,
) -> int:
    """Answer every not-yet-done prompt (and cache its taps unless `layer_ids` is None); returns the number
    of new samples. Batches are cut from runs of `sort_window` batches' prompts sorted by length
    (`length_sorted_batches`; 1 = the file order)."""
    from tqdm.auto import tqdm

    os.makedirs(out_dir, exist_ok=True)
    layer_ids = None if layer_ids is None else list(layer_ids)
    meta = {"target": target.config._name_or_path, "layer_ids": layer_ids, "max_new_tokens": max_new_tokens}
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        if old["layer_ids"] != layer_ids:
            held = "no taps" if old["layer_ids"] is None else f"taps of layers {old['layer_ids']}"
            wanted = "none" if layer_ids is None else f"layers {layer_ids}"
            raise ValueError(f"{out_dir} holds {held}, not {wanted}; use a new folder.")
    else:
        _atomic_json(meta, meta_path)

    done = _done_ids(out_dir)
    todo = [row for path in prompt_files for row in read_prompts(path, limit_per_file) if row["id"] not in done]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    recorder = None if layer_ids is None else TapRecorder(target, layer_ids)
    shard, written = _next_shard(out_dir), 0
    try:
        bar = tqdm(total=len(todo), desc="self-distillation", unit="prompt", disable=not progress)
        rendered = [render_prompt(tokenizer, row["prompt"])[-max_prompt_tokens:] for row in todo]
        for idx in length_sorted_batches([len(p) for p in rendered], batch_size, sort_window):
            batch, prompts = [todo[i] for i in idx], [rendered[i] for i in idx]
            responses = _answer_batch(target, prompts, max_new_tokens, pad_id)
            sequences = [p + r for p, r in zip(prompts, responses)]
            lengths = [len(s) for s in sequences]
            tensors = {
                "input_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
                "loss_mask": torch.tensor([int(j >= len(p)) for p, s in zip(prompts, sequences) for j in range(len(s))],
                                          dtype=torch.uint8),
                "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
            }
            if recorder is not None:
                taps = padded_taps(target, recorder, sequences).cpu()
                tensors["taps"] = torch.cat([taps[i, : len(seq)] for i, seq in enumerate(sequences)]).to(torch.float16)
            name = os.path.join(out_dir, f"shard-{shard:05d}")
            save_file(tensors, name + ".safetensors.tmp")
            os.replace(name + ".safetensors.tmp", name + ".safetensors")
            _atomic_json([row["id"] for row in batch], name + ".json")  # written last: marks the shard done
            shard, written = shard + 1, written + len(batch)
            bar.update(len(batch))
        bar.close()
    finally:
        if recorder is not None:
            recorder.remove()
    return written


@dataclass
class Sample:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool
    taps: torch.Tensor | None  # [L, T, H] float16, None in a folder without cached taps


def load_meta(folder: str) -> dict:
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def read_shard(folder: str, name: str) -> list[Sample]:
    data = load_file(os.path.join(folder, name + ".safetensors"))
    offsets = data["offsets"].tolist()
    taps = data.get("taps")
    return [Sample(data["input_ids"][a:b].long(), data["loss_mask"][a:b].bool(), None if taps is None else taps[a:b])
            for a, b in zip(offsets[:-1], offsets[1:])]


def iter_samples(folder: str) -> Iterator[Sample]:
    """Every finished sample of a data folder, shard by shard."""
    for name in shard_names(folder):
        yield from read_shard(folder, name)


def frequent_tokens(folder: str, size: int) -> torch.Tensor:
    """The `size` response tokens seen most often in a data folder, most frequent first (ties: lower id first).

    Only tokens that occur are listed, so a small folder yields fewer than `size`. This is the
    drafter's `draft_vocab` (see `DScaleDrafter.set_draft_vocab`).
    """
    ids = []
    for name in shard_names(folder):
        with safe_open(os.path.join(folder, name + ".safetensors"), "pt") as shard:
            ids.append(shard.get_tensor("input_ids").long()[shard.get_tensor("loss_mask").bool()])
    if not sum(t.numel() for t in ids):
        raise ValueError(f"{folder} has no response tokens to rank.")
    counts = torch.bincount(torch.cat(ids))
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: min(size, int((counts > 0).sum()))]


def top_up(tokens: torch.Tensor, more: torch.Tensor, size: int) -> torch.Tensor:
    """`tokens`, then those of `more` not among them (in their order), `size` at most.

    A drafter trained further on a new data folder keeps its old draft vocabulary this way where the
    folder's own frequent tokens leave room: a small folder would otherwise shrink what it can propose.
    """
    seen = set(tokens.tolist())
    extra = [t for t in more.tolist() if t not in seen]
    return torch.cat([tokens.cpu(), torch.tensor(extra, dtype=torch.long)])[:size]
