"""Checkpoint directories: ``config.json`` (the architecture) + ``model.safetensors`` (weights).

Loading checks every tensor's name and shape against the model built from ``config.json`` and
names the first mismatch. No pickle anywhere.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import CheckpointError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if Path(directory).is_file():
        raise CheckpointError(f"{directory}: a file; give the checkpoint's directory (its "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON: {err}") from None


def decode_config(raw: dict, cls: type, source: str):
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as err:
        raise CheckpointError(f"{source}: {err}") from None


def uninitialized(cls, cfg, device: str | None = "cpu") -> nn.Module:
    """``cls(cfg)`` with its parameters uninitialized (on ``device``; None: the meta device,
    shapes only), for a caller that sets every one of them (a seeded init, a strict or
    ``assign`` load): torch's default inits cost a gen-ref refit a quarter of its CPU time and
    rank-ref's 1M-item table 6 s (CPU machine)."""
    with torch.device("meta"):
        model = cls(cfg)
    return model if device is None else model.to_empty(device=device)


def load_weights(model: nn.Module, directory: str | Path, device=None, dtype=None,
                 staging: HostStaging | None = None) -> nn.Module:
    """``directory``'s weights into ``model``, each tensor's name and shape checked against it
    (the first mismatch named). Without ``device``: copied into ``model``'s parameters. With
    ``device`` (``model`` may then live on the meta device, never initialized): the file's
    bytes cross as one copy (``device_copies``, from ``staging``'s pinned buffer) and the
    parameters become those tensors, in ``dtype`` (default: the file's)."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}")
    tensors, buf = read_safetensors(path, staging)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing tensor `{missing[0]}`"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor `{extra[0]}`")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: tensor `{name}` has shape {tuple(got.shape)}, "
                                  f"config.json implies {tuple(want.shape)}")
    if device is None:
        check_finite(tensors, path)
        model.load_state_dict(tensors)
    else:
        dtypes = {k: dtype or t.dtype for k, t in tensors.items()}
        moved = device_copies(tensors, buf, device, dtypes, staging)
        check_finite(moved, path)
        model.load_state_dict(moved, assign=True)
    return model


def check_finite(tensors: dict, source) -> None:
    """Refuse weights holding NaN or infinite values (a diverged training run, or values past
    the serving dtype's range): served, they would answer NaN scores or arbitrary items with
    no error. Checked where the tensors will serve (on the device: ~0.1 ms there; ~60 ms for
    200 MB on the 2-core CPU VM), with one sync for all of them; the first bad tensor named."""
    names = [k for k, t in tensors.items() if t.is_floating_point()]
    if not names:
        return
    ok = torch.stack([torch.isfinite(tensors[k]).all() for k in names]).tolist()
    if not all(ok):
        raise CheckpointError(f"{source}: tensor `{names[ok.index(False)]}` holds NaN or "
                              f"infinite values")


def save_checkpoint(model: nn.Module | dict, config: msgspec.Struct,
                    directory: str | Path) -> Path:
    """``model`` (a module or its state dict, on any device) and its config as a checkpoint
    directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(msgspec.to_builtins(config), indent=2) + "\n")
    tensors = model if isinstance(model, dict) else model.state_dict()
    write_weights(tensors, out)
    return out


def write_weights(tensors: dict, directory: Path) -> None:
    """``tensors`` as the ``model.safetensors`` of ``directory``, beside its config.json
    (written first)."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    # safetensors >= 0.8 writes through a temporary file of mode 0600 whatever the umask
    # (safetensors issue #782): a server running as another user (the Docker image's) could
    # not read the weights. They take the mode config.json got (the umask's, or the mode of
    # the file it replaced), without touching the process's umask.
    os.chmod(directory / WEIGHTS_FILE, stat.S_IMODE((directory / CONFIG_FILE).stat().st_mode))


def hf_state_dict(tensors: dict, cfg) -> dict:
    """A Hugging Face T5 checkpoint's tensors under ``models.t5``'s names (tied embeddings may be
    saved as ``shared``, ``encoder.embed_tokens`` or ``decoder.embed_tokens``)."""
    out = dict(tensors)
    if "shared.weight" not in out:
        for alt in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            if alt in out:
                out["shared.weight"] = out[alt]
                break
    for alt in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        out.pop(alt, None)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# safetensors' dtype names (the format's header), as torch dtypes.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class HostStaging:
    """One host buffer that every checkpoint read of an engine reuses: pinned where CUDA is
    present, so a refit's whole checkpoint crosses to the GPU as one asynchronous copy.
    Pinning ~200 MB costs tens of ms, once. Reads are serialized by the engine's update lock;
    a copy out of the buffer leaves its event (``copied``), and ``take`` waits for it, so a read
    never overwrites bytes still crossing to the GPU (builds also wait for their stream,
    ``streams.off_stream``, unless ``STREAMGR_BUILD_STREAM=0``)."""

    def __init__(self, pin: bool) -> None:
        self.pin, self._buf, self._event = pin, None, None

    def copied(self) -> None:
        """The buffer's last asynchronous copy is queued on the current CUDA stream."""
        if self.pin and torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record()

    def take(self, nbytes: int) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # the old one first: two of them at once double the pinned memory
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
        return self._buf[:nbytes]


