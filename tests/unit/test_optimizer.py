"""Parameter groups and optimizer kernels: no weight decay on 1-D parameters (norm weights,
biases), decided by name when sharding has flattened every parameter; the kernel choice (fused on
CUDA, foreach on CPU and under an fp16 GradScaler); the optimizer gets the effective lr, weight
decay and kernel; a step the GradScaler skips moves neither weights nor optimizer state (SGD and
AdamW); LAMB and LARS are timm's, without its LAMB's own gradient clipping, with no decay and no
per-tensor rescaling on norm weights and biases, on foreach kernels."""

import pytest
import torch
from torch import nn

from trainer.configuration.spec import choice_config
from trainer.groups.optimizer.build import OptimizerRecipe, choose_implementation
from trainer.groups.optimizer.parameters import one_dimensional, parameter_groups


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


def test_no_decay_on_norm_weights_and_biases_by_default():
    groups = parameter_groups(_net(), 0.1, decay_norm_and_bias=False)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.ndim > 1 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])
    assert len(groups[1]["params"]) == 3  # BN weight, BN bias, Linear bias
    everything = parameter_groups(_net(), 0.1, decay_norm_and_bias=True)
    assert len(everything) == 1 and len(everything[0]["params"]) == 5


class _Wrapped(nn.Module):
    """Stands in for FSDP with use_orig_params: the same parameters under a wrapper prefix, each
    flattened to its 1-D shard by the time the optimizer is built."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = inner


def test_no_decay_is_decided_by_name_when_sharding_has_flattened_every_parameter():
    net = _net()
    names = one_dimensional(net)
    assert names == {"1.weight", "1.bias", "3.bias"}
    wrapped = _Wrapped(net)
    for param in wrapped.parameters():
        param.data = param.data.flatten()
    by_shape = parameter_groups(wrapped, 0.1, decay_norm_and_bias=False)
    assert len(by_shape) == 2 and by_shape[0]["params"] == []  # every weight would escape decay
    groups = parameter_groups(wrapped, 0.1, decay_norm_and_bias=False, no_decay_names=names)
    assert [len(g["params"]) for g in groups] == [2, 3]  # conv and linear weights decay, as unwrapped


def test_implementation_choice():
    adamw = choice_config("optimizer", "adamw")
    assert choose_implementation("auto", "cuda", grad_scaler=False, cfg=adamw)[0] == "fused"
    impl, why = choose_implementation("auto", "cpu", grad_scaler=False, cfg=adamw)  # torch has fused CPU kernels
    assert impl == "fused" and "fused kernels for cpu" in why
    impl, why = choose_implementation("auto", "cpu", grad_scaler=False, cfg=choice_config("optimizer", "lamb"))
    assert impl == "foreach" and "no fused kernel" in why
    impl, why = choose_implementation("auto", "cuda", grad_scaler=True, cfg=adamw)
    assert impl == "foreach" and "GradScaler" in why
    assert choose_implementation("for_loop", "cpu", False, adamw) == ("for_loop", "for_loop (as configured)")


@pytest.mark.parametrize("cfg", [choice_config("optimizer", "sgd"), choice_config("optimizer", "adamw")], ids=["sgd", "adamw"])
@pytest.mark.parametrize("implementation", ["fused", "foreach", "for_loop"])
def test_optimizer_gets_the_effective_values_and_kernel(cfg, implementation):
    opt = OptimizerRecipe.for_network(_net(), cfg, 0.03, 0.2, implementation).build(_net())
    assert [g["lr"] for g in opt.param_groups] == [0.03, 0.03]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert bool(opt.param_groups[0].get("fused")) is (implementation == "fused")


@pytest.mark.parametrize("cfg", [choice_config("optimizer", "sgd"), choice_config("optimizer", "adamw")], ids=["sgd", "adamw"])
def test_a_step_the_grad_scaler_skips_leaves_weights_and_state_unchanged(cfg):
    """The default kernel under fp16 (foreach) must not move anything on an overflow step."""
    torch.manual_seed(0)
    net = _net()
    implementation, _ = choose_implementation("auto", "cpu", grad_scaler=True, cfg=cfg)
    opt = OptimizerRecipe.for_network(net, cfg, 0.1, 0.01, implementation).build(net)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(4, 3, 6, 6)
    # One good step to create momentum / Adam moments.
    scaler.scale(net(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in net.named_parameters()}
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.state.items()}
    # An overflowing step: every gradient is inf.
    scaler.scale(net(x).sum()).backward()
    for p in net.parameters():
        p.grad.fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0  # the scaler saw the overflow and backed off
    for k, v in net.named_parameters():
        assert torch.equal(v, weights[k]), k
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[id(p)][k])), k


def test_lamb_and_lars_have_no_fused_kernel():
    for name in ("lamb", "lars"):
        for requested in ("auto", "fused"):
            impl, why = choose_implementation(requested, "cuda", grad_scaler=False, cfg=choice_config("optimizer", name))
            assert impl == "foreach" and f"{name} has no fused kernel" in why
        assert choose_implementation("for_loop", "cuda", False, choice_config("optimizer", name))[0] == "for_loop"


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_are_timms_with_the_frameworks_groups_and_no_clipping_of_their_own(name):
    from timm.optim import Lamb, Lars

    opt = OptimizerRecipe.for_network(_net(), choice_config("optimizer", name), 0.03, 0.2).build(_net())
    assert isinstance(opt, {"lamb": Lamb, "lars": Lars}[name])
    assert [g["lr"] for g in opt.param_groups] == [0.03, 0.03]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert opt.defaults["foreach"] is True and not opt.defaults.get("always_adapt")
    if name == "lamb":
        assert opt.defaults["max_grad_norm"] is None  # the clipping group clips, not the optimizer


def test_lamb_steps_each_weight_by_its_trust_ratio_and_leaves_biases_unscaled():
    """A LAMB step moves a decayed tensor by about lr x its norm (the trust ratio), whatever the
    gradient's size; a bias (no decay, no rescaling) moves by Adam's lr-sized step."""
    torch.manual_seed(0)
    net = nn.Linear(16, 4)
    before_w, before_b = net.weight.detach().clone(), net.bias.detach().clone()
    opt = OptimizerRecipe.for_network(net, choice_config("optimizer", "lamb"), 0.01, 0.0001).build(net)
    (net(torch.randn(8, 16)).sum() * 1000).backward()  # a huge gradient
    opt.step()
    moved = (net.weight.detach() - before_w).norm() / before_w.norm()
    assert moved == pytest.approx(0.01, rel=0.05)
    assert (net.bias.detach() - before_b).abs().max() == pytest.approx(0.01, rel=0.05)


def test_importing_timms_optimizers_leaves_dynamos_recompile_limit_as_it_was():
    """timm.optim's import sets Dynamo's recompile limit to 1,000,000 process-wide (for its Kron
    optimizer); reached through the optimizer group it is put back, so that compile.dynamic=false
    still meets the limit and says so. timm.optim is imported afresh here (its modules taken out of
    sys.modules and put back after), so that timm's assignment really runs."""
    import sys

    from trainer.groups.optimizer.registry import locate_optimizer

    config = torch._dynamo.config
    kept = {name: module for name, module in sys.modules.items() if name == "timm.optim" or name.startswith("timm.optim.")}
    for name in kept:
        del sys.modules[name]
    try:
        with config.patch(recompile_limit=8):
            assert locate_optimizer("timm.optim.lamb.Lamb").__name__ == "Lamb"
            assert config.recompile_limit == 8
            for name in [n for n in sys.modules if n == "timm.optim" or n.startswith("timm.optim.")]:
                del sys.modules[name]
            import timm.optim  # noqa: F401 - what the guard undoes, seen unguarded
            assert config.recompile_limit == 1_000_000
    finally:
        sys.modules.update(kept)
        if "timm.optim" in kept:  # the package's attribute too, as the import had left it
            sys.modules["timm"].optim = kept["timm.optim"]  # type: ignore[attr-defined]
