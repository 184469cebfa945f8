"""Swap BatchNorm for GroupNorm, which does not depend on the (skewed) batch statistics."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gossamer.data._checks import check_int

__all__ = ["batchnorm_to_groupnorm", "default_num_groups"]

_MAX_DEFAULT_GROUPS = 32


def default_num_groups(num_channels: int) -> int:
    """Return the largest divisor of ``num_channels`` that is at most 32.

    32 groups is the default of Wu and He, *Group Normalization* (ECCV 2018); channel
    counts that 32 does not divide get the nearest smaller divisor (``48 -> 24``,
    ``10 -> 10``, a prime ``37 -> 1``, which is LayerNorm over the channels).

    Raises:
        TypeError: ``num_channels`` is not an int.
        ValueError: ``num_channels < 1``.
    """
    num_channels = check_int(num_channels, "num_channels", minimum=1)
    return next(
        g for g in range(min(_MAX_DEFAULT_GROUPS, num_channels), 0, -1) if num_channels % g == 0
    )


def _convert(bn: _BatchNorm, name: str, num_groups: int | None) -> nn.GroupNorm:
    channels = bn.num_features
    if channels == 0:  # an uninitialised LazyBatchNorm has no channel count yet
        raise ValueError(
            f"layer {name!r} is a lazy BatchNorm that has not seen an input; run one forward "
            "pass before converting"
        )
    if num_groups is not None:
        groups = num_groups
    elif isinstance(bn, nn.BatchNorm1d | nn.LazyBatchNorm1d):
        # A BatchNorm1d often sees (N, C) inputs, where a group of C/G channels holds only
        # C/G values per sample: too few to normalise (one value normalises to zero).
        groups = 1
    else:
        groups = default_num_groups(channels)
    if channels % groups:
        raise ValueError(
            f"num_groups={groups} does not divide the {channels} channels of layer {name!r} "
            f"({type(bn).__name__}); pass num_groups=None to pick a divisor per layer"
        )
    reference = bn.weight if bn.affine else bn.running_mean
    factory = {}
    if reference is not None:
        factory = {"device": reference.device, "dtype": reference.dtype}
    gn = nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine, **factory)
    if bn.affine:
        # Keep the learned scale and shift: for a trained model they are the closest
        # GroupNorm equivalent; the running statistics have no counterpart and are dropped.
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def batchnorm_to_groupnorm(module: nn.Module, num_groups: int | None = None) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a GroupNorm over the same channels.

    Under label skew, each rank's batch statistics describe only its own classes, and so do
    its running statistics (each rank keeps its own: only parameters are averaged): Hsieh et
    al., *The Non-IID Data Quagmire of Decentralized Machine Learning* (SkewScout, ICML 2020),
    found BatchNorm the layer that suffers most, and GroupNorm (Wu and He, 2018), which
    normalises each sample over groups of channels, recovers most of the accuracy.

    Every ``BatchNorm1d``/``2d``/``3d`` (and ``SyncBatchNorm``, lazy variants once
    initialised) becomes ``GroupNorm(num_groups, num_features, eps=bn.eps,
    affine=bn.affine)`` on the same device and dtype; with ``affine=True`` the scale and
    shift are copied. Momentum and running statistics have no GroupNorm counterpart and
    are dropped. GroupNorm takes ``(N, C, *)`` inputs, so a ``BatchNorm1d`` on ``(N, C)``
    or ``(N, C, L)`` still fits. GroupNorm normalises each sample over
    ``(C / G) * prod(*)`` values per group, ``x_hat = (x - mean_g) / sqrt(var_g + eps)``,
    then scales and shifts per channel.

    Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, the conversion is **in
    place**: child layers of ``module`` are replaced and ``module`` itself is returned,
    except when ``module`` is itself a BatchNorm, where the new GroupNorm is returned.
    ``copy.deepcopy`` the model first to keep the original. Build the optimizer after
    converting: the old BatchNorm parameters are no longer part of the model.

    Args:
        module: The model (or a single BatchNorm layer).
        num_groups: Groups for every layer; it must divide every BatchNorm's channel
            count. ``None`` picks, per layer, :func:`default_num_groups` (the largest
            divisor of the channel count that is at most 32) for ``BatchNorm2d``/``3d``,
            and 1 group (LayerNorm over the channels) for ``BatchNorm1d``, whose ``(N, C)``
            inputs have no spatial extent to fill a group.

    Returns:
        ``module`` with its BatchNorms replaced (or the new GroupNorm, see above).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``num_groups`` is not an int.
        ValueError: ``num_groups < 1``, ``num_groups`` does not divide a layer's channels
            (the message names the layer), or a lazy BatchNorm is uninitialised.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48))
        >>> gn = batchnorm_to_groupnorm(net)[1]
        >>> type(gn).__name__, gn.num_groups, gn.num_channels
        ('GroupNorm', 24, 48)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if num_groups is not None:
        num_groups = check_int(num_groups, "num_groups", minimum=1)
    if isinstance(module, _BatchNorm):
        return _convert(module, type(module).__name__, num_groups)
    # Collect first: replacing children while iterating named_modules would skip some.
    # Every name is kept, so that a layer registered twice is replaced at both places by
    # one shared GroupNorm, as it was one shared BatchNorm.
    targets = [
        (n, m) for n, m in module.named_modules(remove_duplicate=False) if isinstance(m, _BatchNorm)
    ]
    # Convert every layer before touching any, so that an error leaves the model unchanged.
    converted: dict[int, nn.GroupNorm] = {}
    for name, bn in targets:
        if id(bn) not in converted:
            converted[id(bn)] = _convert(bn, name, num_groups)
    for name, bn in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, converted[id(bn)])
    return module
