"""Completion tokens/s through ``groupflow serve``'s HTTP server vs the in-process engine, side by side.

Methodology:

- The work is K agent conversations of ``--turns`` calls each (call, a user turn appended,
  call again …), ``--new-tokens`` new tokens per call at temperature 1, for K in ``--concurrency``
  (default 1, 8, 32), with one torch thread.
- **in-process**: the HF engine (``groupflow.rollout.engines.base.HFEngine``) decodes the K
  conversations' calls of one turn in one ``generate`` call — the best batching there is.
- **server**: a server in a thread of the same process (uvicorn on 127.0.0.1, the continuous
  batcher — ``--batcher dynamic``: per engine call —, ``ServerCore``) and K concurrent ``openai.AsyncOpenAI`` clients sending
  ``/v1/chat/completions`` requests, each conversation continuing on the ids the server sampled.
  The agents share one event loop and one HTTP client (``workflows.agent_runtime.shared_http_client``)
  kept for the whole benchmark, as a training run's episodes do, and the batcher knows how many
  conversations are open, as a training run's knows its episodes (``--no-expected``: it does
  not, as ``groupflow serve`` for outside clients). Per-call latency (mean, p90) is measured at
  the client.
- **server, sequential**: the same K conversations sent one after another (what a server without
  a batcher would do), for K > 1.
- CPU ratio: the in-process engine's CPU time over the server process's for the same tokens
  (its decode thread, HTTP and — with ``--clients thread`` — the agents): on a loaded shared
  machine the wall-clock ratio is noise, this one much less so.
- ``--mixed``: every other conversation asks for 1/8 of the tokens per call (in-process, the
  turn's one ``generate`` call still decodes all rows to the longest; a short call through the
  continuous batcher leaves early, through the per-call one it waits for its call to end).
- ``--clients process`` runs the K agents in another process (an agent outside the trainer).
- **ceiling**: the same agents answered by a server that costs nothing (the canned answers, in
  memory, through ``httpx2.MockTransport``: no HTTP, no decoding). Conversations in lockstep
  wait for their agents between turns, so in-process seconds / (in-process + the agents'
  seconds) is the best ratio any server could reach with these agents on this model.
- The same prompts and seeds, so both paths decode the same tokens (checked: the run prints how
  many completion tokens differ — only float rounding may flip one: a continued call's prefix
  comes from the server's prefix cache, not a full prefill; the calls' lengths, so the work,
  stay equal); reported are completion tokens/s and the
  server/in-process ratio. Variants alternate in ``--reps`` rounds and the median is kept, so the
  load of a shared machine hits all alike; the load average is printed.

Models: the demo's tiny Llama (a character tokenizer; default) and, with ``--model DIR``, any HF
model directory (e.g. SmolLM2-135M-Instruct from ``groupflow convert-gguf``).

    python benchmarks/bench_serve.py
    python benchmarks/bench_serve.py --model models/smollm2-135m-instruct --new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import multiprocessing
import os
import statistics
import string
import time
from pathlib import Path

import torch

from groupflow.rollout.engines.base import HF
from groupflow.rollout.engines.continuous import ContinuousDecoder
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.app import build_app
from groupflow.serve.batcher import ContinuousBatcher, DynamicBatcher, engine_generate
from groupflow.serve.core import ServeLimits, ServerCore
from groupflow.serve.thread import ServerThread
from groupflow.workflows.agent_runtime import shared_http_client


def _load(model_dir: str | None):
    if model_dir is None:
        from groupflow.data.tokenizer import train_char_tokenizer
        from groupflow.models.causal_lm import build_tiny_llama

        tok = train_char_tokenizer(string.ascii_uppercase)
        model = build_tiny_llama(
            len(tok), hidden_size=64, num_layers=4, num_heads=4, max_positions=512, seed=0,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        return "tiny demo model (0.2M)", tok, model.eval()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model_dir, tok, model.eval()


def _question(i: int) -> str:
    return f"what is {i} + {2 * i + 1}? answer with a number."


def _seed(conv: int, turn: int) -> int:
    return 1000 * conv + turn


def _limit(i: int, new_tokens: int, mixed: bool) -> int:
    """Conversation i's tokens per call: all ``new_tokens``, or (``--mixed``) every other one 1/8."""
    return max(1, new_tokens // 8) if mixed and i % 2 else new_tokens


def run_inprocess(engine, tok, k: int, turns: int, new_tokens: int,
                  mixed: bool = False) -> tuple[float, int, list, list]:  # fmt: skip
    """The K conversations, each turn of all K in one generate call (no EOS stop): seconds,
    tokens, and each call's sampled ids and prompt ids (turn by turn, conversation by
    conversation)."""
    contexts = [
        tok.apply_chat_template(
            [{"role": "user", "content": _question(i)}], tokenize=False, add_generation_prompt=True
        )  # fmt: skip
        for i in range(k)
    ]
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in contexts]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    tokens, sampled, prompts = 0, [], []
    start = time.perf_counter()
    for t in range(turns):
        prompts += ids
        out = engine.generate(ids, params, seeds=[_seed(i, t) for i in range(k)])
        new = []
        for i in range(k):
            m = out.response_mask[i].bool()
            got = out.responses[i][m].tolist()[: _limit(i, new_tokens, mixed)]
            sampled.append(got)
            tokens += len(got)
            if t + 1 < turns:  # the server's continuation: the template's turns after ours
                new.append(ids[i] + got + _follow_up(tok, got))
        ids = new
    return time.perf_counter() - start, tokens, sampled, prompts


