"""Image classification pieces on one process: models, data, augmentation, SyncBN's math."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.estimate.vision import batchnorm_traffic
from plait.models.resnet.model import build_resnet
from plait.models.resnet.config import ResNetConfig, get_resnet
from plait.parallel.recompute import apply_recompute
from plait.parallel.data.syncbn import convert_sync_batchnorm, sync_bn_wire_bytes
from plait.runtime.comm import Axis, Ledger
from plait.families import family_of
from plait.train.config.settings import TrainConfig, validate
from plait.train.data.images import image_splits, load_images

TINY = ResNetConfig("basic", (1, 1), width=4, in_channels=1, num_classes=10)


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


@pytest.mark.parametrize("name, params", [("resnet18", 11_173_962), ("resnet34", 21_282_122),
                                          ("resnet50", 23_520_842)])
def test_presets_have_the_published_cifar_sizes(name, params):
    # The CIFAR-10 ports of He et al.'s networks (3×3 stem, no max-pool) have these counts.
    with torch.device("meta"):
        model = build_resnet(get_resnet(name, in_channels=3, num_classes=10), 0)
    assert sum(p.numel() for p in model.parameters()) == params


def checked(config: TrainConfig) -> None:
    """`plait train`'s checks of `config` before it spawns."""
    validate(config, family_of(config))


def test_model_names_are_checked():
    assert get_resnet("resnet18,width=16").width == 16
    with pytest.raises(PlaitError, match="'depth=3' is not width=N"):
        get_resnet("resnet18,depth=3")
    with pytest.raises(PlaitError, match="trained data-parallel only"):
        checked(TrainConfig(model="resnet18", data="digits", tp=2, nproc=2, dp=1, out="/tmp/plait-vision-check"))


def test_digits_split_is_fixed_and_augmentation_is_per_sample():
    data = load_images("digits")
    assert tuple(data.images.shape) == (1797, 1, 8, 8) and len(data.classes) == 10
    train, val = image_splits(data, "auto", seed=3)
    assert (train.num_samples, val.num_samples) == (1618, 179)
    assert train.augment == "crop" and val.augment == "none"
    assert set(train.indices.tolist()).isdisjoint(val.indices.tolist())
    # The same samples at the same step are augmented alike however they are grouped.
    whole, _ = train.batch([5, 9, 11, 40], step=7)
    parts = torch.cat([train.batch([5, 9], step=7)[0], train.batch([11, 40], step=7)[0]])
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, train.batch([5, 9, 11, 40], step=8)[0])  # another step, other crops
    assert torch.equal(val.batch([0, 1])[0], data.images[val.indices[:2]])  # validation: as stored


