"""Which code runs a recurrent mixer's recurrence (`mixer.backend`): lmlab's PyTorch chunked form (`torch`), or the
mixer's kernel from a package: flash-linear-attention's Triton kernels (`fla`, for gdn and linear: pip install -e
.[kernels]) or mamba-ssm's (`mamba_ssm`, for mamba2, the reference SSD kernel). `auto` (the default) takes the kernel
on a CUDA device where its package imports and where the kernel computes the layer's config, and the PyTorch form
otherwise: always on the CPU, for float64, for keys the kernel lacks. Everything around the recurrence (projections,
the short conv, gates, norms) is the same code on every backend.

The choice is made in two steps, because a mixer is built on the CPU (or the meta device) and moved to its device
later: at build, `MixerBackend` checks the key: a forced kernel that cannot run here (its package missing, no CUDA
device, or keys it does not compute) is refused then, before training, naming the key, the values and why. At each
forward, `choose(x)` settles the path for x's device and dtype (once per pair, cached) and records it in `used`,
which the mixer exposes as `backend_used` for a run's report. The kernels' packages are imported lazily, here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from typing import Any

import torch

from lmlab.model.capabilities import RecurrentMixer

TORCH, AUTO = "torch", "auto"
# Each kernel backend: the module it imports (its presence is the package's) and how to install it.
PACKAGES = {"fla": "fla", "mamba_ssm": "mamba_ssm"}
INSTALL = {"fla": "pip install -e .[kernels]",
           "mamba_ssm": "pip install mamba-ssm --no-build-isolation: it compiles against the installed torch and CUDA"}
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # Triton kernels: no float64


def installed(backend: str) -> bool:
    """Whether the kernel backend's package can be found (not imported: that waits for the first CUDA forward)."""
    try:
        return importlib.util.find_spec(PACKAGES[backend]) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def kernel(module: str, name: str) -> Any:
    """The kernel `name` from `module` (e.g. fla.ops.gated_delta_rule's chunk_gated_delta_rule), imported once."""
    return getattr(importlib.import_module(module), name)


class MixerBackend:
    """`mixer.backend` of one mixer layer: `wanted` (auto, torch or the mixer's `kernel`), checked at build;
    `refusal` says why the kernel cannot compute this layer's keys (None: it can)."""

    def __init__(self, mixer: str, wanted: str, kernel: str, refusal: str | None = None) -> None:
        accepted = (AUTO, TORCH, kernel)
        if wanted not in accepted:
            why = f"; {wanted} is not a kernel of mixer={mixer}" if wanted in PACKAGES else ""
            raise ValueError(f"mixer.backend={wanted!r} is not an option for mixer={mixer}: choose one of "
                             f"{list(accepted)} ({kernel}: its kernel, torch: lmlab's PyTorch form, auto: the kernel "
                             f"on CUDA where it runs){why}")
        self.mixer, self.wanted, self.kernel, self.refusal = mixer, wanted, kernel, refusal
        self.used: str | None = None  # the path of the last forward
        self._chosen: dict[tuple[str, torch.dtype], str] = {}
        if wanted == kernel:
            if refusal:
                raise ValueError(f"mixer.backend={kernel} cannot run mixer={mixer} with these keys: {refusal}; use "
                                 f"mixer.backend=torch, or auto (which takes the PyTorch form for them)")
            missing = [] if torch.cuda.is_available() else ["a CUDA device (there is none here)"]
            if not installed(kernel):
                missing.append(f"the {PACKAGES[kernel]} package ({INSTALL[kernel]})")
            if missing:
                raise ValueError(f"mixer.backend={kernel} needs CUDA and the {PACKAGES[kernel]} package; missing "
                                 f"{' and '.join(missing)}. Use mixer.backend=auto (the kernel where it runs, lmlab's "
                                 f"PyTorch form elsewhere) or torch")

    def choose(self, x: torch.Tensor) -> str:
        """The path for input `x`: `torch` or the kernel, once per (device, dtype); recorded in `used`."""
        key = (str(x.device), x.dtype)
        if key not in self._chosen:
            self._chosen[key] = self._choose(x.device, x.dtype)
        self.used = self._chosen[key]
        return self.used

    def _choose(self, device: torch.device, dtype: torch.dtype) -> str:
        if self.wanted == TORCH:
            return TORCH
        forced = self.wanted == self.kernel
        name = f"mixer.backend={self.kernel}"
        if device.type != "cuda":
            if forced:
                raise ValueError(f"{name} runs on CUDA only; this forward's input is on {device}: move the model to "
                                 f"a GPU, or use mixer.backend=auto (lmlab's PyTorch form off CUDA) or torch")
            return TORCH
        if dtype not in KERNEL_DTYPES:
            if forced:
                raise ValueError(f"{name} computes in {[str(d).removeprefix('torch.') for d in KERNEL_DTYPES]}, "
                                 f"not {str(dtype).removeprefix('torch.')}: use mixer.backend=torch for it")
            return TORCH
        if self.refusal:  # auto: keys the kernel does not compute (a forced kernel was refused at build)
            return TORCH
        try:
            importlib.import_module(PACKAGES[self.kernel])
        except ImportError as e:
            if forced:
                raise ValueError(f"{name}: importing {PACKAGES[self.kernel]} failed ({e}); reinstall it "
                                 f"({INSTALL[self.kernel]}) or use mixer.backend=torch") from e
            warnings.warn(f"mixer={self.mixer}: {PACKAGES[self.kernel]} is installed but does not import ({e}); "
                          f"running lmlab's PyTorch form (mixer.backend=torch silences this)", stacklevel=3)
            return TORCH
        return self.kernel


def paths_taken(model: torch.nn.Module) -> list[str]:
    """The recurrence paths the model's mixers last ran (torch, fla, mamba_ssm), each once: a run's record of them."""
    return sorted({m.backend_used for m in model.modules() if isinstance(m, RecurrentMixer) and m.backend_used})