def canned_answers(tok, k: int, turns: int, sampled: list, prompts: list) -> dict[int, bytes]:
    """The server's answer to every call of the K conversations (its fields and sizes: text,
    token ids, log-probs, prompt ids), by the call's seed: what a server that costs nothing
    would send back."""
    out = {}
    for t in range(turns):
        for i in range(k):
            ids, prompt = sampled[t * k + i], prompts[t * k + i]
            choice = {"index": 0, "finish_reason": "length", "logprobs": None, "token_ids": ids,
                      "token_logprobs": [-1.0] * len(ids),
                      "message": {"role": "assistant", "content": tok.decode(ids)}}  # fmt: skip
            out[_seed(i, t)] = json.dumps({
                "id": f"c{i}-{t}", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [choice], "prompt_token_ids": prompt,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)},
            }).encode()  # fmt: skip
    return out


def run_free_server(answers: dict[int, bytes], k: int, turns: int, new_tokens: int,
                    mixed: bool = False) -> float:  # fmt: skip
    """Seconds for the K conversations' agents alone: the same ``openai`` client calls answered
    at once, in memory, with no HTTP (``httpx2.MockTransport``) — a server that costs nothing.
    With conversations in lockstep the agents' time adds to decoding, so in-process seconds /
    (in-process + these) is the best ratio any server can reach with these agents."""
    import httpx2
    import openai

    def answer(request):
        seed = json.loads(request.content)["seed"]
        return httpx2.Response(200, content=answers[seed],
                               headers={"content-type": "application/json"})  # fmt: skip

    async def main():
        http = openai.DefaultAsyncHttpxClient(transport=httpx2.MockTransport(answer))
        client = openai.AsyncOpenAI(base_url="http://free/v1", api_key="x", max_retries=0,
                                    http_client=http)  # fmt: skip
        start = time.perf_counter()
        await asyncio.gather(
            *(_conversation(client, i, turns, new_tokens, [], mixed) for i in range(k))
        )
        seconds = time.perf_counter() - start
        await http.aclose()
        return seconds

    return asyncio.run(main())


def _follow_up(tok, sampled: list[int]) -> list[int]:
    from groupflow.agents.formats import ChatFormat

    return ChatFormat(tok).observation_ids([{"role": "user", "content": "and then?"}], sampled[-1])


async def _conversation(client, i: int, turns: int, new_tokens: int, latencies: list,
                        mixed: bool = False) -> list:  # fmt: skip
    messages = [{"role": "user", "content": _question(i)}]
    sampled = []
    for t in range(turns):
        start = time.perf_counter()
        reply = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=_limit(i, new_tokens, mixed), seed=_seed(i, t),
            temperature=1.0,
        )  # fmt: skip
        latencies.append(time.perf_counter() - start)
        sampled.append(reply.choices[0].model_extra["token_ids"])
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "and then?"}]  # fmt: skip
    return sampled


_CLIENT: dict = {}  # per process: one event loop and one client, kept between runs


