"""The recurrent mixers' backends (lmlab.model.mixer.backend): `mixer.backend=auto|torch|<kernel>` chosen per device
at the first forward, a forced kernel that cannot run refused at build naming the key (no CUDA, its package missing,
keys it does not compute), the kernels' calling code (layouts, grouped heads, document segments, the carried state)
against references of the kernels' documented contracts on the CPU, GDN's dt_bias init, and, on a CUDA device with
the packages installed (`pytest -m gpu`), each kernel against lmlab's PyTorch form: outputs, gradients and cached
generation in float32 and bf16."""

from __future__ import annotations

import importlib.machinery
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.model.init import INITS
from lmlab.model.mixer import ATTENTION, MIXERS, gdn, linear, mamba2
from lmlab.model.mixer.backend import MixerBackend
from lmlab.model.mixer.base import log_uniform_dt_bias
from lmlab.model.mixer.gdn import DT_RANGE, GatedDeltaNet
from lmlab.model.resolve import resolve

RECURRENT = sorted(set(MIXERS) - {ATTENTION})
KERNEL = {"gdn": "fla", "linear": "fla", "mamba2": "mamba_ssm"}  # each mixer's kernel backend (kda: none)
KERNELED = [m for m in RECURRENT if m in KERNEL]  # the mixers with a kernel path
PACKAGE = {"fla": "fla", "mamba_ssm": "mamba_ssm"}
BASE = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, max_seq_len=64, position={"name": "rope"})
# grouped heads where the mixer has them: GDN's 2 key heads read by 4 value heads, Mamba-2's 4 heads in 2 groups
SMALL = {"gdn": {"n_heads": 2, "n_v_heads": 4, "head_dim": 8, "v_head_dim": 6},
         "mamba2": {"d_state": 8, "head_dim": 16, "n_groups": 2}, "linear": {}}
EOD = 0


def _cfg(name: str, backend: str = "auto", doc_mask: bool = False, base: dict = BASE, **keys) -> GPTConfig:
    attention = {"name": "mha", "doc_mask": True} if doc_mask else {"name": "mha"}
    return GPTConfig(**base, eod_id=EOD if doc_mask else None, attention=attention,
                     mixer={"name": name, "pattern": [name, ATTENTION], "backend": backend, **SMALL.get(name, {}),
                            **keys})


def _mixers(model: GPT) -> list:
    return [block.mix for block in model.h if hasattr(block, "mix")]


class _Finder:
    """A meta-path finder that makes `names` importable (a bare spec: findable, with no code) or, `missing`, not
    installed whatever the environment has: the import system's own answer, no kernel mocked."""

    def __init__(self, names: tuple[str, ...], missing: bool) -> None:
        self.names, self.missing = names, missing

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.names:
            return None
        if self.missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return importlib.machinery.ModuleSpec(name, None)


