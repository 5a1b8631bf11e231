"""pruneflow.data: every source format, splitting, subsampling, preprocessing, augmentation, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pruneflow.data import DataBundle, Split, apply_augment, load_data
from pruneflow.errors import InputError
from pruneflow.recipe.models import AugmentSpec, DataSpec

# --------------------------------------------------------------------------- helpers


def _ids_npz(path, per_class=10, classes=3, hw=(6, 6), seed=0):
    """uint8 NHWC images whose first pixel (row 0, col 0, channel 0) holds the sample id; labels id % classes."""
    rng = np.random.default_rng(seed)
    n = per_class * classes
    images = rng.integers(0, 256, (n, *hw, 3), dtype=np.uint8)
    images[:, 0, 0, 0] = np.arange(n)
    labels = np.arange(n, dtype=np.int64) % classes
    np.savez(path, images=images, labels=labels, class_names=np.array([f"c{k}" for k in range(classes)]))
    return images, labels


def _ids(split: Split) -> list[int]:
    """Sample ids written by _ids_npz, read back from the preprocessed (x / 255, NCHW) tensor."""
    return [int(v) for v in torch.round(split.x[:, 0, 0, 0] * 255).tolist()]


def _table(n=12, classes=3):
    import pandas as pd

    return pd.DataFrame({"f0": np.arange(n, dtype=np.float64) / 2, "f1": np.arange(n) * 3, "label": np.arange(n) % classes})


def _write(df, path, fmt):
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "json":
        df.to_json(path, orient="records", lines=True)
    else:
        df.to_parquet(path)


def _shift(x, dy, dx, fill):
    """x shifted so that out[r, q] = x[r + dy, q + dx], ``fill`` (per channel) outside x."""
    c, h, w = x.shape
    out = fill.view(c, 1, 1).expand(c, h, w).clone()
    rs, re = max(0, -dy), min(h, h - dy)
    cs, ce = max(0, -dx), min(w, w - dx)
    out[:, rs:re, cs:ce] = x[:, rs + dy : re + dy, cs + dx : ce + dx]
    return out


# --------------------------------------------------------------------------- digits, npz, splitting


def test_digits_loads_scaled_stratified_split():
    b = load_data(DataSpec(format="digits"), seed=0)
    assert isinstance(b, DataBundle)
    assert len(b.train) + len(b.eval) == 1797
    assert len(b.eval) == 360  # ceil(0.2 * 1797)
    assert b.input_shape == (1, 8, 8) and b.train.x.shape[1:] == (1, 8, 8)
    assert b.num_classes == 10 and b.class_names == [str(i) for i in range(10)]
    # pixels are 0..16 scaled to 0..1 by _digits; `scale: auto` must leave float data alone
    assert b.eval.x.dtype == torch.float32 and b.eval.x.min() == 0 and b.train.x.max() == 1
    total = torch.bincount(b.train.y, minlength=10) + torch.bincount(b.eval.y, minlength=10)
    share = torch.bincount(b.eval.y, minlength=10).float()
    assert (share - 0.2 * total).abs().max() <= 1  # stratified: every class holds ~20 % of its samples out


def test_npz_path_split_is_stratified_disjoint_and_complete(tmp_path):
    images, labels = _ids_npz(tmp_path / "d.npz", per_class=10, classes=3)
    b = load_data(DataSpec(format="npz", path=str(tmp_path / "d.npz"), eval_fraction=0.2), seed=0)
    assert len(b.train) == 24 and len(b.eval) == 6
    assert torch.bincount(b.eval.y).tolist() == [2, 2, 2]
    assert torch.bincount(b.train.y).tolist() == [8, 8, 8]
    train_ids, eval_ids = _ids(b.train), _ids(b.eval)
    assert not set(train_ids) & set(eval_ids)
    assert sorted(train_ids + eval_ids) == list(range(30))
    # every sample keeps its own label and its own pixels
    assert [i % 3 for i in eval_ids] == b.eval.y.tolist()
    for row, i in zip(b.eval.x, eval_ids):
        assert torch.allclose(row, torch.from_numpy(images[i]).permute(2, 0, 1).float() / 255)
    assert b.class_names == ["c0", "c1", "c2"] and b.num_classes == 3
    assert b.input_shape == (3, 6, 6)
    assert b.description.startswith("npz:")


def test_split_same_seed_same_different_seed_different(tmp_path):
    _ids_npz(tmp_path / "d.npz", per_class=10, classes=3)
    spec = DataSpec(format="npz", path=str(tmp_path / "d.npz"), eval_fraction=0.3)
    a, again, other = load_data(spec, seed=0), load_data(spec, seed=0), load_data(spec, seed=1)
    assert _ids(a.eval) == _ids(again.eval) and _ids(a.train) == _ids(again.train)
    assert torch.equal(a.eval.x, again.eval.x)
    assert set(_ids(a.eval)) != set(_ids(other.eval))
    assert torch.bincount(other.eval.y).tolist() == [3, 3, 3]


def test_unstratifiable_split_still_splits(tmp_path):
    # one sample of class 2: stratification is impossible, the split falls back to a seeded random one
    x = np.arange(7, dtype=np.float32)[:, None]
    np.savez(tmp_path / "d.npz", x=x, label=np.array([0, 0, 0, 1, 1, 1, 2]))
    b = load_data(DataSpec(format="npz", path=str(tmp_path / "d.npz"), eval_fraction=0.3), seed=0)
    assert len(b.train) + len(b.eval) == 7 and len(b.eval) == 3
    assert b.num_classes == 3
    assert sorted(b.train.x[:, 0].tolist() + b.eval.x[:, 0].tolist()) == list(range(7))


def test_max_samples_are_stratified_seeded_subsets(tmp_path):
    _ids_npz(tmp_path / "d.npz", per_class=10, classes=3)
    full = load_data(DataSpec(format="npz", path=str(tmp_path / "d.npz")), seed=0)
    spec = DataSpec(format="npz", path=str(tmp_path / "d.npz"), max_train_samples=6, max_eval_samples=3)
    b = load_data(spec, seed=0)
    assert len(b.train) == 6 and len(b.eval) == 3
    assert torch.bincount(b.train.y).tolist() == [2, 2, 2]
    assert torch.bincount(b.eval.y).tolist() == [1, 1, 1]
    assert set(_ids(b.train)) <= set(_ids(full.train)) and set(_ids(b.eval)) <= set(_ids(full.eval))
    assert _ids(load_data(spec, seed=0).train) == _ids(b.train)
    # a limit above the size changes nothing
    big = load_data(DataSpec(format="npz", path=str(tmp_path / "d.npz"), max_train_samples=1000, max_eval_samples=1000), seed=0)
    assert _ids(big.train) == _ids(full.train) and _ids(big.eval) == _ids(full.eval)


def test_max_eval_samples_on_separate_eval(tmp_path):
    _ids_npz(tmp_path / "e.npz", per_class=4, classes=2)
    b = load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz"), max_eval_samples=4), seed=0)
    assert b.train is None and len(b.eval) == 4
    assert torch.bincount(b.eval.y).tolist() == [2, 2]


# --------------------------------------------------------------------------- preprocessing


def test_uint8_auto_scale_and_nhwc_to_nchw_keep_order(tmp_path):
    images, labels = _ids_npz(tmp_path / "e.npz", per_class=3, classes=2, hw=(5, 7))
    b = load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz")), seed=0)
    assert b.train is None
    assert b.eval.x.shape == (6, 3, 5, 7) and b.input_shape == (3, 5, 7)
    expected = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(b.eval.x, expected, atol=1e-7)
    assert b.eval.y.tolist() == labels.tolist() and b.eval.y.dtype == torch.int64


def test_float_inputs_are_not_rescaled_and_explicit_scale_applies(tmp_path):
    x = np.linspace(-3, 300, 4 * 3 * 2 * 5, dtype=np.float32).reshape(4, 3, 2, 5)
    np.savez(tmp_path / "e.npz", x=x, y=np.array([0, 1, 0, 1]))
    auto = load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz")), seed=0)
    assert torch.equal(auto.eval.x, torch.from_numpy(x))  # float, channels-first: untouched
    assert auto.eval.y.tolist() == [0, 1, 0, 1]  # `y` is a label fallback
    half = load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz"), scale=0.5), seed=0)
    assert torch.allclose(half.eval.x, torch.from_numpy(x) * 0.5)
    u8 = (np.arange(24) * 10).astype(np.uint8).reshape(4, 6)
    np.savez(tmp_path / "u.npz", x=u8, label=np.array([0, 1, 0, 1]))
    assert torch.allclose(load_data(DataSpec(format="npz", eval=str(tmp_path / "u.npz"), scale=1.0), seed=0).eval.x, torch.from_numpy(u8).float())


def test_layouts(tmp_path):
    x = np.arange(2 * 4 * 5 * 3, dtype=np.float32).reshape(2, 4, 5, 3)  # ambiguous: H=4 is also a channel count
    np.savez(tmp_path / "e.npz", x=x, label=np.array([0, 1]))
    path = str(tmp_path / "e.npz")
    assert load_data(DataSpec(format="npz", eval=path), seed=0).eval.x.shape == (2, 4, 5, 3)
    nhwc = load_data(DataSpec(format="npz", eval=path, layout="nhwc"), seed=0).eval.x
    assert torch.equal(nhwc, torch.from_numpy(x).permute(0, 3, 1, 2))
    np.savez(tmp_path / "hwc.npz", x=np.zeros((2, 6, 6, 3), np.float32), label=np.array([0, 1]))
    assert load_data(DataSpec(format="npz", eval=str(tmp_path / "hwc.npz")), seed=0).eval.x.shape == (2, 3, 6, 6)
    assert load_data(DataSpec(format="npz", eval=str(tmp_path / "hwc.npz"), layout="nchw"), seed=0).eval.x.shape == (2, 6, 6, 3)
    np.savez(tmp_path / "gray.npz", x=np.zeros((2, 8, 8), np.uint8), label=np.array([0, 1]))
    gray = load_data(DataSpec(format="npz", eval=str(tmp_path / "gray.npz")), seed=0)
    assert gray.eval.x.shape == (2, 1, 8, 8) and gray.input_shape == (1, 8, 8)


def test_mean_std_normalisation_and_pad_value(tmp_path):
    images, _ = _ids_npz(tmp_path / "e.npz", per_class=2, classes=2)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    b = load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz"), mean=mean, std=std), seed=0)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    expected = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - m) / s
    assert torch.allclose(b.eval.x, expected, atol=1e-5)
    # the crop padding fill is what a raw 0 pixel becomes
    assert torch.allclose(b.pad_value, -torch.tensor(mean) / torch.tensor(std))
    assert load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz")), seed=0).pad_value is None


def test_mean_with_wrong_channel_count_is_input_error(tmp_path):
    _ids_npz(tmp_path / "e.npz", per_class=2, classes=2)
    with pytest.raises(InputError, match=r"data\.mean has 1 values but the inputs have 3 channels"):
        load_data(DataSpec(format="npz", eval=str(tmp_path / "e.npz"), mean=[0.5], std=[0.5]), seed=0)


# --------------------------------------------------------------------------- csv / json / parquet


@pytest.mark.parametrize("fmt,suffix", [("csv", "csv"), ("json", "jsonl"), ("parquet", "parquet")])
def test_tabular_separate_train_and_eval(tmp_path, fmt, suffix):
    df = _table(12)
    _write(df.iloc[:8], tmp_path / f"train.{suffix}", fmt)
    _write(df.iloc[8:], tmp_path / f"eval.{suffix}", fmt)
    spec = DataSpec(format=fmt, train=str(tmp_path / f"train.{suffix}"), eval=str(tmp_path / f"eval.{suffix}"))
    b = load_data(spec, seed=0)
    # no image column: every numeric non-label column is stacked into one feature vector, rows in file order
    assert torch.allclose(b.train.x, torch.tensor(df[["f0", "f1"]].values[:8], dtype=torch.float32))
    assert torch.allclose(b.eval.x, torch.tensor(df[["f0", "f1"]].values[8:], dtype=torch.float32))
    assert b.train.y.tolist() == df.label.tolist()[:8] and b.eval.y.tolist() == df.label.tolist()[8:]
    assert b.num_classes == 3 and b.input_shape == (2,)
    # with_train=False skips reading the training source
    assert load_data(spec, seed=0, with_train=False).train is None


@pytest.mark.parametrize("fmt,suffix", [("csv", "csv"), ("parquet", "parquet")])
def test_tabular_path_split(tmp_path, fmt, suffix):
    df = _table(30)
    _write(df, tmp_path / f"all.{suffix}", fmt)
    b = load_data(DataSpec(format=fmt, path=str(tmp_path / f"all.{suffix}"), eval_fraction=0.2), seed=0)
    assert len(b.train) == 24 and len(b.eval) == 6
    assert torch.bincount(b.eval.y).tolist() == [2, 2, 2]
    rows = sorted(map(tuple, torch.cat([b.train.x, b.eval.x]).tolist()))
    assert rows == sorted(map(tuple, df[["f0", "f1"]].values.astype(np.float32).tolist()))
    assert b.class_names == ["0", "1", "2"]


def test_csv_folder_and_input_columns(tmp_path):
    df = _table(12)
    (tmp_path / "dir").mkdir()
    df.iloc[:6].to_csv(tmp_path / "dir" / "a.csv", index=False)
    df.iloc[6:].to_csv(tmp_path / "dir" / "b.csv", index=False)
    b = load_data(DataSpec(format="csv", eval=str(tmp_path / "dir"), input_column=["f1", "f0"]), seed=0)
    assert torch.allclose(b.eval.x, torch.tensor(df[["f1", "f0"]].values, dtype=torch.float32))
    one = load_data(DataSpec(format="csv", eval=str(tmp_path / "dir"), input_column="f1"), seed=0)
    assert one.eval.x.shape == (12, 1) and one.input_shape == (1,)
    assert one.eval.x[:, 0].tolist() == df.f1.astype(float).tolist()


# --------------------------------------------------------------------------- imagefolder, disk


def _image_folder(root, sizes=None):
    from PIL import Image

    for k, cls in enumerate(["cat", "dog"]):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            size = sizes[i] if sizes else (5, 7)
            Image.fromarray(np.full((*size, 3), 100 * k + 10 * i, np.uint8)).save(root / cls / f"{i}.png")


def test_imagefolder_split_labels_and_pixels(tmp_path):
    _image_folder(tmp_path / "imgs")
    b = load_data(DataSpec(format="imagefolder", path=str(tmp_path / "imgs"), eval_fraction=0.5), seed=0)
    assert b.class_names == ["cat", "dog"] and b.num_classes == 2
    assert b.train.x.shape == (4, 3, 5, 7) and b.eval.x.shape == (4, 3, 5, 7)
    assert torch.bincount(b.eval.y).tolist() == [2, 2]
    for split in (b.train, b.eval):
        for x, y in zip(split.x, split.y):
            value = round(float(x[0, 0, 0]) * 255)
            assert torch.all(x == x[0, 0, 0])  # solid colour survives scaling and layout
            assert value // 100 == int(y)  # the colour encodes the class folder


def test_imagefolder_resize_small_height_is_channels_first(tmp_path):
    # H=4 is also a channel count: decoded images must still be treated as NHWC
    _image_folder(tmp_path / "imgs")
    b = load_data(DataSpec(format="imagefolder", path=str(tmp_path / "imgs"), eval_fraction=0.5, image_size=[4, 6]), seed=0)
    assert b.eval.x.shape == (4, 3, 4, 6) and b.input_shape == (3, 4, 6)


def test_imagefolder_mixed_sizes_need_image_size(tmp_path):
    _image_folder(tmp_path / "imgs", sizes=[(5, 7), (6, 7), (5, 7), (5, 7)])
    with pytest.raises(InputError, match="image_size"):
        load_data(DataSpec(format="imagefolder", path=str(tmp_path / "imgs"), eval_fraction=0.5), seed=0)
    b = load_data(DataSpec(format="imagefolder", path=str(tmp_path / "imgs"), eval_fraction=0.5, image_size=[5, 5]), seed=0)
    assert b.eval.x.shape[1:] == (3, 5, 5)


def _disk_dataset(n=10):
    import datasets

    return datasets.Dataset.from_dict({"x": np.arange(2 * n, dtype=np.float32).reshape(n, 2).tolist(), "label": [0, 1] * (n // 2)})


def test_disk_single_split_is_split(tmp_path):
    _disk_dataset(10).save_to_disk(str(tmp_path / "ds"))
    b = load_data(DataSpec(format="disk", path=str(tmp_path / "ds"), eval_fraction=0.4), seed=0)
    assert len(b.train) == 6 and len(b.eval) == 4
    assert torch.bincount(b.eval.y).tolist() == [2, 2]
    assert sorted(torch.cat([b.train.x, b.eval.x])[:, 0].tolist()) == list(range(0, 20, 2))


def test_disk_dataset_dict_uses_its_splits(tmp_path):
    import datasets

    ds = _disk_dataset(10)
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(4))}).save_to_disk(str(tmp_path / "dd"))
    b = load_data(DataSpec(format="disk", path=str(tmp_path / "dd")), seed=0)
    assert len(b.train) == 10 and len(b.eval) == 4
    assert b.eval.x.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    # the same folder is not a single split: data.train must not silently take a (train, eval) pair
    ds.save_to_disk(str(tmp_path / "single"))
    with pytest.raises(InputError, match=r"data\.train: .* holds splits \['train', 'validation'\]"):
        load_data(DataSpec(format="disk", train=str(tmp_path / "dd"), eval=str(tmp_path / "single")), seed=0)
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(InputError, match=r"data\.path: .* holds splits \['a', 'b'\]; expected `train`"):
        load_data(DataSpec(format="disk", path=str(tmp_path / "ab")), seed=0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("field", ["path", "train", "eval"])
def test_missing_file_names_the_field(tmp_path, field):
    missing = str(tmp_path / "nope.npz")
    kwargs = {field: missing}
    if field == "train":
        kwargs["eval"] = missing
    with pytest.raises(InputError, match=rf"data\.{field}: file not found: .*nope\.npz"):
        load_data(DataSpec(format="npz", **kwargs), seed=0)


def test_empty_sources_are_input_errors(tmp_path):
    import pandas as pd

    np.savez(tmp_path / "e.npz", x=np.zeros((0, 3), np.float32), label=np.zeros(0, np.int64))
    (tmp_path / "e.csv").write_text("f0,label\n")
    pd.DataFrame({"f0": np.zeros(0), "label": np.zeros(0, np.int64)}).to_parquet(tmp_path / "e.parquet")
    (tmp_path / "e.jsonl").write_text("")
    for fmt, name in [("npz", "e.npz"), ("csv", "e.csv"), ("parquet", "e.parquet"), ("json", "e.jsonl")]:
        with pytest.raises(InputError, match=r"data\.eval: .* holds no rows \(empty dataset\)"):
            load_data(DataSpec(format=fmt, eval=str(tmp_path / name)), seed=0)
    (tmp_path / "nocsv").mkdir()
    with pytest.raises(InputError, match=r"data\.path: no \*\.csv files in folder"):
        load_data(DataSpec(format="csv", path=str(tmp_path / "nocsv")), seed=0)


def test_unreadable_file_is_input_error(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    with pytest.raises(InputError, match=r"data\.path: could not read .*bad\.parquet as parquet"):
        load_data(DataSpec(format="parquet", path=str(tmp_path / "bad.parquet")), seed=0)


def test_missing_label_column_names_field_and_columns(tmp_path):
    _table(6).iloc[:, :2].to_csv(tmp_path / "t.csv", index=False)  # f0, f1: no label
    for kwargs in ({"path": str(tmp_path / "t.csv")}, {"eval": str(tmp_path / "t.csv")}):
        with pytest.raises(InputError, match=r"data\.label_column: no column 'label' in the data; columns are f0, f1") as info:
            load_data(DataSpec(format="csv", **kwargs), seed=0)
        assert "data.label_column" in info.value.hint
    _table(6).to_csv(tmp_path / "full.csv", index=False)
    with pytest.raises(InputError, match=r"no column 'cls'"):
        load_data(DataSpec(format="csv", eval=str(tmp_path / "full.csv"), label_column="cls"), seed=0)


def test_missing_input_column_names_field(tmp_path):
    _table(6).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(InputError, match=r"data\.input_column: no column 'nope'; columns are f0, f1, label"):
        load_data(DataSpec(format="csv", eval=str(tmp_path / "t.csv"), input_column=["f0", "nope"]), seed=0)


def test_non_integer_labels_are_input_errors(tmp_path):
    import pandas as pd

    pd.DataFrame({"f0": [1.0, 2.0, 3.0, 4.0], "label": ["cat", "dog", "cat", "dog"]}).to_csv(tmp_path / "s.csv", index=False)
    for kwargs in ({"path": str(tmp_path / "s.csv")}, {"eval": str(tmp_path / "s.csv")}):
        with pytest.raises(InputError, match=r"data\.label_column 'label' must hold integer class ids"):
            load_data(DataSpec(format="csv", **kwargs), seed=0)


# --------------------------------------------------------------------------- augmentation


def test_random_crop_keeps_shape_and_is_a_shifted_copy():
    p = 2
    x = torch.arange(16 * 2 * 5 * 6, dtype=torch.float32).reshape(16, 2, 5, 6)
    before = x.clone()
    fill = torch.tensor([-1.0, -2.0])
    out = apply_augment(x, AugmentSpec(crop_padding=p), torch.Generator().manual_seed(0), fill)
    assert out.shape == x.shape
    assert torch.equal(x, before)  # the input batch is not modified
    offsets = []
    for i in range(len(x)):
        found = [(dy, dx) for dy in range(-p, p + 1) for dx in range(-p, p + 1) if torch.equal(out[i], _shift(x[i], dy, dx, fill))]
        assert len(found) == 1, f"sample {i} is not a shifted copy of its input"
        offsets.append(found[0])
    assert len(set(offsets)) > 3  # offsets are drawn per sample
    # same generator seed, same crops; another seed, other crops
    again = apply_augment(x, AugmentSpec(crop_padding=p), torch.Generator().manual_seed(0), fill)
    other = apply_augment(x, AugmentSpec(crop_padding=p), torch.Generator().manual_seed(1), fill)
    assert torch.equal(out, again) and not torch.equal(out, other)


def test_random_crop_pads_with_zero_without_pad_value():
    x = torch.ones(32, 1, 3, 3)
    out = apply_augment(x, AugmentSpec(crop_padding=1), torch.Generator().manual_seed(0), None)
    assert set(out.unique().tolist()) == {0.0, 1.0}
    # the centre pixel is inside the image for every offset of at most 1
    assert torch.all(out[:, :, 1, 1] == 1)


def test_hflip_flips_about_half_and_keeps_input():
    x = torch.arange(64 * 1 * 2 * 3, dtype=torch.float32).reshape(64, 1, 2, 3)
    before = x.clone()
    out = apply_augment(x, AugmentSpec(hflip=True), torch.Generator().manual_seed(0), None)
    assert torch.equal(x, before)
    flipped = [torch.equal(o, xi.flip(-1)) for o, xi in zip(out, x)]
    kept = [torch.equal(o, xi) for o, xi in zip(out, x)]
    assert all(f != k for f, k in zip(flipped, kept))  # each sample is exactly one of the two
    assert 16 <= sum(flipped) <= 48


def test_crop_and_flip_together_and_no_op_cases():
    x = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    out = apply_augment(x, AugmentSpec(crop_padding=1, hflip=True), torch.Generator().manual_seed(0), None)
    assert out.shape == x.shape
    assert torch.equal(apply_augment(x, AugmentSpec(), torch.Generator(), None), x)
    flat = torch.randn(4, 5)
    assert torch.equal(apply_augment(flat, AugmentSpec(crop_padding=2, hflip=True), torch.Generator(), None), flat)


def test_train_batches_cover_each_sample_once(tmp_path):
    _ids_npz(tmp_path / "d.npz", per_class=10, classes=3)
    b = load_data(DataSpec(format="npz", path=str(tmp_path / "d.npz"), augment={"crop_padding": 1, "hflip": True}), seed=0)
    assert b.augment.crop_padding == 1 and b.augment.hflip
    seen = []
    for x, y in b.train_batches(7, torch.Generator().manual_seed(0), augment=False):
        assert len(x) == len(y) <= 7
        seen += [int(v) for v in torch.round(x[:, 0, 0, 0] * 255).tolist()]
    assert sorted(seen) == sorted(_ids(b.train))
    shapes = {tuple(x.shape[1:]) for x, _ in b.train_batches(7, torch.Generator().manual_seed(0))}
    assert shapes == {(3, 6, 6)}
    assert sum(len(y) for _, y in b.eval.batches(4)) == len(b.eval)
    no_train = DataBundle(train=None, eval=b.eval, num_classes=3, input_shape=(3, 6, 6))
    with pytest.raises(InputError, match="no training split"):
        next(no_train.train_batches(4, torch.Generator()))
