"""What the new-token budget does to an instruction-following score, from one greedy eval.

Greedy decoding has the prefix property: the first N tokens of a 1,280-token greedy answer are the
answer a run with an N-token budget gives. So one ``groupflow eval --benchmark ifeval --out F``
at the benchmark's budget yields the scores at every smaller budget: each response is re-tokenized,
cut to N tokens, decoded and graded again by the official checkers (``groupflow.evals``), side by
side in one table. The re-tokenization is checked: a response whose token count differs from the
count the eval recorded is reported (the cut is then approximate for that row).

    python benchmarks/eval_budget.py --records runs/bench/ifeval_base.jsonl --benchmark ifeval \\
        --model models/smollm2-135m-instruct --budgets 256,512,768,1024,1280
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from groupflow.evals import get_benchmark

METRICS = ("prompt_strict", "inst_strict", "prompt_loose", "inst_loose", "average_strict")


def _read(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records or any(r.get("sample", 0) != 0 for r in records):
        raise SystemExit(f"{path}: expected a greedy eval's records (one sample per prompt)")
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, required=True, help="groupflow eval --out FILE")
    ap.add_argument("--benchmark", default="ifeval")
    ap.add_argument("--model", required=True, help="the model directory (its tokenizer)")
    ap.add_argument("--budgets", default="256,512,768,1024,1280")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    bench = get_benchmark(args.benchmark)
    rows = {r.fields["key"]: r for r in bench.load().rows}
    records = _read(args.records)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids, mismatched = [], 0
    for r in records:
        toks = tok(r["response"], add_special_tokens=False)["input_ids"]
        # a stopped answer's count includes its EOS, which decoding drops
        expected = r["new_tokens"] - (r["finish_reason"] == "stop")
        mismatched += len(toks) != expected
        ids.append(toks)
    row_list = [rows[r["key"]] for r in records]
    print(f"{args.benchmark}: {len(records)} prompts from {args.records}; {mismatched} response(s) "
          f"re-tokenize to another length than recorded")  # fmt: skip
    print("| budget | " + " | ".join(METRICS) + " | cut at budget |")
    print("|---:|" + "---:|" * (len(METRICS) + 1))
    for budget in budgets:
        responses = [tok.decode(t[:budget]) if len(t) > budget else r["response"]
                     for t, r in zip(ids, records)]  # fmt: skip
        # an answer is whole at this budget when it stopped (EOS counted) within it
        cut = sum(not (r["finish_reason"] == "stop" and r["new_tokens"] <= budget) for r in records)
        m = bench.metrics(bench.grade(row_list, responses), 1)
        cells = " | ".join(f"{100 * m[k]:.1f}" for k in METRICS)
        print(f"| {budget} | {cells} | {cut} ({100 * cut / len(records):.0f} %) |")


if __name__ == "__main__":
    main()
