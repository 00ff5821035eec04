import pytest
import torch

from groupflow.diffusion.ocr import levenshtein, make_ocr_reward, ocr_similarity, quoted_target
from groupflow.rewards import RewardConfigError, RewardFunction, RewardRunner, get_reward

pytest.importorskip("rapidocr_onnxruntime")


def test_levenshtein_hand_computed():
    assert levenshtein("kitten", "sitting") == 3  # k->s, e->i, +g
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


def test_flow_grpo_similarity():
    # lower-cased, spaces removed, a contained target scores 1
    assert ocr_similarity("Hello World!!", "hello world") == 1.0
    assert ocr_similarity("HELO", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_similarity("", "open") == 0.0
    # many unrelated characters cost at most the whole target
    assert ocr_similarity("xyzxyzxyzxyz", "ab") == 0.0
    with pytest.raises(ValueError, match="empty"):
        ocr_similarity("abc", "  ")


def test_quoted_target():
    assert quoted_target('a neon sign that says "Open 24h" at night') == "Open 24h"
    with pytest.raises(ValueError, match="no text in double quotes"):
        quoted_target("a neon sign")


def _render(text: str, size=(224, 64)) -> torch.Tensor:
    """Black text on white, as a [3, H, W] tensor in [0, 1]."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((8, 10), text, fill="black", font=ImageFont.load_default(size=32))
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return get_reward("ocr")


def test_reads_rendered_text_back(ocr):
    images = [_render("OPEN 42"), _render("OPEN"), torch.ones(3, 64, 64)]
    prompts = ['a sign that says "open 42"'] * 3
    # full match; "open" vs "open42": 2 edits of 6; a blank image reads nothing
    assert ocr(prompts, images) == pytest.approx([1.0, 1 - 2 / 6, 0.0])
    video = torch.stack([_render("OPEN"), torch.ones(3, 64, 224)], dim=1)  # [3, F=2, H, W]
    both = make_ocr_reward(frames=[0, 1])
    assert both(['"open"'], [video]) == pytest.approx([0.5])


def test_unreadable_images_and_missing_targets_are_counted_failures(ocr):
    runner = RewardRunner([RewardFunction("ocr", ocr, failure_value=-1.0)])
    nan = torch.full((3, 32, 32), float("nan"))
    result = runner(
        ['"hi"', '"hi"', "no quotes here", '"hi"'],
        [nan, torch.ones(2, 8, 8), torch.ones(3, 32, 32), torch.ones(3, 32, 32)],
    )
    assert result.total.tolist() == [-1.0, -1.0, -1.0, 0.0]
    assert result.metrics["reward/ocr/failures"] == 3.0


def test_target_field_and_bad_options():
    fn = make_ocr_reward(target_field="text")
    assert fn(["ignored"], [_render("OPEN")], text=["open"]) == [1.0]
    spec = RewardFunction("ocr", fn)
    assert spec.missing_fields({"prompt": "p"}) == ["text"]
    assert spec.missing_fields({"prompt": "p", "text": "open"}) == []
    with pytest.raises(RewardConfigError, match="min_confidence must be in"):
        make_ocr_reward(min_confidence=1.5)
    with pytest.raises(RewardConfigError, match="target_field must be a dataset field name"):
        make_ocr_reward(target_field="")
