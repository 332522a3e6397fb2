"""Device-side transforms on whole batches: a random translation equals pad-then-crop at the
drawn offsets (uint8 kept), the horizontal flip flips about half the batch and only left-right,
and normalizing uint8 equals the float host path."""

import torch
import torch.nn.functional as F

from trainer.data.transforms import normalize, random_flip, random_translate


def test_translate_equals_pad_then_crop_at_the_drawn_offsets():
    torch.manual_seed(0)
    x = torch.randint(0, 255, (16, 3, 8, 8), dtype=torch.uint8)
    torch.manual_seed(1)
    out = random_translate(x, 2)
    torch.manual_seed(1)
    dy = torch.randint(0, 5, (16,))
    dx = torch.randint(0, 5, (16,))
    padded = F.pad(x, (2, 2, 2, 2))
    expected = torch.stack([padded[i, :, dy[i]:dy[i] + 8, dx[i]:dx[i] + 8] for i in range(16)])
    assert torch.equal(out, expected)
    assert out.dtype == torch.uint8


def test_flip_flips_about_half_and_only_left_right():
    torch.manual_seed(0)
    x = torch.arange(2 * 1 * 2 * 3, dtype=torch.float32).view(2, 1, 2, 3).repeat(500, 1, 1, 1)
    out = random_flip(x)
    flipped = (out == x.flip(-1)).flatten(1).all(1)
    same = (out == x).flatten(1).all(1)
    assert bool((flipped | same).all())
    assert 0.4 < flipped.float().mean().item() < 0.6


def test_normalize_uint8_matches_float_path():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    a = normalize(x, mean, std)
    b = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.allclose(a, b, atol=1e-6)
