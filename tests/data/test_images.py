"""Prompts with images (groupflow.data.images through load_prompt_rows): every accepted shape,
resizing within the pixel budget, and bad images located by file, row and field."""

from __future__ import annotations

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from groupflow.data.datasets import load_prompt_rows
from groupflow.data.images import ImageLimits, load_image, prompt_images, resize_within
from groupflow.data.rows import DataError


def png(w=20, h=10, color=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def parts(row):
    return [[p["type"] for p in m["content"]] for m in row.prompt]


def test_hf_parts_with_relative_paths_and_openai_data_urls_load_as_rgb_images(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("L", (16, 8), 128).save(tmp_path / "img" / "a.png")  # grey: converted to RGB
    url = "data:image/png;base64," + base64.b64encode(png(12, 12, (0, 255, 0))).decode()
    rows = [
        {"prompt": [{"role": "user", "content": [
            {"type": "image", "image": "img/a.png"}, {"type": "text", "text": "what?"}]}],
         "answer": "grey"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "colour?"}, {"type": "image_url", "image_url": {"url": url}}]}],
         "answer": "green"},
    ]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_prompt_rows(path, images=ImageLimits(min_pixels=1, max_pixels=10_000))
    a, b = ds.rows
    assert parts(a) == [["image", "text"]] and parts(b) == [["text"], ["text", "image"]]
    img = prompt_images(a.prompt)[0]
    assert img.mode == "RGB" and img.size == (16, 8) and img.getpixel((0, 0)) == (128,) * 3
    assert prompt_images(b.prompt)[0].getpixel((3, 3)) == (0, 255, 0)
    assert a.fields["answer"] == "grey" and len(a.fields["images"]) == 1  # rewards may look


def test_verl_geo3k_parquet_rows_place_each_image_at_its_marker(tmp_path):
    row = {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "<image>Find x. Compare with <image> too."}],
        "images": [{"bytes": png(color=(1, 2, 3)), "path": None},
                   {"bytes": png(color=(4, 5, 6)), "path": "b.png"}],
        "reward_model": {"style": "rule", "ground_truth": "3"},
    }  # fmt: skip
    path = tmp_path / "geo3k.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    (r,) = load_prompt_rows(path, images=ImageLimits(min_pixels=1)).rows
    content = r.prompt[0]["content"]
    assert [p["type"] for p in content] == ["image", "text", "image", "text"]
    assert content[1]["text"] == "Find x. Compare with " and content[3]["text"] == " too."
    assert content[0]["image"].getpixel((0, 0)) == (1, 2, 3)
    assert content[2]["image"].getpixel((0, 0)) == (4, 5, 6)  # bytes win over the path
    assert "images" in r.fields and r.fields["ground_truth"] == "3"
    assert r.fields["data_source"] == "hiyouga/geometry3k"


def test_an_image_column_without_markers_opens_the_first_user_message_and_fills_bare_parts(
    tmp_path,
):
    Image.new("RGB", (9, 9)).save(tmp_path / "x.png")
    rows = [
        {"prompt": "How many?", "image": str(tmp_path / "x.png")},  # a string prompt -> chat
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                                 {"type": "image"}]}],
         "images": [png(), png()]},  # TRL's shape: bare parts filled in order
    ]  # fmt: skip
    a, b = load_prompt_rows(rows, images=ImageLimits(min_pixels=1)).rows
    assert a.prompt == [{"role": "user", "content": [a.prompt[0]["content"][0],
                                                     {"type": "text", "text": "How many?"}]}]  # fmt: skip
    assert parts(a) == [["image", "text"]] and "image" not in a.fields
    assert parts(b) == [["text", "image", "image"]]


def test_images_are_resized_into_the_pixel_budget_keeping_the_aspect_ratio():
    limits = ImageLimits(min_pixels=400, max_pixels=5000)
    big = resize_within(Image.new("RGB", (400, 200)), limits)
    assert big.size[0] * big.size[1] <= 5000 and big.size == (100, 50)
    small = resize_within(Image.new("RGB", (5, 10)), limits)
    assert small.size[0] * small.size[1] >= 400 and small.size == (15, 29)
    same = Image.new("RGB", (30, 30))
    assert resize_within(same, limits) is same
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        ImageLimits(min_pixels=10, max_pixels=5)


