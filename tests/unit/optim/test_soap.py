"""optim=soap against its formulas (lmlab/optim/soap.py; Vyas et al., ICLR 2025, Algorithm 3) written out as matrix
products, over steps whose gradients change, across eigenbasis refreshes and with one side unrotated; against the
reference package side by side (pytorch_optimizer's SOAP, a port of the authors' code, github.com/nikhilvyas/SOAP);
its refusals naming the key; the YAML and the decay groups; and a resume from its state_dict, bit for bit."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.optim import OPTIMIZERS, optimizer_spec, param_groups, validate_optim
from lmlab.optim.soap import SOAP
from lmlab.registry import build
from lmlab.run.checks import check_config

F64 = torch.float64


def _grads(shape: tuple[int, ...], n: int, seed: int = 0, dtype: torch.dtype = F64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(n)]


def _by_hand(W: torch.Tensor, grads: list[torch.Tensor], *, lr: float, betas: tuple[float, float], shampoo_beta: float,
             eps: float, freq: int, wd: float, max_dim: int) -> torch.Tensor:
    """The paper's update as matrix products (identity on a side longer than max_dim): call 0 fills L, R and takes
    their eigenvectors (descending); each later call is Adam step t in the rotated space, then L, R take G, and at
    t % freq == 0 the bases are refreshed by one power-iteration step and a QR, sorted by qᵀLq, V permuted alike."""
    b1, b2 = betas
    m, n = W.shape
    rotated = (m <= max_dim, n <= max_dim)
    L, R = torch.zeros(m, m, dtype=F64), torch.zeros(n, n, dtype=F64)
    QL, QR = torch.eye(m, dtype=F64), torch.eye(n, dtype=F64)  # the identity stands for "unrotated"
    M, V = torch.zeros(m, n, dtype=F64), torch.zeros(m, n, dtype=F64)
    for t, G in enumerate(grads):  # t: the Adam steps taken after this call (call 0 takes none)
        if t > 0:
            M = b1 * M + (1 - b1) * G
            V = b2 * V + (1 - b2) * (QL.T @ G @ QR) ** 2
            N = QL @ ((QL.T @ M @ QR) / (V.sqrt() + eps)) @ QR.T
            W = W - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * N
        W = W * (1 - lr * wd)
        L = shampoo_beta * L + (1 - shampoo_beta) * G @ G.T
        R = shampoo_beta * R + (1 - shampoo_beta) * G.T @ G
        if t == 0:
            QL = torch.linalg.eigh(L).eigenvectors.flip(1) if rotated[0] else QL
            QR = torch.linalg.eigh(R).eigenvectors.flip(1) if rotated[1] else QR
        elif t % freq == 0:
            if rotated[0]:
                order = torch.argsort(torch.diag(QL.T @ L @ QL), descending=True)
                QL, V = torch.linalg.qr((L @ QL)[:, order]).Q, V[order, :]
            if rotated[1]:
                order = torch.argsort(torch.diag(QR.T @ R @ QR), descending=True)
                QR, V = torch.linalg.qr((R @ QR)[:, order]).Q, V[:, order]
    return W


# 4 × 3: L's one zero eigenvalue after the first gradient has a one-dimensional eigenspace, so the basis is unique up
# to signs (which the update does not see); a wider gap would leave a null space whose basis is arbitrary
@pytest.mark.parametrize("max_dim", [10, 3], ids=["both_sides", "left_side_identity"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_seven_steps_follow_the_formulas_across_refreshes(max_dim: int, wd: float) -> None:
    W0 = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    grads = _grads((4, 3), 7)
    hyper = dict(lr=0.05, betas=(0.9, 0.95), shampoo_beta=0.8, eps=1e-8)

    def run(freq: int) -> tuple[torch.Tensor, dict]:
        w = torch.nn.Parameter(W0.clone())
        opt = SOAP([{"params": [w], "weight_decay": wd}], precondition_frequency=freq, max_precond_dim=max_dim, **hyper)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        return w.detach(), opt.state[w]

    w, state = run(freq=2)  # refreshes after Adam steps 2, 4 and 6
    expected = _by_hand(W0, grads, freq=2, wd=wd, max_dim=max_dim, **hyper)
    torch.testing.assert_close(w, expected, rtol=1e-10, atol=1e-12)
    assert state["step"] == 6 and ("Q0" in state) == (max_dim >= 4) and "Q1" in state
    for q in (state[k] for k in ("Q0", "Q1") if k in state):  # QR keeps the bases orthonormal
        torch.testing.assert_close(q.T @ q, torch.eye(q.shape[0], dtype=F64), rtol=0, atol=1e-12)
    # the refresh matters: bases kept from the first eigendecomposition land elsewhere
    unrefreshed, _ = run(freq=100)
    torch.testing.assert_close(unrefreshed, _by_hand(W0, grads, freq=100, wd=wd, max_dim=max_dim, **hyper),
                               rtol=1e-10, atol=1e-12)
    assert (unrefreshed - w).abs().max() > 1e-4


def test_without_rotations_it_is_adam_one_gradient_late() -> None:
    """Vectors, and matrices whose sides are all longer than max_precond_dim, take Adam (the reference's form: ε on
    √v, the bias corrections in the step size); the first gradient only fills the statistics."""
    grads = _grads((6, 5), 6)
    w, b = torch.nn.Parameter(torch.ones(6, 5, dtype=F64)), torch.nn.Parameter(torch.ones(5, dtype=F64))
    opt = SOAP([w, b], lr=0.01, betas=(0.9, 0.99), eps=1e-12, max_precond_dim=4)
    ref_w, ref_b = torch.nn.Parameter(torch.ones(6, 5, dtype=F64)), torch.nn.Parameter(torch.ones(5, dtype=F64))
    adam = torch.optim.Adam([ref_w, ref_b], lr=0.01, betas=(0.9, 0.99), eps=1e-12)
    for k, g in enumerate(grads):
        w.grad, b.grad = g.clone(), g[0].clone()
        opt.step()
        if k > 0:
            ref_w.grad, ref_b.grad = g.clone(), g[0].clone()
            adam.step()
    assert set(opt.state[w]) == set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}  # no statistics kept
    torch.testing.assert_close(w, ref_w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(b, ref_b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.float64, 1e-6)])
def test_against_the_reference_package_side_by_side(dtype: torch.dtype, tol: float) -> None:
    """The same tensors and gradients through lmlab's SOAP and pytorch_optimizer 4.1.0's (its shampoo_beta, max
    precondition dim, decay and eps set as lmlab's; its QR runs in fp32, hence fp64's 1e-6): a near-square matrix
    (both sides rotated), a wide one and an embedding-like tall one (the long side unrotated), a vector (Adam). Ten
    steps, refreshes at Adam steps 3, 6 and 9. One difference by design: lmlab's first step decays θ, the reference's
    does not, so with the gradients fixed lmlab's decayed tensors sit lr·wd·θ0·(1 − lr·wd)^9 below the reference's."""
    reference = pytest.importorskip("pytorch_optimizer")
    shapes = [(5, 4), (6, 40), (50, 8), (7,)]
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    lr, wd = 0.01, 0.1
    hyper = dict(lr=lr, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, precondition_frequency=3)

    def groups(ps):  # the matrices decayed, the vector not (lmlab's param_groups' split)
        return [{"params": ps[:3], "weight_decay": wd}, {"params": ps[3:], "weight_decay": 0.0}]

    opt = SOAP(groups(ours), max_precond_dim=30, **hyper)
    ref = reference.SOAP(groups(theirs), max_precondition_dim=30, **hyper)
    assert ref.defaults["correct_bias"] and not ref.defaults["merge_dims"] and not ref.defaults["precondition_1d"]
    steps = 10
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, generator=gen, dtype=dtype)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for i, (p, q, p0) in enumerate(zip(ours, theirs, start)):
        first_decay = lr * wd * p0 * (1 - lr * wd) ** (steps - 1) if i < 3 else 0 * p0
        torch.testing.assert_close(p.detach(), q.detach() - first_decay, rtol=tol, atol=tol)
        assert (p - start[i]).abs().max() > 1e-3  # they moved
    assert {k for k in opt.state[ours[1]] if k.startswith("Q")} == {"Q0"}  # 40 > 30: the right side unrotated
    assert {k for k in opt.state[ours[2]] if k.startswith("Q")} == {"Q1"}  # 50 > 30: the left side unrotated


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16, tie_embeddings=False))


def _soap(model: GPT, **kw) -> SOAP:
    optim = dict(compose(["optim=soap"]).optim)  # its YAML and the loop's keys; weight_decay is param_groups'
    return build("optim", OPTIMIZERS, {**optimizer_spec(optim), **kw}, param_groups(model, optim["weight_decay"]))


def test_the_axis_builds_it_from_its_yaml_with_the_decay_on_matrices_only() -> None:
    cfg = compose(["optim=soap"])
    assert cfg.optim.name == "soap" and list(cfg.optim.betas) == [0.95, 0.95] and cfg.optim.weight_decay == 0.1
    model = _model()
    opt = _soap(model, max_precond_dim=64)
    assert isinstance(opt, SOAP) and opt.defaults["precondition_frequency"] == 10 and opt.defaults["lr"] == 3e-3
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]
    x = torch.randint(0, 50, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    for p in model.parameters():
        rotated = {k for k in opt.state[p] if k.startswith("Q")}
        assert rotated == {f"Q{i}" for i, s in enumerate(p.shape) if p.dim() == 2 and s <= 64}, p.shape
    # an embedding (50 × 32) is rotated on both sides, a c_attn (96 × 32) only on its d_model side
    assert set(opt.state[model.wte.weight]) >= {"GG0", "Q0", "GG1", "Q1"}
    assert "Q0" not in opt.state[model.h[0].attn.c_attn.weight] and "Q1" in opt.state[model.h[0].attn.c_attn.weight]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("precondition_frequency", 0, "optim.precondition_frequency=0 must be an integer >= 1"),
    ("max_precond_dim", 0, "optim.max_precond_dim=0 must be an integer >= 1"),
    ("shampoo_beta", 1.5, "optim.shampoo_beta=1.5 must be a float in [0, 1)"),
    ("betas", [0.9, 1.0], "optim.betas=[0.9, 1.0] must be a list of 2 floats in [0, 1)"),
    ("eps", 0.0, "optim.eps=0.0 must be a float > 0"),
])
def test_bad_values_are_refused_naming_the_key(key: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        _soap(_model(), **{key: value})
    with pytest.raises(ValueError, match=f"optim.{key}="):  # and before training, from the command line's form
        check_config(compose(["optim=soap", f"optim.{key}={value}"]))


def test_refused_under_fsdp2_naming_the_key() -> None:
    with pytest.raises(ValueError, match="optim=soap with trainer=fsdp2: .*trainer=ddp"):
        validate_optim({"name": "soap"}, {"name": "constant"}, "FSDP2Strategy")
    validate_optim({"name": "soap"}, {"name": "constant"}, "ddp")  # DDP: accepted


def test_state_dict_round_trip_continues_exactly() -> None:
    """Three steps, the state_dict through torch.save / load(weights_only) (what a checkpoint does), a fresh optimizer
    on a copy of the model, four more steps on both across a refresh (every 2 steps): the same weights, bit for bit."""
    model = _model()
    opt = _soap(model, precondition_frequency=2, max_precond_dim=64)
    batches = [torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(k)) for k in range(7)]

    def step(o, m, x):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        o.step()

    for x in batches[:3]:
        step(opt, model, x)
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = _soap(twin, precondition_frequency=2, max_precond_dim=64)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.state[twin.h[0].mlp.c_proj.weight]["step"] == 2  # the first call measured only
    for x in batches[3:]:
        step(opt, model, x)
        step(opt2, twin, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), _model().parameters()))  # it trained
