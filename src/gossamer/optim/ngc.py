r"""Neighbourhood Gradient Clustering (NGC) and its compressed form (CompNGC).

Aketi, Kodge and Roy, *Neighborhood Gradient Clustering: An Efficient Decentralized
Learning Method for Non-IID Data Distributions* (arXiv:2209.14390, 2023). With label skew
a rank's own gradient points at its own classes; NGC replaces it with a mix of gradients
of the *same model* on the *neighbours' data*. On an undirected graph with weights
:math:`W` (rank :math:`i` gives :math:`w_{ji}` to neighbour :math:`j`), step :math:`k` of
rank :math:`i` is:

1. exchange models: send :math:`x_i`, receive every neighbour's :math:`x_j`;
2. self-gradient :math:`g_{ii} = \nabla f_i(x_i)` and, for each neighbour :math:`j`, the
   cross-gradient :math:`g_{ji} = \nabla f_i(x_j)` (neighbour j's model on i's batch),
   sent to :math:`j`; receive :math:`g_{ij} = \nabla f_j(x_i)` (this rank's model on
   j's batch) from every neighbour;
3. the NGC gradient, with :math:`\alpha` the weight of the self-gradient,

   .. math:: \tilde g_i = \alpha\, g_{ii} + (1-\alpha) \sum_{j \in N(i)}
       \frac{w_{ji}}{\sum_{l \in N(i)} w_{li}}\, g_{ij};

   the default :math:`\alpha = w_{ii}` gives :math:`\tilde g_i = \sum_j w_{ji} g_{ij}`
   (self included), the paper's :math:`W`-weighted mix;
4. adapt-with-combine with the models already received (no third exchange):
   :math:`x_i \leftarrow \sum_j w_{ji} x_j` (self included), then the wrapped optimizer's
   step with gradient :math:`\tilde g_i` (SGD with momentum: :math:`v \leftarrow \beta v
   + \tilde g_i`, :math:`x_i \leftarrow x_i - \eta v`).

Two exchanges of one model size per neighbour and step (twice D-PSGD's), and
:math:`1 + d_i` forward and backward passes of the local batch.

**CompNGC** sends the cross-gradients through a compressor from
:mod:`gossamer.compression` (default ``"sign"``: 1 bit per element plus one scale, 32x
fewer bytes for float32), with error feedback per (bucket, neighbour) for biased
compressors: :math:`p = C(g_{ji} + e_{ji})`, :math:`e_{ji} \leftarrow g_{ji} + e_{ji} -
D(p)`; the receiver uses :math:`D(p)` for :math:`g_{ji}`. Models travel uncompressed.
:attr:`NGC.bytes_sent` counts the payload bytes of both exchanges.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gossamer import context, ops, transport
from gossamer.communicators import NoCommunication
from gossamer.communicators.compressed import codec_id
from gossamer.compression import (
    Compressor,
    ErrorFeedback,
    Payload,
    default_error_feedback,
    for_rank,
    get_compressor,
)
from gossamer.optim.base import DEFAULT_FUSION_BYTES, DecentralizedOptimizer
from gossamer.topology import Topology

__all__ = ["NGC", "CompNGC"]

_OP = "cross_gradient"


def _check_alpha(alpha: object) -> float | None:
    if alpha is None:
        return None
    said = f"alpha must be a number in [0, 1] or None; got {alpha!r}"
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(said)
    if not 0 <= alpha <= 1:
        raise ValueError(said)
    return float(alpha)


class NGC(DecentralizedOptimizer):
    r"""Neighbourhood gradient clustering over a static undirected graph (see the module).

    :meth:`step` needs a closure that computes this rank's loss on its current batch *at
    the model's current parameters* and returns it, without calling ``backward`` or
    ``zero_grad``: NGC calls it once at its own model and once at every neighbour's model
    (which it writes into the parameters for that call) and takes the gradients itself.

    Args:
        optimizer (torch.optim.Optimizer): the local optimizer (the paper: SGD with
            momentum); it steps with the NGC gradient.
        model (nn.Module | Sequence[nn.Module]): the model(s) owning its parameters.
        topology (Topology, optional): an undirected graph (``A = A^T``) with the mixing
            weights; default: the group's default topology.
        alpha (float, optional): weight of the self-gradient in [0, 1]; default
            :math:`w_{ii}` (the plain :math:`W`-weighted mix).
        compression (str | Compressor, optional): compress the cross-gradients (CompNGC).
        error_feedback (bool, optional): error feedback for the cross-gradients; default:
            on for biased compressors.
        fusion_threshold_bytes (int | None): bucket size of the exchanges.

    Raises:
        TypeError: ``topology`` is not a Topology, or ``alpha`` not a number.
        ValueError: the graph is directed or of another size than the world, ``alpha``
            outside [0, 1], an unknown compressor, ``error_feedback`` without one.

    Example:
        >>> opt = NGC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
        ...           topology=gossamer.topology.ring(gossamer.size()))
        >>> opt.step(lambda: loss_fn(model(x), y))
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        topology: Topology | None = None,
        alpha: float | None = None,
        compression: str | Compressor | None = None,
        error_feedback: bool | None = None,
        fusion_threshold_bytes: int | None = DEFAULT_FUSION_BYTES,
    ) -> None:
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
        self.alpha = _check_alpha(alpha)
        compressor = get_compressor(compression)
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool or None; got {error_feedback!r}")
        if error_feedback and compressor.name == "none":
            raise ValueError("error_feedback=True needs a compression; got none")
        super().__init__(
            optimizer,
            model,
            communicator=NoCommunication(),
            fusion_threshold_bytes=fusion_threshold_bytes,
        )
        graph = ops.get_topology() if topology is None else topology
        size = context.size()
        if graph.size != size:
            raise ValueError(f"topology has {graph.size} ranks but the world has {size}")
        adjacency = graph.adjacency
        if not (adjacency == adjacency.T).all():
            raise ValueError(
                f"topology {graph.name or 'given'} is directed: NGC sends cross-gradients back "
                "along every edge, so it needs an undirected graph"
            )
        self.topology = graph
        me = context.rank()
        self.self_weight, self.weights = graph.recv_weights(me)
        self.neighbors = sorted(self.weights)
        # Stochastic rounding noise independent per rank (random-k keeps a shared stream);
        # the call check compares the configuration every rank shares.
        self.codec = codec_id(compressor) if compressor.name != "none" else 0
        self.compressor = compressor = for_rank(compressor, me)
        if error_feedback is None:
            error_feedback = compressor.name != "none" and default_error_feedback(compressor)
        self.error_feedback = ErrorFeedback(compressor) if error_feedback else None
        #: payload bytes this rank sent: ``{"models": ..., "cross_gradients": ...}``
        self.bytes_sent = {"models": 0, "cross_gradients": 0}

    # ------------------------------------------------------------------ the step
    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built)."""
        return {**super().settings(), "topology": self.topology, "alpha": self.alpha}

    def _check_loss_scaler(self) -> None:
        raise RuntimeError(
            "NGC computes its gradients in step(closure), at its neighbours' models too, "
            "so a loss scaler (torch.amp.GradScaler) cannot unscale or check them: step NGC "
            "directly (bfloat16 autocast needs no loss scaling)"
        )

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """One NGC step; ``closure()`` returns the local batch's loss at the current model.

        Returns:
            The loss at this rank's own model (before the step).
        """
        if closure is None or not callable(closure):
            raise ValueError(
                "NGC.step needs closure=, a function returning this rank's loss at the "
                f"model's current parameters (it is evaluated at the neighbours' models); got "
                f"{closure!r}"
            )
        own = [b.pack().clone() for b in self.buckets]
        theirs = self._exchange_models(own)
        try:
            loss, self_grads = self._gradients_at(own, closure)
            cross = {j: self._gradients_at(theirs[j], closure)[1] for j in self.neighbors}
        finally:
            self._write_params(own)
        received = self._exchange_gradients(cross)
        grads = [self._mix_gradient(i, g, received) for i, g in enumerate(self_grads)]
        mixed = [self._mix_models(i, x, theirs) for i, x in enumerate(own)]
        self._write_params(mixed)
        for bucket, g in zip(self.buckets, grads, strict=True):
            for p in bucket.tensors:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            bucket.unpack(g, lambda p: p.grad)
        self.optimizer.step()
        self.steps += 1
        return loss

    def _exchange_models(self, own: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        if not self.neighbors:
            return {}
        peers = self.neighbors
        handles = [
            ops.neighbor_allgather(x.view(1, -1), src_ranks=peers, dst_ranks=peers, async_op=True)
            for x in own
        ]
        rows = [h.wait() for h in handles]
        self.bytes_sent["models"] += sum(x.nbytes for x in own) * len(peers)
        return {j: [r[k] for r in rows] for k, j in enumerate(peers)}

    def _write_params(self, flats: list[torch.Tensor]) -> None:
        for bucket, flat in zip(self.buckets, flats, strict=True):
            bucket.unpack(flat, lambda p: p.data)

    def _gradients_at(
        self, flats: list[torch.Tensor], closure: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loss and the gradient of every bucket with the parameters set to ``flats``."""
        self._write_params(flats)
        with torch.enable_grad():
            loss = closure()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"NGC's closure must return a scalar loss tensor; got {loss!r}")
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        by_param = dict(zip(self.params, grads, strict=True))
        return loss.detach(), [b.pack(lambda p: by_param[p]).clone() for b in self.buckets]

    def _exchange_gradients(
        self, cross: dict[int, list[torch.Tensor]]
    ) -> list[dict[int, torch.Tensor]]:
        """Send ``cross[j][b]`` to j for every bucket b; return what each neighbour sent."""
        peers = self.neighbors
        out: list[dict[int, torch.Tensor]] = []
        for index, bucket in enumerate(self.buckets):
            if not peers:
                out.append({})
                continue
            sends = {j: self._encode(cross[j][index], index, j) for j in peers}
            self.bytes_sent["cross_gradients"] += sum(t.nbytes for t in sends.values())
            probe = sends[peers[0]]

            def body(sends=sends, probe=probe) -> dict[int, torch.Tensor]:
                got = transport.exchange(
                    _OP, probe, sends, peers, any_first_dim=True, codec=self.codec
                )
                return {s: t.clone() for s, t in got.items()}

            raw = transport.run(_OP, body, async_op=False)
            out.append({s: self._decode(t, bucket.flat) for s, t in raw.items()})
        return out

    def _encode(self, grad: torch.Tensor, index: int, peer: int) -> torch.Tensor:
        if self.compressor.name == "none":
            return grad
        if self.error_feedback is not None:
            return self.error_feedback.compress(grad, key=(index, peer)).buffer
        return self.compressor.compress(grad).buffer

    def _decode(self, data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.compressor.name == "none":
            return data
        return self.compressor.decompress(Payload(data.contiguous(), like.shape, like.dtype))

    def _mix_gradient(
        self, index: int, own: torch.Tensor, received: list[dict[int, torch.Tensor]]
    ) -> torch.Tensor:
        total = sum(self.weights.values())
        if not self.neighbors or total == 0:
            return own
        alpha = self.self_weight if self.alpha is None else self.alpha
        mix = own * alpha
        for j, w in self.weights.items():
            mix = mix + received[index][j] * ((1 - alpha) * w / total)
        return mix

    def _mix_models(
        self, index: int, own: torch.Tensor, theirs: dict[int, list[torch.Tensor]]
    ) -> torch.Tensor:
        mix = own * self.self_weight
        for j, w in self.weights.items():
            mix = mix + theirs[j][index] * w
        return mix

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.optimizer).__name__}, "
            f"{self.topology.name or 'topology'}, compression={self.compressor.name!r}, "
            f"{len(self.buckets)} buckets)"
        )

    # ------------------------------------------------------------------ state
    def _comm_state(self) -> dict:
        residuals = {} if self.error_feedback is None else self.error_feedback.state_dict()
        return {
            **super()._comm_state(),
            "compressor": self.compressor.state_dict(),  # its random stream's position
            "error_feedback": residuals,
            "bytes_sent": dict(self.bytes_sent),
        }

    def _load_comm_state(self, state: dict) -> None:
        residuals = state.get("error_feedback") or {}
        if residuals and self.error_feedback is None:
            raise ValueError(
                "state['error_feedback'] holds residuals but this optimizer runs without "
                "error feedback (saved from a CompNGC with another compressor?)"
            )
        super()._load_comm_state(state)
        if "compressor" in state:  # absent from checkpoints of earlier versions
            self.compressor.load_state_dict(state["compressor"])
        if self.error_feedback is not None:
            if residuals:
                self.error_feedback.load_state_dict(residuals)
            else:
                self.error_feedback.reset()
        self.bytes_sent = dict(state.get("bytes_sent", {"models": 0, "cross_gradients": 0}))


class CompNGC(NGC):
    """NGC with compressed cross-gradients (default ``"sign"``, about 32x fewer bytes).

    Same arguments as :class:`NGC`; ``compression`` defaults to ``"sign"`` and
    ``error_feedback`` to on for biased compressors.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        compression: str | Compressor = "sign",
        **kwargs,
    ) -> None:
        if get_compressor(compression).name == "none":
            raise ValueError("CompNGC needs a compression other than 'none'; use NGC instead")
        super().__init__(optimizer, model, compression=compression, **kwargs)
