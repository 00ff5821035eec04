"""The judge reward with image completions, against a stub vision endpoint on 127.0.0.1.

The stub decodes every ``image_url`` part of the request (PNG data URLs) and scores the response
as round(10 × mean pixel value of the first image), so each expected score is known by hand; it
also records how many images each request carried.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from groupflow.rewards import RewardFunction, RewardRunner, get_reward


@pytest.fixture
def stub():
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            marker = body["messages"][0]["content"].split("'")[1].split(" ")[0]
            parts = body["messages"][-1]["content"]
            images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
            png = base64.b64decode(images[0].split(",", 1)[1])
            mean = np.asarray(Image.open(io.BytesIO(png)), dtype=np.float64).mean() / 255
            chat = {"choices": [{"message": {"content": f"ok {marker} Score: {round(10 * mean)}"}}]}
            data = json.dumps(chat).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    server.shutdown()
    server.server_close()


def _judge(url, **kwargs):
    return get_reward("judge", base_url=url, model="stub-vlm", rubric="is it bright?",
                      backoff_s=0.0, **kwargs)  # fmt: skip


def test_images_go_as_png_parts_and_score_by_hand(stub, tmp_path):
    url, requests = stub
    grey = torch.full((3, 8, 8), 0.5)  # PNG of round(127.5) = 128: mean 128/255 -> score 5
    white = torch.ones(3, 8, 8)
    fn = _judge(url, cache=str(tmp_path / "judge.sqlite"))
    scores = asyncio.run(fn(["a cat"] * 3, [grey, white, grey.clone()]))
    assert scores == [5.0, 10.0, 5.0]
    assert len(requests) == 2  # the repeated image is judged once
    user = requests[0]["messages"][1]["content"]
    assert user[0] == {"type": "text",
                       "text": "PROMPT:\na cat\n\nRESPONSE:\n(the generated image, attached below)"}  # fmt: skip
    assert user[1]["image_url"]["url"].startswith("data:image/png;base64,")
    # the cache holds the judgements by image: a second call sends nothing
    again = _judge(url, cache=str(tmp_path / "judge.sqlite"))
    assert asyncio.run(again(["a cat"], [white])) == [10.0] and len(requests) == 2


def test_video_frames_and_an_unreadable_image_is_a_counted_failure(stub):
    url, requests = stub
    video = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4), torch.ones(3, 4, 4)], dim=1)
    fn = _judge(url, frames=[1, 2])
    assert asyncio.run(fn(["p"], [video])) == [10.0]
    assert sum(p["type"] == "image_url" for p in requests[-1]["messages"][1]["content"]) == 2
    runner = RewardRunner([RewardFunction("judge", _judge(url))], failure_value=-1.0)
    result = runner(["p", "p"], [torch.full((3, 4, 4), float("nan")), torch.zeros(3, 4, 4)])
    assert result.total.tolist() == [-1.0, 0.0]
    assert result.metrics["reward/judge/failures"] == 1.0
