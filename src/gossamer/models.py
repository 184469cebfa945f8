"""Small models for examples, tests and benchmarks (no downloads, CPU friendly)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP", "SmallCNN", "SmallResNet"]


def _sizes(minimum: int, **sizes: object) -> None:
    """Raise naming the first of ``sizes`` that is not an int >= ``minimum`` (bools refused)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


class MLP(nn.Sequential):
    """``depth`` hidden layers of ``hidden`` units with ReLU."""

    def __init__(self, inputs: int, hidden: int, outputs: int, depth: int = 2) -> None:
        _sizes(1, inputs=inputs, hidden=hidden, outputs=outputs)
        _sizes(0, depth=depth)
        layers: list[nn.Module] = []
        width = inputs
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, outputs))
        super().__init__(nn.Flatten(), *layers)


class SmallCNN(nn.Module):
    """Two convolutions and a linear head, for 8x8 images such as scikit-learn's digits.

    The head's first layer is lazy (``nn.LazyLinear``, sized by the image): run one forward
    pass, e.g. ``model(torch.zeros(1, channels, 8, 8))``, before building an optimizer.
    """

    def __init__(self, classes: int = 10, channels: int = 1) -> None:
        _sizes(1, classes=classes, channels=channels)
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, classes)``."""
        return self.head(self.features(x))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    """A ResNet-18-style network for 32x32 images: three stages of ``blocks`` basic blocks."""

    def __init__(self, classes: int = 10, width: int = 16, blocks: int = 1) -> None:
        _sizes(1, classes=classes, width=width, blocks=blocks)
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                stages.append(_Block(cin, cout, 2 if i and not j else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, classes)``."""
        return self.head(self.stages(self.stem(x)))
