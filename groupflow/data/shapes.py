"""The image demo's task: count the squares of one colour in a small synthetic picture.

Design decision: a task a tiny vision-language model can learn on a CPU in minutes, yet one that
needs the image — the question names a colour ("red?") and the answer (a digit 0..4) is only in
the pixels, so a policy that ignores the image cannot beat 20 %. Pictures are a ``grid`` x
``grid`` board of 8-pixel cells (a cell is one patch of the tiny ViT), each empty or holding a
red, green or blue square; the asked colour's count is drawn uniformly in 0..``max_count`` (so the
answers are balanced), the other colours fill up to 3 cells each. Train and held-out rows come
from one seeded stream of distinct (board, question) pairs, held-out first, as the text tasks'.
Rows are ordinary prompt rows (chat content parts with a PIL image, ``answer``, ``data_source``)
and go through the same loading, processor and reward code as a dataset with images.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["COLOURS", "SHAPES_SOURCE", "make_shape_rows", "draw_board"]

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}
SHAPES_SOURCE = "groupflow/shapes"
CELL = 8  # pixels per cell: one ViT patch of the tiny model


def draw_board(board: np.ndarray):
    """The picture of ``board`` [grid, grid] (0 empty, 1..3 the colours in COLOURS' order): a
    white image with a 6x6 square in each filled 8x8 cell."""
    from PIL import Image, ImageDraw

    grid = board.shape[0]
    img = Image.new("RGB", (grid * CELL, grid * CELL), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    rgb = list(COLOURS.values())
    for (r, c), v in np.ndenumerate(board):
        if v:
            x, y = c * CELL + 1, r * CELL + 1
            draw.rectangle([x, y, x + CELL - 3, y + CELL - 3], fill=rgb[v - 1])
    return img


def _draw(rng: np.random.Generator, grid: int, max_count: int) -> tuple[np.ndarray, int, int]:
    """(board, asked colour 1..3, its count)."""
    cells = grid * grid
    asked = int(rng.integers(1, 4))
    count = int(rng.integers(0, max_count + 1))
    others = [c for c in (1, 2, 3) if c != asked]
    fill = [asked] * count + [c for c in others for _ in range(int(rng.integers(0, 4)))]
    fill = fill[:cells]
    board = np.zeros(cells, dtype=np.int64)
    board[rng.permutation(cells)[: len(fill)]] = fill
    return board.reshape(grid, grid), asked, count


def make_shape_rows(n_train: int, n_val: int, seed: int, *, grid: int = 4,
                    max_count: int = 4) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """Disjoint train / held-out rows (held-out drawn first), deterministic per ``seed``."""
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
        board, asked, count = _draw(rng, grid, max_count)
        key = board.tobytes() + bytes([asked])
        if key in seen:
            continue
        seen.add(key)
        split = "val" if len(rows) < n_val else "train"
        rows.append({
            "prompt": [{"role": "user", "content": [
                {"type": "image", "image": draw_board(board)},
                {"type": "text", "text": f"{names[asked - 1]}?"}]}],
            "answer": str(count),
            "data_source": SHAPES_SOURCE,
            "split": split,
        })  # fmt: skip
    return rows[n_val:], rows[:n_val]