def test_a_hub_dataset_with_an_image_feature_loads_offline(tmp_path, monkeypatch, tiny_config_data):
    datasets = pytest.importorskip("datasets")
    from groupflow.assembly.data import build_data
    from groupflow.config import config_from_dict

    home = tmp_path / "hf"
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = home / "hub" / "datasets--acme--shapes"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    snap = repo / "snapshots" / ("a" * 40) / "data"
    snap.mkdir(parents=True)
    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "image": datasets.Image(),
        }  # fmt: skip
    )
    imgs = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(4)]
    ds = datasets.Dataset.from_dict(
        {"question": [f"q{i}" for i in range(4)], "answer": [str(i) for i in range(4)],
         "image": imgs}, features=features,
    )  # fmt: skip
    ds.to_parquet(str(snap / "train-00000-of-00001.parquet"))
    data = tiny_config_data()
    data["data"] = {"train_files": ["hf://acme/shapes"], "columns": {"prompt": "question"},
                    "min_pixels": 1, "max_pixels": 64, "prompts_per_step": 2}  # fmt: skip
    train, _, _ = build_data(config_from_dict(data))
    assert len(train) == 4 and parts(train[2]) == [["image", "text"]]
    img = prompt_images(train[2].prompt)[0]
    assert img.size == (8, 8) and img.getpixel((0, 0)) == (80, 0, 0)


# ----- bad images ----------------------------------------------------------------------------


def _bad(tmp_path, row, **limits):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": [{"role": "user", "content": [{"type": "text", "text": "ok"}]}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as err:
        load_prompt_rows(path, images=ImageLimits(**limits))
    skipped = load_prompt_rows(path, images=ImageLimits(**limits), on_bad_row="skip")
    assert len(skipped) == 1 and skipped.num_skipped == 1
    return err.value


