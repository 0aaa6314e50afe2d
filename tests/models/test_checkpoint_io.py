"""The checkpoint reader the live refits use (``models.checkpoint.read_safetensors``: one host
buffer filled by ``readinto``, the tensors views of it) against the safetensors library's own
loader, on every dtype, unaligned offsets and broken files; and ``device_copies`` (the buffer
moved as one copy, then viewed and converted) against per-tensor ``.to``."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamgr.errors import CheckpointError
from streamgr.models.checkpoint import HostStaging, device_copies, read_safetensors


def _tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(7, 5, generator=g),
            "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "c": torch.randn(2, 3, 4, generator=g).to(torch.float16),
            "d": torch.randint(-9, 9, (5,), generator=g),
            "e": torch.randint(0, 2, (4,), generator=g).bool(),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4)}


def _raw_file(path, entries: dict, data: bytes) -> None:
    """A safetensors file written by hand (the library keeps every tensor aligned)."""
    head = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_reads_equal_the_safetensors_loader(tmp_path):
    staging = HostStaging(pin=False)
    for seed in (0, 1):
        want = _tensors(seed)
        save_file(want, str(tmp_path / f"{seed}.safetensors"), metadata={"format": "pt"})
        ref = load_file(str(tmp_path / f"{seed}.safetensors"))
        got, buf = read_safetensors(tmp_path / f"{seed}.safetensors", staging)
        assert set(got) == set(ref)
        for k, t in ref.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t)
        assert buf.data_ptr() == staging._buf.data_ptr()  # the staging buffer, reused


def test_unaligned_offsets_are_copied_not_misread(tmp_path):
    """An fp32 tensor at an odd byte offset (legal in the format) reads as its values."""
    x, y = torch.arange(3, dtype=torch.uint8), torch.tensor([1.5, -2.25], dtype=torch.float32)
    _raw_file(tmp_path / "u.safetensors",
              {"x": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
               "y": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}},
              x.numpy().tobytes() + y.numpy().tobytes())
    got, _ = read_safetensors(tmp_path / "u.safetensors")
    assert torch.equal(got["x"], x) and torch.equal(got["y"], y)


def test_tensors_start_aligned_in_the_buffer(tmp_path):
    """The format packs tensors back to back: after a one-element bf16 (rank's head bias)
    every later tensor sits 2 bytes off 16 in the file. In the buffer each starts at a
    multiple of ``ALIGN`` (the GPU kernels' vector loads need 16), with its values."""
    from streamgr.models.checkpoint import ALIGN
    want = {"a.bias": torch.tensor([0.5], dtype=torch.bfloat16),
            "b.weight": torch.randn(3, 8).to(torch.bfloat16),
            "c.weight": torch.randn(5).to(torch.bfloat16), "d": torch.randn(4, 4)}
    save_file(want, str(tmp_path / "m.safetensors"))
    got, buf = read_safetensors(tmp_path / "m.safetensors", HostStaging(pin=False))
    for k, t in want.items():
        assert (got[k].data_ptr() - buf.data_ptr()) % ALIGN == 0, k
        assert torch.equal(got[k], t), k


def test_overlapping_tensors_are_refused(tmp_path):
    _raw_file(tmp_path / "o.safetensors",
              {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))
    with pytest.raises(CheckpointError, match="overlaps"):
        read_safetensors(tmp_path / "o.safetensors")


@pytest.mark.parametrize("case", ["truncated", "header_past_end", "offsets_past_end",
                                  "shape_mismatch", "unknown_dtype", "not_json", "not_object",
                                  "empty_file"])
def test_broken_files_raise_checkpoint_errors(tmp_path, case):
    p = tmp_path / "w.safetensors"
    good = {"y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data = bytes(8)
    if case == "truncated":
        _raw_file(p, good, data)
        p.write_bytes(p.read_bytes()[:-3])
        good = None
    elif case == "header_past_end":
        p.write_bytes(struct.pack("<Q", 1 << 30) + b"{}")
    elif case == "offsets_past_end":
        _raw_file(p, {"y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, data)
    elif case == "shape_mismatch":
        _raw_file(p, {"y": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, data)
    elif case == "unknown_dtype":
        _raw_file(p, {"y": {"dtype": "F8_E9", "shape": [2], "data_offsets": [0, 8]}}, data)
    elif case == "not_json":
        p.write_bytes(struct.pack("<Q", 4) + b"{{{{" + data)
    elif case == "not_object":
        p.write_bytes(struct.pack("<Q", 2) + b"[]" + data)
    else:
        p.write_bytes(b"")
    with pytest.raises(CheckpointError, match="w.safetensors"):
        read_safetensors(p)


def _check_device_copies(tmp_path, device, pin: bool):
    want = _tensors(3)
    save_file(want, str(tmp_path / "m.safetensors"))
    staging = HostStaging(pin=pin)
    got, buf = read_safetensors(tmp_path / "m.safetensors", staging)
    dtypes = {k: (torch.bfloat16 if t.is_floating_point() else t.dtype) for k, t in want.items()}
    moved = device_copies(got, buf, device, dtypes, staging)
    # the next read waits for the copy out of the buffer (an event on CUDA), then reuses it
    again, buf2 = read_safetensors(tmp_path / "m.safetensors", staging)
    assert buf2.data_ptr() == buf.data_ptr() and staging._event is None
    torch.cuda.synchronize() if device.type == "cuda" else None
    for k, t in want.items():
        ref = t.to(device=device, dtype=dtypes[k])
        assert moved[k].device == ref.device and moved[k].dtype == ref.dtype
        assert torch.equal(moved[k], ref), k
    # a tensor that is not a view of the buffer moves on its own
    lone = dict(got, extra=torch.ones(3))
    assert torch.equal(device_copies(lone, buf, device, {"extra": torch.float16})["extra"],
                       torch.ones(3, dtype=torch.float16, device=device))


def test_device_copies_equal_per_tensor_moves_cpu(tmp_path):
    _check_device_copies(tmp_path, torch.device("cpu"), pin=False)


@pytest.mark.gpu
def test_device_copies_equal_per_tensor_moves_cuda_from_pinned(tmp_path):
    stream = torch.cuda.Stream()  # off the default stream, as a refit's build runs
    with torch.cuda.stream(stream):
        _check_device_copies(tmp_path, torch.device("cuda"), pin=True)


def test_a_buffer_sized_ahead_holds_an_fp32_checkpoint(tmp_path):
    """The refit buffer an engine pins at start (``fp32_checkpoint_bytes``) holds an fp32
    checkpoint of its model as ``read_safetensors`` lays it out (each tensor at an ``ALIGN``
    boundary): the first refit reads into it instead of pinning a bigger one beside serving
    (session 15: sized by the file's bytes alone, it was 0.3% short and re-pinned)."""
    from streamgr.models.checkpoint import fp32_checkpoint_bytes
    want = {k: t.float() for k, t in _tensors(5).items() if t.is_floating_point()}
    want.update({"one": torch.tensor([1.0]), "odd": torch.randn(3, 7)})
    save_file(want, str(tmp_path / "m.safetensors"))
    staging = HostStaging(pin=False)
    ahead = staging.take(fp32_checkpoint_bytes(want.values()))
    _, buf = read_safetensors(tmp_path / "m.safetensors", staging)
    assert buf.data_ptr() == ahead.data_ptr() and staging._buf.numel() == ahead.numel()


def test_check_finite_names_the_first_tensor_holding_nan_or_inf():
    from streamgr.models.checkpoint import check_finite
    t = _tensors(3)
    check_finite(t, "ok")  # integer and bool tensors are not looked at
    for bad in (float("inf"), float("-inf"), float("nan")):
        broken = dict(t)
        broken["c"] = t["c"].clone()
        broken["c"][1, 2, 3] = bad
        with pytest.raises(CheckpointError, match=r"^x: tensor `c` holds NaN or infinite"):
            check_finite(broken, "x")
    check_finite({"i": torch.arange(3)}, "ints only")


def test_saved_weights_are_readable_as_the_umask_allows(tmp_path):
    """safetensors >= 0.8 creates its file 0600 whatever the umask: a checkpoint written by
    ``streamgr init-model`` as one user (a Docker build) could not be served as another. The
    weights now take config.json's mode; an existing file's mode is kept on overwrite."""
    from streamgr.models.hstu import HSTUConfig
    from streamgr.models.checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_checkpoint
    cfg = HSTUConfig(num_layers=1, model_dim=8, num_heads=1, head_dim=8, num_items=4,
                     num_actions=2, max_history=4, max_candidates=2)
    old = os.umask(0o022)
    try:
        out = save_checkpoint({"w": torch.ones(2)}, cfg, tmp_path / "a")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((out / WEIGHTS_FILE).stat().st_mode)
    assert mode == 0o644 == stat.S_IMODE((out / CONFIG_FILE).stat().st_mode)
    os.chmod(out / CONFIG_FILE, 0o640)  # a deployment's own choice survives a re-save
    save_checkpoint({"w": torch.zeros(2)}, cfg, out)
    assert stat.S_IMODE((out / WEIGHTS_FILE).stat().st_mode) == 0o640
