"""`hf-dscale export`: write a drafter in another public layout (native, z-lab DFlash, AngelSlim DFlare, or
transformers' DFlash assistant)."""

from __future__ import annotations

import json
import os


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a drafter in the native, DFlash, DFlare or transformers layout")
    p.add_argument("drafter", help="drafter folder or Hub id, in any layout hf_dscale reads")
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--layout", choices=["native", "dflash", "dflare", "transformers"], required=True,
                   help="native = hf_dscale's save_pretrained (trust_remote_code); dflash = z-lab DFlashDraftModel; "
                        "dflare = AngelSlim QwenDFlareDraftModel; transformers = transformers' DFlash assistant "
                        "(MuseGlimmerAssistantModel). dflash/transformers need a shared-fusion drafter, dflare a "
                        "layer-wise one")
    p.add_argument("--revision", default=None, help="Hub revision of DRAFTER")
    p.set_defaults(func=main)


def main(args) -> int:
    from ..models import DScaleDrafter
    from ..models.dscale.convert import export_drafter

    drafter = DScaleDrafter.from_pretrained(args.drafter, revision=args.revision)
    cfg = drafter.config
    files = export_drafter(drafter, args.out, args.layout)
    with open(os.path.join(args.out, "config.json")) as f:
        written = json.load(f)
    print(f"wrote {args.out} ({args.layout} layout, architectures {written.get('architectures')}, model_type "
          f"{written.get('model_type')!r}): fusion {cfg.fusion}, {cfg.num_hidden_layers} layers, "
          f"taps {cfg.target_layer_ids}, block_size {cfg.block_size}, mask_token_id {cfg.mask_token_id}"
          + (f", draft_vocab {cfg.draft_vocab_size} tokens" if cfg.draft_vocab_size else ""))
    for file in files:
        print(f"  {os.path.basename(file)}")
    return 0
