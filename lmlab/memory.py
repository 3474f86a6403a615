"""Free memory, read before work whose size is known up front: a length that cannot fit is refused with an
estimate before anything is computed, instead of failing (or swapping the machine to a halt) in the middle of it.
"""

from __future__ import annotations

import os
from pathlib import Path

GiB = 2**30


def available_bytes(device: str = "cpu") -> int:
    """Memory that can be allocated on `device` now: free CUDA memory, or the host's MemAvailable (what the kernel
    can hand out without swapping), capped by a cgroup v2 limit when the process runs under one (a container)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info()[0]
    free = _meminfo_available()
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc: free pages only


def check_attention_fits(what: str, position: str, n_head: int, length: int, batch: int, device: str = "cpu"
                         ) -> None:
    """Refuse `length` when the memory the position scheme's attention needs there exceeds what `device` has free.

    `what` names the key the length came from (`model.max_seq_len=...`, `length ...`). The estimate is the
    scheme's own (`attention_bytes`), a lower bound: the weights and the other activations come on top.
    """
    from lmlab.model.position import POSITIONS

    need = POSITIONS[position].attention_bytes(n_head, length, batch)
    if need and need > (free := available_bytes(device)):
        raise ValueError(
            f"{what} with position={position} needs at least ~{need / GiB:.1f} GiB for attention (a ({n_head}, L, L) "
            f"bias, and attention scores of that size for each of {batch} sequences at a time); available memory "
            f"is ~{free / GiB:.1f} GiB ({device}). Use a shorter length, or a batch of fewer sequences"
        )
