"""BlueFog's training helpers: broadcast or average parameters and optimizer state."""

from __future__ import annotations

from typing import Any

from gossamer import optim as core

__all__ = ["allreduce_parameters", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's tensors, in place, with rank ``root_rank``'s. Collective.

    Args:
        params: a ``state_dict`` (its items are taken in sorted key order, as BlueFog), a
            list or iterator of ``(name, tensor)`` pairs (``named_parameters()``), a list of
            tensors, or an ``nn.Module``.
        root_rank (int): the rank whose values everyone takes.

    Raises:
        TypeError: ``params`` is none of those.
    """
    core.broadcast_parameters(params, root_rank)


def allreduce_parameters(params: Any) -> None:
    """Replace every rank's floating-point tensors, in place, by their average. Collective.

    ``params`` is as for :func:`broadcast_parameters`; integer tensors (such as batch-norm's
    ``num_batches_tracked``) are left alone.
    """
    core.allreduce_parameters(params)


def broadcast_optimizer_state(optimizer: Any, root_rank: int) -> None:
    """Give every rank rank ``root_rank``'s optimizer state and hyper-parameters. Collective.

    Args:
        optimizer: a ``torch.optim`` optimizer or one of this module's optimizers (its
            wrapped optimizer is used). Any optimizer works, LBFGS included.
        root_rank (int): the rank whose state everyone takes.
    """
    core.broadcast_optimizer_state(optimizer, root_rank)
