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
    ap.add_argument("--results", type=Path, help="write a results file (groupflow.utils.results)")
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
    table = []
    for budget in budgets:
        responses = [tok.decode(t[:budget]) if len(t) > budget else r["response"]
                     for t, r in zip(ids, records)]  # fmt: skip
        # an answer is whole at this budget when it stopped (EOS counted) within it
        cut = sum(not (r["finish_reason"] == "stop" and r["new_tokens"] <= budget) for r in records)
        m = bench.metrics(bench.grade(row_list, responses), 1)
        cells = " | ".join(f"{100 * m[k]:.1f}" for k in METRICS)
        print(f"| {budget} | {cells} | {cut} ({100 * cut / len(records):.0f} %) |")
        table.append({"new-token budget": budget,
                      **{k.replace("_", " ") if k == "average_strict" else k: round(100 * m[k], 1)
                         for k in METRICS},
                      "cut": f"{100 * cut / len(records):.0f} %"})  # fmt: skip
    if args.results:
        _write_results(args, table, len(records), mismatched)


def _write_results(args, table: list[dict], n: int, mismatched: int) -> None:
    """The budget table of docs/guides/benchmarks-eval.md as a results file."""
    from groupflow.utils.results import write_results

    def at(budget: int) -> str:
        row = next((r for r in table if r["new-token budget"] == budget), None)
        return f"{row['average strict']} at {budget} tokens" if row else "?"

    budgets = [r["new-token budget"] for r in table]
    write_results(
        args.results, name=args.results.stem, rows=table,
        command=f"python benchmarks/eval_budget.py --records {args.records} --benchmark "
                f"{args.benchmark} --model {args.model} --budgets {args.budgets} "
                f"--results {args.results}",
        summary={"recipe": f"benchmarks/eval_budget.py ({args.benchmark})",
                 "what": "average strict accuracy by new-token budget",
                 "before": at(512 if 512 in budgets else budgets[0]), "after": at(budgets[-1]),
                 "guide": "docs/guides/benchmarks-eval.md"},
        notes=f"One greedy eval's records ({args.records}, {n} prompts) re-graded at each budget "
              f"by the official checkers; {mismatched} of {n} responses re-tokenize to another "
              "length than generated (their cut is approximate). \"cut\" = answers that did not "
              "stop within the budget.",
    )  # fmt: skip


if __name__ == "__main__":
    main()