def test_a_missing_image_file_names_the_file_row_and_field(tmp_path):
    err = _bad(tmp_path, {"prompt": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image", "image": "nope/x.png"}]}]})  # fmt: skip
    assert err.source == str(tmp_path / "bad.jsonl") and err.index == 1 and err.line == 2
    assert err.field == "prompt[0].content[1]"
    assert f"image file not found: {tmp_path / 'nope' / 'x.png'}" in str(err)


def test_unreadable_bytes_and_urls_are_errors_naming_the_column(tmp_path):
    bad_b64 = base64.b64encode(b"not an image").decode()
    err = _bad(tmp_path, {"prompt": "<image> x", "images": [bad_b64]})
    assert (
        err.field == "images[0]" and "image file not found" in err.reason
    )  # a bare string is a path
    err = _bad(tmp_path, {"prompt": "<image> x",
                          "images": ["data:image/png;base64," + bad_b64]})  # fmt: skip
    assert err.field == "images[0]" and "unreadable image" in err.reason
    err = _bad(tmp_path, {"prompt": "x", "images": ["https://example.com/a.png"]})
    assert "no network at run time" in err.reason


def test_an_oversized_image_and_a_marker_count_mismatch_are_errors(tmp_path):
    Image.new("RGB", (100, 100)).save(tmp_path / "big.png")
    err = _bad(tmp_path, {"prompt": "x", "images": ["big.png"]}, max_source_pixels=5000)
    assert err.field == "images[0]" and "10000 pixels, above the 5000" in err.reason
    Image.new("RGB", (1000, 2)).save(tmp_path / "thin.png")
    err = _bad(tmp_path, {"prompt": "x", "images": ["thin.png"]})
    assert "aspect ratio above 200" in err.reason
    err = _bad(tmp_path, {"prompt": "<image><image> two", "images": ["big.png"]})
    assert "asks for image 2 but column 'images' holds 1" in err.reason
    Image.new("RGB", (9, 9)).save(tmp_path / "s.png")
    err = _bad(tmp_path, {"prompt": "<image> one", "images": ["s.png", "s.png"]})
    assert err.field == "images" and "holds 2 images but the prompt places 1" in err.reason
    err = _bad(tmp_path, {"prompt": [{"role": "user", "content": [{"type": "video"}]}]})
    assert err.field == "prompt[0].content[0].type"


def test_load_image_accepts_every_value_shape(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    lim = ImageLimits(min_pixels=1)
    for value in (str(tmp_path / "a.png"), f"file://{tmp_path / 'a.png'}", png(4, 4),
                  {"bytes": None, "path": str(tmp_path / "a.png")}, Image.new("RGBA", (4, 4))):  # fmt: skip
        assert load_image(value, "f", None, lim).size == (4, 4)


def test_the_shapes_count_reward_gives_exact_and_near_credit():
    from groupflow.data.shapes import count_reward

    got = count_reward(["3", "2<eos>", " 4", "1", "x", ""], ["3", "3", "3", "3", "3", "3"])
    assert got == [1.0, 0.25, 0.25, 0.0, 0.0, 0.0]


def _png_header(w: int, h: int) -> bytes:
    """A PNG that declares w x h pixels in its header and holds no pixel data at all."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_from_its_header_before_decoding(tmp_path, monkeypatch):
    """12000 x 12000 declared (551 MB to decode): refused from the header, nothing decoded."""
    from PIL import ImageFile

    decoded = []
    original = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: decoded.append(self.size) or original(self))  # fmt: skip
    (tmp_path / "bomb.png").write_bytes(_png_header(12000, 12000))
    url = "data:image/png;base64," + base64.b64encode(_png_header(12000, 12000)).decode()
    for value in ("bomb.png", url):
        err = _bad(tmp_path, {"prompt": "x", "images": [value]})
        assert "12000x12000 = 144000000 pixels, above the 89478485" in err.reason
    assert decoded == []


def test_an_image_is_read_only_up_to_the_byte_cap(tmp_path):
    with open(tmp_path / "huge.png", "wb") as f:
        f.truncate(100 << 20)  # 100 MiB (sparse: no disk), not an image
    err = _bad(tmp_path, {"prompt": "x", "images": ["huge.png"]})
    assert "above the 67108864 an image may have (data.max_image_bytes)" in err.reason
    small = ImageLimits(max_file_bytes=1000, min_pixels=1)
    assert load_image(png(4, 4), "f", None, small).size == (4, 4)
    with pytest.raises(Exception, match="above the 1000"):
        load_image(png(4, 4) + b"\0" * 1000, "f", None, small)
    url = "data:image/png;base64," + base64.b64encode(b"\0" * 4000).decode()
    with pytest.raises(Exception, match="data: URL: 4000 bytes, above the 1000"):
        load_image(url, "f", None, small)


def test_image_paths_are_confined_to_the_dataset_folder_unless_data_image_dirs_allows(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    Image.new("RGB", (8, 8)).save(outside / "secret.png")
    (data / "link.png").symlink_to(outside / "secret.png")
    for value in ("../outside/secret.png", str(outside / "secret.png"), "link.png",
                  f"file://{outside / 'secret.png'}"):  # fmt: skip
        err = _bad(data, {"prompt": "x", "images": [value]})
        assert err.field == "images[0]" and "is outside" in err.reason
        assert "data.image_dirs" in err.reason
    path = data / "ok.jsonl"
    path.write_text(json.dumps({"prompt": "x", "images": ["../outside/secret.png"]}) + "\n")
    allowed = ImageLimits(min_pixels=1, image_dirs=(str(outside),))
    assert len(load_prompt_rows(path, images=allowed)) == 1
    # rows built in Python are the caller's own: not confined
    rows = load_prompt_rows([{"prompt": "x", "images": [str(outside / "secret.png")]}],
                            images=ImageLimits(min_pixels=1))  # fmt: skip
    assert len(rows) == 1
