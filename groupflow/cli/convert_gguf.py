"""``groupflow convert-gguf``: a GGUF file to a Hugging Face model directory.

Design decision: a command module of its own (the CLI's rule: one module per command, or per
group sharing their imports), so only this command pays for the converter's imports; the
conversion itself is ``groupflow.models.gguf``, this module only reports its stages.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from groupflow.models.gguf import CONVERSION_STAGES, convert_gguf_to_hf, find_smollm2_gguf
from groupflow.utils.progress import Progress

__all__ = ["convert_gguf"]


def convert_gguf(args: argparse.Namespace) -> int:
    gguf = Path(args.gguf) if args.gguf else find_smollm2_gguf()
    with Progress("convert-gguf", CONVERSION_STAGES, unit="stages") as progress:
        started = []

        def on_stage(text: str) -> None:
            progress.stage(text, advance=1 if started else 0)  # the stage before it is done
            started.append(text)

        out = convert_gguf_to_hf(
            gguf, args.out, args.dtype, overwrite=args.overwrite, on_stage=on_stage
        )
        progress.update(1)
    print(f"wrote Hugging Face model directory {out} (from {gguf})")
    return 0