def run_server(url: str, k: int, turns: int, new_tokens: int, sequential: bool,
               mixed: bool = False):  # fmt: skip
    """The K conversations through the server. The event loop, the client and its connections
    live as long as the process, as a training run's agents share one loop and one HTTP client
    across episodes and steps (``workflows.agent_runtime.AgentLoop``): no run pays connection
    set-up."""
    import openai

    if _CLIENT.get("url") != url:
        loop = asyncio.new_event_loop()
        http = shared_http_client(600)  # the training run's agents' transport
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=600,
                                    http_client=http)  # fmt: skip
        _CLIENT.update(url=url, loop=loop, client=client, http=http)
    client, loop = _CLIENT["client"], _CLIENT["loop"]

    async def main():
        latencies: list[float] = []
        start = time.perf_counter()
        if sequential:
            convs = [await _conversation(client, i, turns, new_tokens, latencies, mixed)
                     for i in range(k)]  # fmt: skip
        else:
            convs = await asyncio.gather(
                *(_conversation(client, i, turns, new_tokens, latencies, mixed) for i in range(k))
            )
        return time.perf_counter() - start, convs, latencies

    seconds, convs, latencies = loop.run_until_complete(main())
    # the same order as the in-process run: turn by turn, conversation by conversation
    sampled = [convs[i][t] for t in range(turns) for i in range(k)]
    return seconds, sum(len(s) for s in sampled), sampled, latencies


def close_client() -> None:
    if _CLIENT:
        _CLIENT["loop"].run_until_complete(_CLIENT["http"].aclose())
        _CLIENT["loop"].close()
        _CLIENT.clear()


