"""Where the model runs, and how its tensors cross between that device and host memory.

The parameter servers speak bytes, so every step moves each gradient device -> host (push)
and each fresh weight host -> device (pull). On CUDA that crossing is the costly part;
`HostStaging` keeps it cheap. On CPU there is nothing to cross and it copies nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from pshard.common.errors import ClusterConfigError, ShapeMismatchError
from pshard.worker.config import DEVICES


def select_device(requested: str) -> torch.device:
    """`auto` picks CUDA when one is usable, else the CPU; `cuda` (or `cuda:N`) without one is an error.

    Asking for a GPU and silently training on the CPU would make a run many times slower
    with no sign why, so an explicit request that cannot be met stops the worker.
    """
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        try:
            device = torch.device(requested)
        except RuntimeError as exc:
            raise ClusterConfigError(f"device: got {requested!r}, not a valid device ({exc})") from exc
        if not torch.cuda.is_available():
            raise ClusterConfigError(
                f"device: got {requested!r}, but CUDA is not available here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'}); use 'auto' or 'cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ClusterConfigError(
                f"device: got {requested!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return device
    raise ClusterConfigError(f"device: got {requested!r}, expected one of {DEVICES} or 'cuda:N'")


class HostStaging:
    """Moves named tensors between the training device and host numpy arrays.

    CUDA: copies go through page-locked (pinned) host buffers, one per key and direction,
    allocated on first use and reused every step. Pinned memory is what lets the GPU's DMA
    engine copy asynchronously; pageable memory forces a synchronous bounce copy, and
    pinning is itself expensive (a driver call per allocation), hence once per key, not per
    step. All copies of a call are queued non-blocking and waited for once, so N keys cost
    one synchronisation, not N.

    CPU: `to_host` returns each tensor's own numpy view (zero-copy) and `to_device` copies
    straight into the target, so CPU training pays nothing for this layer.

    Arrays returned by `to_host` alias memory that the next `to_host` (CUDA: the staging
    buffer) or the next backward pass (CPU: the tensor itself) overwrites: encode or send
    them before then. bfloat16 tensors come back as uint16 views, the wire's bf16 form,
    because numpy has no bfloat16.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # Separate buffers per direction: a pushed gradient's host bytes may still be in use
        # (being encoded) while the pull of the same key lands.
        self._up: dict[str, torch.Tensor] = {}
        self._down: dict[str, torch.Tensor] = {}
        # Per key: the event after the last host -> device copy out of its pinned buffer, waited on
        # before that buffer is rewritten, because the GPU may still be reading it. Per key, not one
        # for the last batch: with overlap every module's forward lands its own keys, and waiting for
        # the previous module's copy (queued behind that module's kernels) kept the host from running
        # more than one module ahead of the GPU.
        self._down_done: dict[str, torch.cuda.Event] = {}
        # Per key: the numpy view of its pinned down buffer that `landing` handed out. A pull written
        # there needs no host copy into pinned memory: to_device copies it to the device as it is.
        self._landing: dict[str, np.ndarray] = {}

    def to_host(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Host arrays holding the values of `tensors` (same shapes), ready to use on return."""
        if not self._cuda:
            return {key: _numpy_view(t.detach().contiguous()) for key, t in tensors.items()}
        staged: dict[str, torch.Tensor] = {}
        with torch.cuda.device(self.device):
            for key, tensor in tensors.items():
                buf = self._buffer(self._up, key, tensor)
                # Queued on the current stream, after the kernels that produced the tensor.
                buf.copy_(tensor.detach(), non_blocking=True)
                staged[key] = buf
            # The one wait of this call: until here the host bytes may still be in flight.
            torch.cuda.current_stream(self.device).synchronize()
        return {key: _numpy_view(buf) for key, buf in staged.items()}

    def landing(self, key: str, target: torch.Tensor) -> np.ndarray | None:
        """CUDA: the pinned buffer that `to_device` copies `target`'s key from, as a host array to write
        pulled values into (same shape; bfloat16 as uint16), once the GPU has read its last contents.
        Passed back to `to_device` as the key's array, it goes to the device without a host copy: for a
        ResNet-18 that is 47 MB of memcpy per step, on the training thread. None on the CPU.

        The array is the key's own buffer: write it only between this call and its `to_device`."""
        if not self._cuda:
            return None
        buf = self._buffer(self._down, key, target)
        view = self._landing.get(key)
        if view is None or view.ctypes.data != buf.data_ptr():  # first use, or the buffer was replaced
            view = self._landing[key] = _numpy_view(buf)
        pending = self._down_done.get(key)
        if pending is not None:
            pending.synchronize()  # usually long done: a step ago
        return view

    def to_device(self, arrays: Mapping[str, np.ndarray], targets: Mapping[str, torch.Tensor]) -> None:
        """Copy each host array into the tensor of the same key, in place (e.g. a parameter's .data)."""
        for key, array in arrays.items():
            if key not in targets:
                raise KeyError(f"to_device: no target tensor for key {key!r}")
            if array.size != targets[key].numel():
                raise ShapeMismatchError(
                    f"key {key!r}: got {array.size} values {array.shape}, target has "
                    f"{targets[key].numel()} {tuple(targets[key].shape)}"
                )
        if not self._cuda:
            for key, array in arrays.items():
                _write(targets[key].detach(), array)
            return
        with torch.cuda.device(self.device), torch.no_grad():
            for key, array in arrays.items():
                target = targets[key]
                buf = self._buffer(self._down, key, target)
                if array is not self._landing.get(key) or array.ctypes.data != buf.data_ptr():
                    # Not written in place (`landing` waited for the GPU before handing it out).
                    pending = self._down_done.get(key)
                    if pending is not None:
                        pending.synchronize()  # usually long done: a step ago
                    _write(buf, array)  # a host memcpy into pinned memory
                # Stream-ordered before any later kernel that reads the target: no wait needed here.
                target.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            for key in arrays:
                self._down_done[key] = done

    def _buffer(self, pool: dict[str, torch.Tensor], key: str, like: torch.Tensor) -> torch.Tensor:
        buf = pool.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
            pool[key] = buf
        return buf


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


def _write(dst: torch.Tensor, array: np.ndarray) -> None:
    """Copy `array` into the CPU tensor `dst` in place, casting as numpy does.

    Through numpy rather than torch.from_numpy: arrays decoded with np.frombuffer are
    read-only, and torch warns about wrapping those.
    """
    if dst.dtype == torch.bfloat16 and array.dtype != np.uint16:
        # Numpy cannot produce bfloat16: let torch round a float array (uint16 is already bf16 bits).
        dst.copy_(torch.from_numpy(np.array(array, dtype=np.float32)).view(dst.shape))
    else:
        _numpy_view(dst)[...] = array.reshape(dst.shape)
