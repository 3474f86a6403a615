"""Free memory, read before work whose size is known up front: a length that cannot fit is refused with an
estimate before anything is computed, instead of failing (or swapping the machine to a halt) in the middle of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmlab.config import GPTConfig
from lmlab.model.layers import layer_plan
from lmlab.model.resolve import n_params_estimate

GiB = 2**30
# Python objects of one layer's modules, parameters and hooks, whatever its width (measured with tracemalloc on the
# meta device: ~60 kB for a transformer layer, ~17 kB for a GAU): a build of a million narrow layers needs ~60 GB.
LAYER_OBJECT_BYTES = 64 * 1024


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


def model_bytes(cfg: GPTConfig, bytes_per_param: int = 4) -> int:
    """What building `cfg`'s model takes at least: its weights at `bytes_per_param` (4: fp32; training adds the
    gradients and the optimizer's state) and the Python objects of its layers. From the config's arithmetic only."""
    return n_params_estimate(cfg) * bytes_per_param + cfg.n_layer * LAYER_OBJECT_BYTES


def check_model_fits(cfg: GPTConfig, what: str = "model", bytes_per_param: int = 4, device: str = "cpu") -> None:
    """Refuse a model that cannot be built in the memory `device` has free, with the estimate, before anything is
    built (a model of a million layers took 6 minutes and 7.5 GB of the meta device's objects before failing)."""
    n_params = n_params_estimate(cfg)
    need = n_params * bytes_per_param + cfg.n_layer * LAYER_OBJECT_BYTES
    if need > (free := available_bytes(device)):
        raise ValueError(
            f"{what}: model.n_layer={cfg.n_layer} model.d_model={cfg.d_model} (vocab {cfg.vocab_size}) has about "
            f"{n_params / 1e9:.3g} B parameters and needs at least ~{need / GiB:.1f} GiB to build "
            f"({bytes_per_param} bytes per parameter, plus ~{LAYER_OBJECT_BYTES // 1024} kB per layer); available "
            f"memory is ~{free / GiB:.1f} GiB ({device}). Use fewer or narrower layers"
        )


def check_generation_fits(cfg: GPTConfig, prompt: int, new_tokens: int, batch: int, device: str = "cpu") -> None:
    """Refuse a generation whose first forward (the whole prompt: ALiBi's (n_head, T, T) bias) or whose KV cache
    (every layer's keys and values for prompt + new tokens of `batch` texts, fp32, twice while a step appends to it)
    cannot fit, naming the argument to lower. Each cached step after the first reads one position."""
    check_attention_fits(f"the prompt ({prompt} tokens, n={batch})", cfg.position["name"], cfg.attn_heads, prompt,
                         batch, device)
    # the layers with a KV cache (lmlab.model.layers): a recurrent mixer's layer holds a fixed state instead
    attn_layers = sum(layer.attention for layer in layer_plan(cfg))
    length, per_token = prompt + new_tokens, 2 * 4 * attn_layers * batch * cfg.cache_width
    if (need := per_token * length) > (free := available_bytes(device)):
        raise ValueError(f"max_new_tokens={new_tokens} (+ a prompt of {prompt} tokens, n={batch}): the KV cache needs "
                         f"~{need / GiB:.1f} GiB ({attn_layers} layers x {cfg.cache_width} numbers per token); "
                         f"available memory is ~{free / GiB:.1f} GiB ({device}), room for ~{free // per_token} "
                         f"tokens. Lower max_new_tokens or n")


def batch_bytes(batch: int, seq_len: int, d_model: int, n_layer: int) -> tuple[int, int]:
    """What one batch takes at least, (host, device): its token ids as the data loader assembles them (each
    sequence's int64 block, then the stacked inputs and targets, ~200 bytes of tensor objects per sequence) and, on
    the device, the residual stream every layer keeps for the backward pass (2 bytes a number, bf16's, at least)."""
    ids = batch * ((seq_len + 1) * 8 * 3 + 200)
    return ids, batch * seq_len * d_model * 2 * n_layer


def check_batch_fits(batch: int, seq_len: int, d_model: int, n_layer: int, device: str = "cpu") -> None:
    """Refuse a `data.batch_size` whose one batch cannot fit, before the loader allocates it (a batch of 10^8
    sequences grew to 13.5 GB, ignoring signals, until the kernel killed it), naming the largest that could."""
    import torch

    host, dev = batch_bytes(batch, seq_len, d_model, n_layer)
    free = {"cpu": available_bytes("cpu")}
    need = {"cpu": host + (dev if device == "cpu" else 0)}
    if device != "cpu" and torch.cuda.is_initialized():  # asking the GPU otherwise would start CUDA in a process
        free[device], need[device] = available_bytes(device), dev  # that may launch ranks, or has none (a login node)
    for where, n in need.items():
        if n > free[where]:
            per = n // batch
            raise ValueError(
                f"data.batch_size={batch} needs at least ~{n / GiB:.1f} GiB for one batch of {batch} x "
                f"model.max_seq_len={seq_len} tokens ({per} bytes a sequence: its ids, and the activations of "
                f"{n_layer} layers of {d_model}), more than the ~{free[where] / GiB:.1f} GiB available ({where}): "
                f"the limit here is data.batch_size={max(1, free[where] // per)}; use a smaller one (and "
                f"trainer.accumulate_grad_batches for a larger batch per step)")