def write_serve_results(args, name: str, rows: list[dict]) -> None:
    """The rows measured now as a results file, in the shape of ``benchmarks/results/serve_*.json``."""
    import sys

    from groupflow.utils.results import write_results

    where = "the server's process" if args.clients == "thread" else "another process"
    first, last = rows[0], rows[-1]
    ks = f"{first['conversations']} / {last['conversations']} conversations"
    notes = (f"{name}, {args.new_tokens} new tokens a call, {args.turns} calls a conversation, "
             f"{'mixed' if args.mixed else 'equal'} lengths, agents in {where}, {args.batcher} "
             f"batching, prefix cache {args.prefix_cache_tokens} tokens, "
             f"{'batcher not told the open conversations, ' if args.no_expected else ''}"
             f"{args.threads} torch thread(s), medians of {args.reps} alternating rounds. ratio = "
             "server / in-process tokens/s (wall clock); CPU ratio = in-process CPU over the "
             "server process's CPU for the same tokens; ceiling = the best ratio a server "
             "costing nothing reaches with these agents.")  # fmt: skip
    write_results(
        args.results,
        name=Path(args.results).stem,
        command="python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
        rows=rows,
        summary={
            "recipe": "benchmarks/bench_serve.py",
            "what": f"tokens/s, server vs in-process engine, {name}, agents in {where}",
            "before": f"in-process {first['in-process tok/s']} / {last['in-process tok/s']} tok/s ({ks})",
            "after": f"server {first['server tok/s']} / {last['server tok/s']} tok/s "
                     f"({first['ratio']}× / {last['ratio']}×)",
            "guide": "docs/benchmarks/serve.md",
        },
        notes=notes,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="an HF model directory (default: the tiny model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clients", choices=["thread", "process"], default="thread",
                   help="where the K agents run: the server's process (as in a training run) or "
                        "another process (an agent elsewhere)")  # fmt: skip
    p.add_argument(
        "--mixed",
        action="store_true",
        help="every other conversation asks for 1/8 of --new-tokens per call",
    )
    p.add_argument("--prefix-cache-tokens", type=int, default=16384,
                   help="the continuous decoder's prefix cache (serve.prefix_cache_tokens; 0: off)")  # fmt: skip
    p.add_argument("--no-expected", action="store_true",
                   help="the batcher does not know how many conversations are open (groupflow "
                        "serve); default: it does, as in a training run (its open episodes)")  # fmt: skip
    p.add_argument("--batcher", choices=["continuous", "dynamic"], default="continuous",
                   help="the server's: continuous (the HF default) or per engine call")  # fmt: skip
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also write the measured rows as a results file (groupflow.utils.results)")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    name, tok, model = _load(args.model)
    # no EOS: every call decodes exactly --new-tokens (equal work on both paths)
    engine = HF.build(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    limits = ServeLimits(max_tokens=args.new_tokens, max_context_tokens=100_000,
                         max_batch_samples=max(args.concurrency))  # fmt: skip
    if args.batcher == "continuous":
        decoder = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id,
                                    prefix_tokens=args.prefix_cache_tokens)  # fmt: skip
        batcher = ContinuousBatcher(decoder, max_batch_samples=max(args.concurrency))
    else:
        batcher = DynamicBatcher(engine_generate(engine), max_batch_samples=max(args.concurrency))
    core = ServerCore(tok, batcher, SamplingParams(), model_name="m", limits=limits)
    open_conversations = [1]
    if not args.no_expected:  # a training run's batcher waits for each open episode's call
        batcher.expected = lambda: open_conversations[0]
    server = ServerThread(build_app(core)).start()
    print(f"model: {name}; {args.batcher} batching, clients in a {args.clients}, "
          f"{'mixed' if args.mixed else 'equal'} lengths; {args.turns} calls per conversation, {args.new_tokens} new tokens per "
          f"call, {args.threads} torch thread(s), prefix cache {args.prefix_cache_tokens} tokens; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    pool = None
    if args.clients == "process":  # the agents' CPU off the server's process (and its GIL)
        pool = multiprocessing.get_context("spawn").Pool(1)
        send = functools.partial(pool.apply, run_server)
        free = functools.partial(pool.apply, run_free_server)
    else:

        def send(a):
            return run_server(*a)

        def free(a):
            return run_free_server(*a)

    ref, prompts = run_inprocess(engine, tok, 2, 1, 4)[2:]  # warm-up
    free((canned_answers(tok, 2, 1, ref, prompts), 2, 1, 4))
    send((server.url, max(args.concurrency), 1, 4, False))  # every connection opened
    header = (f"{'conversations':>13} | {'in-process tok/s':>16} | {'server tok/s':>12} | "
              f"{'ratio':>5} | {'latency mean/p90 s':>18} | {'sequential tok/s':>16} | "
              f"{'batched/seq':>11} | {'CPU ratio':>9} | {'ceiling':>7}")  # fmt: skip
    print(header)
    print("-" * len(header))
    measured: list[dict] = []
    for k in args.concurrency:
        rows = {"in": [], "srv": [], "seq": [], "cpu": [], "ceiling": []}
        lat: list[float] = []
        differ, total = 0, 0
        for _ in range(args.reps):
            cpu = time.process_time()
            secs, toks, ref, prompts = run_inprocess(engine, tok, k, args.turns, args.new_tokens,
                                                     args.mixed)  # fmt: skip
            cpu_in, cpu = time.process_time() - cpu, time.process_time()
            rows["in"].append(toks / secs)
            answers = canned_answers(tok, k, args.turns, ref, prompts)
            agents = free((answers, k, args.turns, args.new_tokens, args.mixed))
            rows["ceiling"].append(secs / (secs + agents))
            open_conversations[0] = k
            secs, toks, got, latencies = send(
                (server.url, k, args.turns, args.new_tokens, False, args.mixed)
            )
            rows["cpu"].append(cpu_in / (time.process_time() - cpu))
            rows["srv"].append(toks / secs)
            lat += latencies
            differ += sum(a != b for x, y in zip(got, ref) for a, b in zip(x, y))
            total += sum(len(x) for x in ref)
            if [len(x) for x in got] != [len(x) for x in ref]:
                raise SystemExit("the server's calls have other lengths than in-process ones")
            if k > 1:
                open_conversations[0] = 1
                secs, toks, _, _ = send(
                    (server.url, k, args.turns, args.new_tokens, True, args.mixed)
                )
                rows["seq"].append(toks / secs)
        med = {key: statistics.median(v) if v else float("nan") for key, v in rows.items()}
        p90 = sorted(lat)[max(0, math.ceil(0.9 * len(lat)) - 1)]  # nearest rank
        print(f"{k:>13} | {med['in']:>16.0f} | {med['srv']:>12.0f} | "
              f"{med['srv'] / med['in']:>5.2f} | {statistics.mean(lat):>8.3f} / {p90:<7.3f} | "
              f"{med['seq']:>16.0f} | {med['srv'] / med['seq']:>11.2f} | {med['cpu']:>9.2f} | "
              f"{med['ceiling']:>7.2f}"
              + (f"  ({differ} of {total} tokens differ: float rounding)" if differ else ""))  # fmt: skip
        measured.append({
            "conversations": k, "in-process tok/s": round(med["in"]),
            "server tok/s": round(med["srv"]), "ratio": round(med["srv"] / med["in"], 2),
            "ceiling": round(med["ceiling"], 2), "CPU ratio": round(med["cpu"], 2),
            "latency mean s": round(statistics.mean(lat), 3), "latency p90 s": round(p90, 3),
            "batched / sequential": f"{med['srv'] / med['seq']:.1f}×" if k > 1 else "–",
        })  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.results:
        write_serve_results(args, name, measured)
    close_client()
    if pool is not None:
        pool.apply(close_client)
        pool.close()
        pool.join()
    server.stop()
    core.batcher.close()


if __name__ == "__main__":
    main()
