"""8-bit quantization-aware training: torch's fake-quant modules, alone and with 8-bit gossip."""

import pytest
import torch
from torch import nn

import gossamer
from gossamer import optim
from gossamer.compression import fake_quant_modules, quantize_model
from gossamer.models import MLP, SmallCNN
from gossamer.testing import run_distributed


def _blobs(rank=0, n=256):
    """Four Gaussian classes in 16 dimensions, the same centres on every rank."""
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 2
    g = torch.Generator().manual_seed(10 + rank)
    labels = torch.randint(0, 4, (n,), generator=g)
    return centres[labels] + torch.randn(n, 16, generator=g), labels


def test_fake_quantizers_wrap_every_layer_and_quantize_weights_to_8_bits():
    model = SmallCNN()
    model(torch.zeros(1, 1, 8, 8))  # materialise the lazy layer
    quantize_model(model)
    ao_qat = torch.ao.nn.qat
    kinds = [type(m) for m in model.modules() if isinstance(m, ao_qat.Linear | ao_qat.Conv2d)]
    assert len(kinds) == 4  # two convolutions, two linear layers
    names = fake_quant_modules(model)
    assert sum(n.endswith("weight_fake_quant") for n in names) == 4
    assert sum(n.endswith("activation_post_process") for n in names) == 4
    model(torch.rand(8, 1, 8, 8))  # observers see data
    model.apply(torch.ao.quantization.disable_observer)  # freeze the scales to read them
    conv = model.features[0]
    w = conv.weight_fake_quant(conv.weight).detach()
    scale = conv.weight_fake_quant.scale.view(-1, 1, 1, 1)
    codes = w / scale
    assert torch.allclose(codes, codes.round(), atol=1e-3)  # integers...
    assert codes.abs().max() <= 128  # ...in int8's range
    assert len(torch.unique(w[0])) <= 256


def test_qat_training_reduces_the_loss():
    losses = {}
    for qat in (False, True):
        torch.manual_seed(0)
        model = MLP(16, 32, 4)
        if qat:
            quantize_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        x, y = _blobs()
        first = None
        for _ in range(100):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            first = first if first is not None else loss.item()
        losses[qat] = (first, loss.item())
    assert losses[True][1] < 0.2 * losses[True][0]
    # 8-bit weights and activations end a little above full precision (0.0035 and 0.0012).
    assert losses[False][1] < losses[True][1] < 0.01


def test_quantize_model_checks_its_argument():
    with pytest.raises(TypeError, match="model"):
        quantize_model("mlp")
    with pytest.raises(ValueError, match="lazy"):
        quantize_model(SmallCNN())
    plain = nn.Sequential(nn.ReLU(), nn.Dropout()).eval()
    plain[1].qconfig = None  # the user's own: no quantization here
    with pytest.raises(ValueError, match="no layer"):
        quantize_model(plain)
    # refused, and left as it was given
    assert not plain.training and plain[1].qconfig is None
    assert not hasattr(plain, "qconfig") and not hasattr(plain[0], "qconfig")
    with pytest.raises(ValueError, match="averaging"):
        quantize_model(MLP(4, 4, 2), averaging=0.0)


def _qat_choco(steps):
    torch.manual_seed(0)
    model = quantize_model(MLP(16, 32, 4))
    opt = optim.AdaptWithCombine(
        torch.optim.SGD(model.parameters(), lr=0.3), model, compression="uint8"
    )
    x, y = _blobs(gossamer.rank())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses[0], losses[-1], flat


def test_qat_trains_with_8_bit_choco_gossip():
    got = run_distributed(_qat_choco, 2, args=(100,))
    for first, last, _ in got:
        assert last < 0.2 * first
    a, b = got[0][2], got[1][2]
    assert (a - b).norm() < 0.05 * a.norm()  # the ranks' models agree
