"""The image demo's task: count the coloured squares in a small synthetic picture.

Design decision: a task a tiny vision-language model can learn on a CPU in minutes, yet one that
needs the image — the question is always "how many?" and the answer (a digit 0..4) is only in
the pixels, so a policy that ignores the image cannot beat 20 %. Pictures are a ``grid`` x
``grid`` board of 8-pixel cells (a cell is one patch of the tiny ViT), each empty or holding a
red, green or blue square of 4-6 pixels; the count is drawn uniformly in 1..``max_count`` (so
the answers are balanced). ``ask_colour`` makes the harder variant ("red?": only that colour counts, the others
distract). Train and held-out rows come from one seeded stream of distinct (board, question)
pairs, held-out first, as the text tasks'. Rows are ordinary prompt rows (chat content parts
with a PIL image, ``answer``, ``data_source``) and go through the same loading, processor and
reward code as a dataset with images.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from groupflow.data.synthetic import clean_completion

__all__ = ["COLOURS", "SHAPES_SOURCE", "make_shape_rows", "draw_board", "count_reward"]

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}
SHAPES_SOURCE = "groupflow/shapes"
CELL = 8  # pixels per cell: one ViT patch of the tiny model


def draw_board(board: np.ndarray, sizes: np.ndarray | None = None,
               offsets: np.ndarray | None = None):  # fmt: skip
    """The picture of ``board`` [grid, grid] (0 empty, 1..3 the colours in COLOURS' order): a
    white image with a square in each filled 8x8 cell, of side ``sizes`` (default 6) at
    ``offsets`` [grid, grid, 2] inside the cell (default 1); every square covers its cell's
    centre pixel (4, 4)."""
    from PIL import Image, ImageDraw

    grid = board.shape[0]
    img = Image.new("RGB", (grid * CELL, grid * CELL), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    rgb = list(COLOURS.values())
    for (r, c), v in np.ndenumerate(board):
        if v:
            side = 6 if sizes is None else int(sizes[r, c])
            dx, dy = (1, 1) if offsets is None else (int(o) for o in offsets[r, c])
            x, y = c * CELL + dx, r * CELL + dy
            draw.rectangle([x, y, x + side - 1, y + side - 1], fill=rgb[v - 1])
    return img


def _draw(rng: np.random.Generator, grid: int, max_count: int, ask_colour: bool):
    """(picture, asked colour 1..3 or 0 for all squares, the count asked for). Counting every
    square, the count is 1..max_count (an empty board has one picture only); squares vary in
    side (4-6 px) and place within their cell, so small counts still have many pictures."""
    cells = grid * grid
    if not ask_colour:  # every square counts, whatever its colour
        count = int(rng.integers(1, max_count + 1))
        fill = [int(c) for c in rng.integers(1, 4, size=count)]
        asked = 0
    else:
        count = int(rng.integers(0, max_count + 1))
        asked = int(rng.integers(1, 4))
        others = [c for c in (1, 2, 3) if c != asked]
        fill = [asked] * count + [c for c in others for _ in range(int(rng.integers(0, 4)))]
        fill = fill[:cells]
    board = np.zeros(cells, dtype=np.int64)
    board[rng.permutation(cells)[: len(fill)]] = fill
    board = board.reshape(grid, grid)
    sizes = rng.integers(4, 7, size=(grid, grid))
    offsets = 1 + rng.integers(0, 3, size=(grid, grid, 2)) % (8 - sizes[..., None])
    return draw_board(board, sizes, offsets), asked, count


def make_shape_rows(n_train: int, n_val: int, seed: int, *, grid: int = 4, max_count: int = 5,
                    ask_colour: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """Disjoint train / held-out rows (held-out drawn first), deterministic per ``seed``.
    ``ask_colour``: the question names a colour ("red?") and only its squares count (a harder
    task: a tiny model's accuracy plateaus near 45 % for hundreds of supervised steps); else
    "how many?" counts every square."""
    if grid < 2 or not 1 <= max_count <= grid * grid:
        raise ValueError(
            f"shapes task: need grid >= 2 and 1 <= max_count <= grid², got {grid}, {max_count}"
        )
    rng = np.random.default_rng((seed, 23))
    names = list(COLOURS)
    seen: set[bytes] = set()
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < n_train + n_val:
        tries += 1
        if tries > 50 * (n_train + n_val) + 1000:
            raise ValueError(f"shapes task: cannot draw {n_train + n_val} distinct problems")
        image, asked, count = _draw(rng, grid, max_count, ask_colour)
        key = image.tobytes() + bytes([asked])
        if key in seen:
            continue
        seen.add(key)
        split = "val" if len(rows) < n_val else "train"
        rows.append({
            "prompt": [{"role": "user", "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": f"{names[asked - 1]}?" if asked else "how many?"}]}],
            "answer": str(count),
            "data_source": SHAPES_SOURCE,
            "split": split,
        })  # fmt: skip
    return rows[n_val:], rows[:n_val]


NEAR_CREDIT = 0.5  # an answer off by one scores NEAR_CREDIT / 2, off by two or more 0


def count_reward(completions, answer, **_: Any) -> list[float]:
    """1.0 for the exact count; an integer answer off by ``d`` gets ``NEAR_CREDIT × (1 - d/2)``
    (so 0.25 for off-by-one), anything else 0. The graded part tells the policy which way to
    move, as the text demo's partial credit does; accuracy (reward >= 1) counts exact answers
    only."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text = clean_completion(c)
        if text == str(a).strip():
            out.append(1.0)
        elif text.isdigit():
            out.append(NEAR_CREDIT * max(0.0, 1 - abs(int(text) - int(a)) / 2))
        else:
            out.append(0.0)
    return out