def test_digits_are_read_from_the_shipped_file_as_scikit_learn_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file read directly (no scikit-learn import: 1.8 s a rank), or, were it moved,
    through load_digits: the same table either way."""
    from pathlib import Path

    from sklearn.datasets import load_digits

    from plait.train.data.images import _digits_table

    bunch = load_digits()
    direct = _digits_table()
    assert direct.shape == (1797, 65)
    assert (direct[:, :-1] == bunch.data).all() and (direct[:, -1] == bunch.target).all()
    monkeypatch.setattr(Path, "is_file", lambda self: False)  # the shipped file moved
    assert (_digits_table() == direct).all()
    assert load_images("digits").labels.tolist() == bunch.target.tolist()


def test_an_image_folder_is_read_with_its_class_names(tmp_path):
    from PIL import Image

    for k, name in enumerate(["cat", "dog"]):
        (tmp_path / name).mkdir()
        for i in range(3):
            Image.new("RGB", (12, 9), (40 * k + i, 10, 200)).save(tmp_path / name / f"{i}.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    data = load_images(str(tmp_path))
    assert data.classes == ("cat", "dog") and tuple(data.images.shape) == (6, 3, 32, 32)
    assert data.labels.tolist() == [0, 0, 0, 1, 1, 1] and data.default_augment == "crop,flip"
    with pytest.raises(PlaitError, match="neither 'digits' nor a directory"):
        load_images(str(tmp_path / "missing"))


def _one_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_sync_bn_on_one_rank_is_batchnorm():
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(6, 1, 8, 8, generator=generator) * 3 + 2, torch.randint(0, 10, (6,), generator=generator)
    plain = build_resnet(TINY, 0)
    synced = copy.deepcopy(plain)
    assert convert_sync_batchnorm(synced, Axis("dp", 1, 0, None, Ledger())) == 6
    loss, grads = _one_step(plain, images, labels)
    loss_s, grads_s = _one_step(synced, images, labels)
    assert loss_s == pytest.approx(loss, rel=1e-6)
    for a, b in zip(grads_s, grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    for (name, a), (_, b) in zip(synced.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_recomputation_updates_running_statistics_once():
    images, labels = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    plain, recomputed = build_resnet(TINY, 0), build_resnet(TINY, 0)
    assert apply_recompute(recomputed) == 2
    loss, grads = _one_step(plain, images, labels)
    loss_r, grads_r = _one_step(recomputed, images, labels)
    assert loss_r == loss and all(torch.equal(a, b) for a, b in zip(grads_r, grads))
    for (name, a), (_, b) in zip(recomputed.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name  # num_batches_tracked is 1, not 2


def test_batchnorm_traffic_formula():
    forward, backward = sync_bn_wire_bytes(64, 4)
    assert (forward, backward) == (1.5 * 129 * 4, 1.5 * 128 * 4)
    assert batchnorm_traffic([64, 32], 4, 2, sync_bn=True) == {
        "dp": {"all_reduce": 2 * (1.5 * (129 + 128) * 4 + 1.5 * (65 + 64) * 4)}}
    assert batchnorm_traffic([64, 32], 4, 2, sync_bn=False) == {"dp": {"broadcast": (8 * 64 + 8) + (8 * 32 + 8)}}
    assert batchnorm_traffic([64], 1, 1, sync_bn=True) == {}


def test_sync_bn_is_refused_for_a_model_without_batchnorm():
    with pytest.raises(PlaitError, match="--sync-bn shares BatchNorm statistics, and --model tiny has no BatchNorm"):
        checked(TrainConfig(model="tiny", sync_bn=True, nproc=2, dp=2, out="/tmp/plait-vision-check"))


def test_sync_bn_under_accumulation_on_data_ranks_is_refused():
    """Each rank's k-th micro-batch normalised together is no one-process grouping; with one
    data rank, or without accumulation, the same flags are the one-process run."""
    resnet = dict(model="resnet18,width=4", data="digits", sync_bn=True, out="/tmp/plait-vision-check")
    with pytest.raises(PlaitError, match="--sync-bn with --grad-accum 2 on dp=2 would normalise each rank's k-th"):
        checked(TrainConfig(**resnet, nproc=2, dp=2, micro_batch=16, grad_accum=2))
    checked(TrainConfig(**resnet, nproc=2, dp=2, micro_batch=32, grad_accum=1))
    checked(TrainConfig(**resnet, nproc=1, dp=1, micro_batch=16, grad_accum=2))


def test_without_the_vision_extra_one_line_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from plait.train.data.images import load_images

    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if scikit-learn were missing
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(PlaitError, match="--data digits needs the scikit-learn package") as err:
        load_images("digits")
    assert "plait[vision]" in err.value.hint


def test_the_estimate_counts_every_batchnorm_of_the_model() -> None:
    """plait/estimate/vision.py names the BatchNorm layers from the shape alone, as the model builds them."""
    from torch import nn

    from plait.estimate.vision import batchnorm_channels

    for name in ("resnet18,width=8", "resnet50,width=4"):
        config = get_resnet(name, in_channels=1, num_classes=10)
        built = [m.num_features for m in build_resnet(config, 0).modules() if isinstance(m, nn.BatchNorm2d)]
        assert batchnorm_channels(config) == built