ALIGN = 256  # bytes: every tensor's start in the host buffer (and so on the device)


def fp32_checkpoint_bytes(tensors) -> int:
    """The buffer ``read_safetensors`` fills for an fp32 checkpoint of ``tensors`` (each
    tensor's bytes rounded up to ``ALIGN``): what a refit buffer pinned ahead must hold, or
    the first refit pins a new one beside serving."""
    return sum(-(-4 * t.numel() // ALIGN) * ALIGN for t in tensors)


def read_safetensors(path: str | Path, staging: HostStaging | None = None):
    """(tensors, buffer) of a ``.safetensors`` file: every tensor a view of one host byte
    buffer (``staging``'s, else a new one) filled by ``readinto``, which lets the GIL go for
    the whole read. ``safe_open(...).get_tensor`` copied each tensor holding it: a refit's
    ~200 MB read beside serving slowed 70% of the requests it overlapped (session 14).
    Each tensor starts at a multiple of ``ALIGN`` bytes in the buffer: the format packs them
    back to back, so one of a single bf16 (rank's head bias) left every tensor after it 2
    bytes off 16 and the GPU's vectorized kernels fell back to torch's ops (session 15)."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise CheckpointError(f"{path}: the header is not a JSON object")
            layout, total = _layout(path, header, size - 8 - n)
            buf = (staging.take(total) if staging is not None
                   else torch.empty(total, dtype=torch.uint8))
            view, pos = memoryview(buf.numpy()), 0  # pos: the file's offset in its data
            for name, dtype, shape, begin, end, dst in layout:
                if begin > pos:
                    f.seek(begin - pos, os.SEEK_CUR)
                done = 0
                while done < end - begin:
                    got = f.readinto(view[dst + done:dst + end - begin])
                    if not got:
                        raise CheckpointError(f"{path}: truncated at byte {8 + n + begin + done}")
                    done += got
                pos = end
    except (OSError, ValueError, UnicodeDecodeError) as err:  # JSON errors are ValueErrors
        raise CheckpointError(f"{path}: unreadable: {err}") from None
    tensors = {name: buf[dst:dst + end - begin].view(dtype).reshape(shape)
               for name, dtype, shape, begin, end, dst in layout}
    return tensors, buf


def _layout(path, header: dict, data_bytes: int) -> tuple[list, int]:
    """(name, dtype, shape, begin, end, destination) per tensor in file order, each checked,
    and the aligned buffer's size."""
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _DTYPES[meta["dtype"]], [int(d) for d in meta["shape"]]
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor `{name}`: a bad header entry {meta!r}") \
                from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if end > data_bytes:
            raise CheckpointError(f"{path}: truncated: tensor `{name}` ends at byte {end} of "
                                  f"a {data_bytes}-byte data section")
        if not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{path}: tensor `{name}`: bytes {begin}..{end} do not hold "
                                  f"{meta['dtype']}{shape} inside the {data_bytes}-byte data")
        entries.append((begin, end, name, dtype, shape))
    entries.sort(key=lambda e: (e[0], e[1]))
    layout, total, last = [], 0, 0
    for begin, end, name, dtype, shape in entries:
        if begin < last:
            raise CheckpointError(f"{path}: tensor `{name}` overlaps the one before it")
        dst = -(-total // ALIGN) * ALIGN
        layout.append((name, dtype, shape, begin, end, dst))
        total, last = dst + end - begin, end
    return layout, total


def device_copies(tensors: dict, buf: torch.Tensor, device, dtypes: dict,
                  staging: HostStaging | None = None) -> dict:
    """``tensors`` (views of the host ``buf``, ``staging``'s if given) on ``device`` in
    ``dtypes[name]``: ``buf`` crosses as one copy (asynchronous from pinned memory), then each
    tensor is a view of the device bytes, converted on the device where its dtype differs.
    Tensors that are not views of ``buf`` move one by one."""
    dev = torch.empty(buf.shape, dtype=torch.uint8, device=device)
    dev.copy_(buf, non_blocking=buf.is_pinned())
    if staging is not None and dev.is_cuda:
        staging.copied()
    base, out = buf.data_ptr(), {}
    for name, want in dtypes.items():
        t = tensors[name]
        off = t.data_ptr() - base
        if 0 <= off and off + t.nbytes <= buf.numel() and t.is_contiguous():
            d = dev[off:off + t.nbytes].view(t.dtype).reshape(t.shape)
        else:
            d = t.to(device)
        out[name] = d.to(want)
    return out