def _packages(monkeypatch, *, installed: bool, cuda: bool) -> None:
    monkeypatch.setattr(sys, "meta_path", [_Finder(("fla", "mamba_ssm"), missing=not installed), *sys.meta_path])
    for name in ("fla", "mamba_ssm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


# --- choosing -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RECURRENT)
def test_auto_runs_the_torch_form_on_the_cpu(name) -> None:
    torch.manual_seed(0)
    auto, forced = GPT(_cfg(name)), GPT(_cfg(name, "torch"))
    forced.load_state_dict(auto.state_dict())
    assert [m.backend_used for m in _mixers(auto)] == [None]  # nothing ran yet
    idx = torch.randint(1, 64, (2, 12))
    torch.testing.assert_close(auto(idx), forced(idx), rtol=0, atol=0)
    assert [m.backend_used for m in _mixers(auto) + _mixers(forced)] == ["torch", "torch"]


@pytest.mark.parametrize("name", KERNELED)
def test_a_forced_kernel_without_cuda_is_refused_at_build(name, monkeypatch) -> None:
    _packages(monkeypatch, installed=True, cuda=False)
    kernel = KERNEL[name]
    with pytest.raises(ValueError, match=rf"mixer\.backend={kernel} needs CUDA.*missing a CUDA device") as e:
        validate(_cfg(name, kernel))
    assert "pip install" not in str(e.value)  # the package is there: only CUDA is named
    assert "mixer.backend=auto" in str(e.value) and "torch" in str(e.value)


@pytest.mark.parametrize("name", KERNELED)
def test_a_forced_kernel_without_its_package_names_the_install(name, monkeypatch) -> None:
    _packages(monkeypatch, installed=False, cuda=True)
    kernel = KERNEL[name]
    install = r"pip install -e \.\[kernels\]" if kernel == "fla" else r"pip install mamba-ssm"
    with pytest.raises(ValueError, match=rf"mixer\.backend={kernel} needs .*missing the {kernel} package \({install}"):
        validate(_cfg(name, kernel))
    validate(_cfg(name, "auto"))  # auto builds: it falls back
    validate(_cfg(name, "torch"))


@pytest.mark.parametrize("name", KERNELED)
def test_a_forced_kernel_refuses_a_cpu_input_at_its_first_forward(name, monkeypatch) -> None:
    _packages(monkeypatch, installed=True, cuda=True)  # it builds: the device is known at the forward only
    model = GPT(_cfg(name, KERNEL[name]))
    with pytest.raises(ValueError, match=rf"mixer\.backend={KERNEL[name]} runs on CUDA only; .* on cpu"):
        model(torch.randint(1, 64, (1, 8)))


@pytest.mark.parametrize("mixer,match", [
    ({"name": "gdn", "backend": "mamba_ssm"}, r"mixer\.backend='mamba_ssm' must be one of \['auto', 'torch', 'fla'\]"),
    ({"name": "mamba2", "backend": "fla"}, r"mixer\.backend='fla' must be one of \['auto', 'torch', 'mamba_ssm'\]"),
    ({"name": "linear", "backend": "cuda"}, r"mixer\.backend='cuda' must be one of"),
    ({"name": "gdn", "dt_init": "random"}, r"mixer\.dt_init='random' must be one of \['constant', 'log_uniform'\]"),
])
def test_a_bad_value_is_refused_by_key(mixer, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate(GPTConfig(**BASE, mixer=mixer))


def test_a_backend_built_from_python_names_the_mixers_own_choices() -> None:
    with pytest.raises(ValueError, match=r"mixer\.backend='mamba_ssm' is not an option for mixer=gdn: choose one of "
                                         r"\['auto', 'torch', 'fla'\].*not a kernel of mixer=gdn"):
        MixerBackend("gdn", "mamba_ssm", "fla")


@pytest.mark.parametrize("keys,why", [({"head_dim": 272, "v_head_dim": 8}, r"at most 256 \(mixer\.head_dim=272\)"),
                                      ({"head_dim": 9, "v_head_dim": 8}, r"even head sizes \(mixer\.head_dim=9")])
def test_keys_the_kernel_does_not_compute_are_refused_when_forced_and_fall_back_under_auto(keys, why,
                                                                                           monkeypatch) -> None:
    _packages(monkeypatch, installed=True, cuda=True)
    cfg = resolve(GPTConfig(**BASE))
    with pytest.raises(ValueError, match=rf"mixer\.backend=fla cannot run mixer=gdn with these keys: .*{why}"):
        GatedDeltaNet(cfg, 0, n_heads=2, **keys, backend="fla")
    auto = GatedDeltaNet(cfg, 0, n_heads=2, **keys).backend
    monkeypatch.setitem(sys.modules, "fla", type(sys)("fla"))  # importable: only the keys keep it off the kernel
    assert auto._choose(torch.device("cuda"), torch.bfloat16) == "torch"
    fits = GatedDeltaNet(cfg, 0, n_heads=2, head_dim=16, v_head_dim=8).backend
    assert fits.refusal is None and fits._choose(torch.device("cuda"), torch.bfloat16) == "fla"
    with pytest.raises(ValueError, match=r"mixer\.backend=fla cannot run mixer=linear .*\(mixer\.head_dim=5\)"):
        linear.LinearAttention(cfg, 0, n_heads=2, head_dim=5, backend="fla")


def test_auto_takes_the_kernel_on_cuda_only_where_it_runs(monkeypatch) -> None:
    cuda = torch.device("cuda")
    choice = MixerBackend("gdn", "auto", "fla")
    monkeypatch.setitem(sys.modules, "fla", type(sys)("fla"))  # an importable package (its import finds it loaded)
    assert choice._choose(cuda, torch.bfloat16) == "fla" and choice._choose(cuda, torch.float32) == "fla"
    assert choice._choose(cuda, torch.float64) == "torch"  # Triton kernels have no float64
    assert choice._choose(torch.device("cpu"), torch.float32) == "torch"
    assert MixerBackend("gdn", "torch", "fla")._choose(cuda, torch.float32) == "torch"
    monkeypatch.delitem(sys.modules, "fla")
    monkeypatch.setattr(sys, "meta_path", [_Finder(("fla",), missing=True), *sys.meta_path])
    with pytest.warns(UserWarning, match="does not import"):
        assert MixerBackend("gdn", "auto", "fla")._choose(cuda, torch.float32) == "torch"


def test_the_choice_is_made_once_per_device_and_dtype(monkeypatch) -> None:
    choice, calls = MixerBackend("linear", "auto", "fla"), []
    monkeypatch.setattr(choice, "_choose", lambda device, dtype: calls.append((device, dtype)) or "torch")
    for x in (torch.zeros(1), torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(3)):
        assert choice.choose(x) == "torch"
    assert calls == [(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float64)]
    assert choice.used == "torch"


@pytest.mark.parametrize("name", sorted(set(RECURRENT) - set(KERNEL)))
def test_a_mixer_without_a_kernel_runs_its_torch_form_everywhere(name, monkeypatch) -> None:
    _packages(monkeypatch, installed=True, cuda=True)
    with pytest.raises(ValueError, match=r"mixer\.backend='fla' must be one of \['auto', 'torch'\]"):
        validate(_cfg(name, "fla"))
    mixer = _mixers(GPT(_cfg(name)))[0]
    assert mixer.backend._choose(torch.device("cuda"), torch.bfloat16) == "torch"


# --- dt_bias's init -------------------------------------------------------------------------------------------

def test_log_uniform_dt_spreads_the_step_log_uniformly_over_its_range() -> None:
    torch.manual_seed(0)
    dt = F.softplus(log_uniform_dt_bias(20000, *DT_RANGE))
    low, high, _ = DT_RANGE
    assert dt.min() >= low * (1 - 1e-5) and dt.max() <= high * (1 + 1e-5)
    log = dt.log()
    # uniform in [log 1e-3, log 0.1]: mean log 0.01 (standard error 0.009 here), std width / √12, half below 0.01
    assert log.mean().item() == pytest.approx(math.log(0.01), abs=0.05)
    assert log.std().item() == pytest.approx(math.log(100) / math.sqrt(12), rel=0.03)
    assert (dt < 0.01).float().mean().item() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("init", sorted(INITS))
def test_gdn_dt_init_survives_the_model_init(init) -> None:
    torch.manual_seed(0)
    keys = {"n_heads": 2, "n_v_heads": 64, "head_dim": 8, "v_head_dim": 4}
    drawn = GPT(GPTConfig(**BASE, init={"name": init}, mixer={"name": "gdn", "dt_init": "log_uniform", **keys}))
    dt = torch.cat([F.softplus(m.dt_bias.detach()) for m in _mixers(drawn)])
    assert dt.numel() == 2 * 64 and dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert dt.unique().numel() == dt.numel()  # drawn, not a constant
    constant = GPT(GPTConfig(**BASE, init={"name": init}, mixer={"name": "gdn", **keys}))  # the default: Qwen3-Next's
    assert all(torch.equal(m.dt_bias.detach(), torch.ones(64)) for m in _mixers(constant))


# --- the kernels' calling code, on the CPU against references of the kernels' contracts -------------------------

def _segments(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sequence a kernel call holds: its rows, or (B = 1) the varlen segments."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    assert B == 1
    return [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]


def _fla_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's chunk_gated_delta_rule / fused_recurrent_gated_delta_rule as their docstrings define them, token by token
    (fla's naive_recurrent_gated_delta_rule, with its grouped heads and varlen): q, k [B, T, H, K], v [B, T, HV, V],
    g, beta [B, T, HV], value head i reading key head i // (HV / H), the state [N, HV, K, V]."""
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    q, k = (t.repeat_interleave(HV // H, dim=2) * s for t, s in ((q, scale or K ** -0.5), (k, 1)))
    o, finals = torch.zeros_like(v), []
    for n, (b, start, end) in enumerate(_segments(B, T, cu_seqlens)):
        S = v.new_zeros(HV, K, V) if initial_state is None else initial_state[n]
        for t in range(start, end):
            S = S * g[b, t].exp()[:, None, None]
            u = beta[b, t, :, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S))
            S = S + k[b, t, :, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    return o, torch.stack(finals) if output_final_state else None


def _fla_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                     cu_seqlens=None):
    """fla's chunk_linear_attn as its docstring defines it with normalize=False: S_t = S_{t-1} + k_t v_tᵀ, o_t = scale ·
    q_tᵀ S_t, the state [N, H, K, V]."""
    assert not normalize  # lmlab's normaliser is its own (ε): the kernel's numerator only
    B, T, H, K = k.shape
    o, finals = torch.zeros_like(v), []
    for n, (b, start, end) in enumerate(_segments(B, T, cu_seqlens)):
        S = v.new_zeros(H, K, v.size(-1)) if initial_state is None else initial_state[n]
        for t in range(start, end):
            S = S + k[b, t, :, :, None] * v[b, t, :, None, :]
            o[b, t] = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    return o, torch.stack(finals) if output_final_state else None


def _mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, initial_states=None, seq_idx=None,
                               return_final_states=False):
    """mamba-ssm's mamba_chunk_scan_combined as its docstring and kernels define it, token by token: x (b, T, h, p),
    dt (b, T, h), B, C (b, T, g, N), head i in group i // (h / g), y = h_t C_t + D x; with seq_idx, the state is
    emptied where it changes (it starts at 0: the tokens numbered 0 continue initial_states)."""
    b, T, H, P = x.shape
    Bh, Ch = (t.repeat_interleave(H // t.size(2), dim=2) for t in (B, C))
    y, finals = torch.zeros_like(x), []
    for i in range(b):
        h = x.new_zeros(H, P, B.size(-1)) if initial_states is None else initial_states[i]
        now = 0
        for t in range(T):
            if seq_idx is not None and seq_idx[i, t] != now:
                h, now = torch.zeros_like(h), seq_idx[i, t]
            step = (dt[i, t, :, None] * x[i, t])[..., None] * Bh[i, t, :, None, :]  # dt x Bᵀ (h, p, N)
            h = (dt[i, t] * A).exp()[:, None, None] * h + step
            y[i, t] = torch.einsum("hpn,hn->hp", h, Ch[i, t]) + D[:, None] * x[i, t]
        finals.append(h)
    return (y, torch.stack(finals)) if return_final_states else y


REFERENCES = {"chunk_gated_delta_rule": _fla_gated_delta_rule,
              "fused_recurrent_gated_delta_rule": _fla_gated_delta_rule, "chunk_linear_attn": _fla_linear_attn,
              "mamba_chunk_scan_combined": _mamba_chunk_scan_combined}


def _on_references(model: GPT, monkeypatch, called: list[str]) -> None:
    """The model's mixers take their kernel path on the CPU, each kernel its contract's reference."""
    def kernel(module: str, name: str):
        called.append(name)
        return REFERENCES[name]

    for mod in (gdn, linear, mamba2):
        monkeypatch.setattr(mod, "kernel", kernel)
    for m in _mixers(model):
        monkeypatch.setattr(m.backend, "_choose", lambda device, dtype, k=m.backend.kernel: k)


def _packed(B: int, T: int, seed: int = 1) -> torch.Tensor:
    """Tokens with documents ending at different places in each row (row 1: none), so segments differ per row."""
    idx = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(seed))
    idx[0, [5, 13]] = EOD
    if B > 2:
        idx[2, [0, T // 2]] = EOD
    return idx


@pytest.mark.parametrize("doc_mask", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("name", KERNELED)
def test_the_kernel_path_computes_the_torch_form(name, doc_mask, monkeypatch) -> None:
    """The kernel path's layouts, grouped heads, scales, document segments and carried state, against lmlab's PyTorch
    form: outputs and gradients of a packed batch, then cached generation (a prompt in two pieces, then one token at
    a time without autograd: GDN's one-token kernel) from the state the kernel path leaves."""
    torch.manual_seed(0)
    ref, ker = GPT(_cfg(name, "torch", doc_mask)).double(), GPT(_cfg(name, "auto", doc_mask)).double()
    ker.load_state_dict(ref.state_dict())
    called: list[str] = []
    _on_references(ker, monkeypatch, called)
    idx = _packed(3, 21)
    outs = []
    for model in (ref, ker):
        model.zero_grad()
        logits = model(idx)
        logits.pow(2).mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-9, atol=1e-9)
    assert outs[0][1].keys() == outs[1][1].keys()
    for n in outs[0][1]:
        torch.testing.assert_close(outs[1][1][n], outs[0][1][n], rtol=1e-8, atol=1e-10, msg=n)
    assert [m.backend_used for m in _mixers(ker)] == [KERNEL[name]] and called
    ker.eval()
    cache, called[:] = KVCache(len(ker.h)), []
    with torch.no_grad():
        # two prompt pieces (the second continues the state; row 0's document starts at its first token, rows 0
        # and 2 have starts inside it), then one token at a time
        steps = [ker(idx[:, :6], cache=cache), ker(idx[:, 6:15], cache=cache)]
        steps += [ker(idx[:, t:t + 1], cache=cache) for t in range(15, 21)]
    torch.testing.assert_close(torch.cat(steps, dim=1), outs[0][0], rtol=1e-9, atol=1e-9)
    if name == "gdn":
        assert "fused_recurrent_gated_delta_rule" in called  # the one-token steps took the recurrent kernel


# --- on a CUDA device: each kernel against the PyTorch form ---------------------------------------------------

GPU_BASE = dict(vocab_size=256, n_layer=2, d_model=128, n_head=4, max_seq_len=512, position={"name": "rope"})
GPU_KEYS = {"gdn": {"n_heads": 2, "n_v_heads": 4, "head_dim": 32, "v_head_dim": 32},
            "mamba2": {"d_state": 32, "head_dim": 32, "n_groups": 2}, "linear": {}}
# relative error ‖kernel - torch‖ / ‖torch‖: float32 (Triton's dots may take TF32), bf16 autocast (the kernels read
# q, k, v in bf16 where the PyTorch form casts them to float32)
GPU_TOL = {"float32": 5e-3, "bfloat16": 5e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _gpu_pair(name: str, doc_mask: bool) -> tuple[GPT, GPT]:
    pytest.importorskip(PACKAGE[KERNEL[name]])
    torch.manual_seed(0)
    ref, ker = (GPT(validate(_cfg(name, backend, doc_mask, GPU_BASE, **GPU_KEYS[name]))).cuda()
                for backend in ("torch", KERNEL[name]))
    ker.load_state_dict(ref.state_dict())
    return ref, ker


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("doc_mask", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("name", KERNELED)
def test_the_kernel_computes_the_torch_form_on_cuda(name, doc_mask, dtype) -> None:
    ref, ker = _gpu_pair(name, doc_mask)
    idx = _packed(3, 200).cuda()  # not a multiple of any chunk
    results = []
    for model in (ref, ker):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(idx)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), torch.roll(idx, -1, 1).flatten())
        loss.backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert [m.backend_used for m in _mixers(ref)] == ["torch"]
    assert [m.backend_used for m in _mixers(ker)] == [KERNEL[name]]
    assert _rel(results[1][0], results[0][0]) < GPU_TOL[dtype]
    assert results[0][1].keys() == results[1][1].keys()
    errors = {n: _rel(results[1][1][n], g) for n, g in results[0][1].items()}
    assert max(errors.values()) < 2 * GPU_TOL[dtype], errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("doc_mask", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("name", KERNELED)
def test_cached_generation_on_the_kernel_continues_the_torch_form_on_cuda(name, doc_mask, dtype) -> None:
    ref, ker = _gpu_pair(name, doc_mask)
    idx = _packed(3, 80)
    idx[1, 73] = EOD  # a document starting among the one-token steps
    idx = idx.cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        full = ref.eval()(idx)
        cache = KVCache(len(ker.h))
        steps = [ker.eval()(idx[:, :70], cache=cache)] + [ker(idx[:, t:t + 1], cache=cache) for t in range(70, 80)]
    assert [m.backend_used for m in _mixers(ker)] == [KERNEL[name]]
    assert _rel(torch.cat(steps, dim=1), full) < GPU_TOL[dtype]


def test_the_backend_is_how_a_run_computes_not_what_it_is() -> None:
    """mixer.backend may change on resume (a run trained on fla continues on a machine without it) and a saved run
    forced to a kernel is rebuilt with `auto` (its kernel where it runs): evaluation on a CPU still works."""
    from lmlab import compose
    from lmlab.config import arch_config
    from lmlab.record.rundir import model_config
    from lmlab.run.plan import check_same_arch

    def record(*extra: str) -> dict:
        return arch_config(compose(["mixer=gdn", "model.n_layer=1", "model.d_model=32", "model.n_head=2", *extra]),
                           vocab_size=64).to_dict()

    check_same_arch("resume", record("mixer.backend=torch"), record("mixer.backend=fla"))
    with pytest.raises(ValueError, match=r"model/mixer: checkpoint has"):
        check_same_arch("resume", record("mixer.backend=torch"), record("mixer.backend=fla", "mixer.conv_size=2"))
    saved = {"hyper_parameters": {"model": {**record(), "mixer": {**record()["mixer"], "backend": "fla"}}}}
    assert model_config(saved)["mixer"]["backend"] == "auto"


def test_a_model_reports_the_path_its_mixers_ran() -> None:
    """summary.json's mixer_backend (lmlab.run.training) is this: nothing before a forward, torch on the CPU after."""
    from lmlab import build_model, compose
    from lmlab.model.mixer.backend import paths_taken

    model = build_model(compose(["mixer=gdn", "mixer.pattern=[gdn,attention]", "model.n_layer=2", "model.d_model=32",
                                 "model.n_head=2"]), vocab_size=64)
    assert paths_taken(model) == []
    model(torch.randint(0, 64, (1, 8)))
    assert paths_taken(model) == ["torch"]
    assert paths_taken(build_model(compose(["model.n_layer=1", "model.d_model=32", "model.n_head=2"]),
                                   vocab_size=64)) == []  # no recurrent mixer: no key in the summary
