"""Process mode's byte views (`simdist.world.processes.transport`): a member's tensor is read from the gathered bytes in
place
where its offset allows the dtype's view, else from a copy; either way with its shape, strides and bits."""

from __future__ import annotations

import torch

from simdist.world.processes.transport import _aligned, _footprint, _from_footprint


def test_a_tensor_is_viewed_in_place_when_aligned_and_copied_when_not():
    wide = torch.tensor([1.5, -0.0, float("nan")], dtype=torch.float64)
    data, meta = _footprint(wide)
    for offset in (0, 8, 6):  # two aligned starts and one that float64 cannot be viewed at
        buffer = torch.zeros(offset + data.numel() + 8, dtype=torch.uint8)
        buffer[offset : offset + data.numel()] = data
        piece = _aligned(buffer[offset : offset + data.numel()], torch.float64)
        assert (piece.data_ptr() == buffer.data_ptr() + offset) == (offset % 8 == 0)
        back = _from_footprint(piece, meta)
        assert torch.equal(back.view(torch.int64), wide.view(torch.int64))


def test_a_strided_view_keeps_its_strides():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base[:, 1::2]
    data, meta = _footprint(view)
    back = _from_footprint(_aligned(data, torch.float32), meta)
    assert back.stride() == view.stride() and torch.equal(back, view)
