r"""Compressed global averaging: fewer bytes on the wire for gradient allreduce.

:class:`CompressedAllreduce` averages a bucket over all ranks with a compressor from
:mod:`gossamer.compression`:

- quantizers (``uint8``, ``fp16``, ``qsgd``, ``natural``, ...) use scatter-reduce-gather
  (ByteGrad, Bagua): the bucket is split into ``n`` chunks, each compressed on its own;
  ``alltoall`` hands chunk ``k`` of every rank to rank ``k``, which decompresses them,
  reduces its chunk, compresses the result once more, and ``allgather`` shares it. Every
  rank sends about :math:`2\,(n-1)/n` compressed buckets, like a ring allreduce;
- sparsifiers (``topk``, ``randomk``, ``stc``) use ``allgather`` of every rank's payload
  (index and value pairs), which each rank decompresses and reduces.

  Random-k keeps the same positions on every rank (its index stream is shared, see
  :func:`~gossamer.compression.for_rank`), so only its values travel, in one ``allreduce``
  whose call header carries the stream position: ranks whose streams disagree raise
  instead of summing values of different positions. With ``quantize=True`` the values
  travel as 8-bit codes, summed by scatter-reduce-gather as above.

With ``error_feedback=True`` the residual of the first compression is kept per bucket and
added to the next round's input (:class:`~gossamer.compression.ErrorFeedback`); it is on by
default for biased compressors.

Random-k with ``reset=True`` (``"randomk:0.01:reset=true"``) runs *error reset* (CSER, Xie et
al., NeurIPS 2020) instead of delaying what was not sent: with :math:`u_i` this rank's
bucket, :math:`p_i = C(u_i + e_i)` its payload (error feedback, residual :math:`e_i`) and
:math:`\bar p` the average of the payloads, rank :math:`i` gets

.. math:: G_i = u_i + \bar p - p_i

(:math:`n\,(u_i - p_i) + \sum_j p_j` for sums): its own update in full, with its
residual-corrected values replaced by the average on the kept positions. The ranks' models
then differ by their residuals (each rank applies its own at once and withdraws it when it
is sent), while their average moves exactly by the uncompressed average
:math:`\frac1n \sum_i u_i`, so no coordinate waits ``1/ratio`` steps and then jumps.
Same bytes as plain random-k.

Stochastic compressors get per-rank streams (:func:`~gossamer.compression.for_rank`):
QSGD's and natural compression's rounding noise is drawn from a stream of its own on every
rank (``rank_seed(seed, rank)``), so it averages out instead of adding up; random-k's index
stream is common to all ranks. Call ``t`` of a rank draws from the stream of
``(seed', t)``, and ``t`` is in :meth:`CompressedAllreduce.state_dict`, so a resumed run
draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import zlib

import torch

from gossamer import context, ops, transport
from gossamer.communicators.base import Communicator, Pending
from gossamer.compression import (
    Compressor,
    ErrorFeedback,
    Payload,
    RandomK,
    default_error_feedback,
    for_rank,
    get_compressor,
)
from gossamer.ops.collectives import exchange_blocks, reduce_into

__all__ = [
    "CompressedAllreduce",
    "RankStreams",
    "codec_id",
    "configuration_id",
    "rank_compressor",
]

_SPARSIFIERS = ("topk", "randomk", "stc")
# Half types are summed in float32 (as the ops do): a sum of representable values may not be.
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def configuration_id(text: str) -> int:
    """A stable id of a configuration (``text`` describes it) for the call header (0: raw).

    Ranks that configured a call differently then raise, naming ``text``.
    """
    return transport.name_codec(zlib.crc32(text.encode()) & 0x7FFF_FFFF or 1, text)


def codec_id(compressor: Compressor) -> int:
    """The :func:`configuration_id` of ``compressor``."""
    return configuration_id(f"compression={compressor.name!r}")


def typed_codec(codec: int, dtype: torch.dtype) -> int:
    """``codec`` with the tensor's dtype folded in, for the call header.

    Payloads of two dtypes can be the same size (float16 and bfloat16), and decoding one as
    the other gives garbage, not an error.
    """
    typed = (codec ^ zlib.crc32(str(dtype).encode())) & 0x7FFF_FFFF or 1
    of = str(dtype).removeprefix("torch.")
    return transport.name_codec(typed, f"{transport.codec_name(codec)} on {of}")


def rank_compressor(compressor: Compressor) -> Compressor | None:
    """``for_rank(compressor, this rank)``, or None before ``gossamer.init``."""
    if not context.is_initialized():
        return None
    return for_rank(compressor, transport.group_rank(None))


class RankStreams:
    """A mixin for communicators whose ``compressor`` draws from this rank's own stream.

    The rank is known only after ``gossamer.init``: :meth:`_use_rank_streams` swaps in
    ``for_rank(compressor, rank)`` once, at construction or at the first round after it.
    """

    compressor: Compressor
    _ranked = False
    _given = ""  # the compressor's name as given, before a per-rank seed

    def _use_rank_streams(self) -> None:
        """Give the compressor this rank's random stream, once the rank is known."""
        if not self._ranked:
            mine = rank_compressor(self.compressor)
            if mine is not None:
                self._given = self.compressor.name
                self.compressor, self._ranked = mine, True

    def _begin(self, flat: torch.Tensor) -> None:
        """Check a round's tensor, then :meth:`_use_rank_streams`."""
        if not flat.is_floating_point():
            raise TypeError(
                f"{type(self).__name__}: compression={self._given_name()!r} takes "
                f"floating-point tensors; got {flat.dtype}"
            )
        self._use_rank_streams()

    def _compression_state(self) -> dict:
        """The compressor's name (the same on every rank) and its state, for ``state_dict``."""
        return {"compression": self._given_name(), "compressor": self.compressor.state_dict()}

    def _load_compression_state(self, state: dict) -> None:
        """Restore :meth:`_compression_state`, refusing a state of another compressor."""
        saved, mine = state.get("compression"), self._given_name()
        if saved is not None and saved != mine:
            raise ValueError(
                f"state was saved with compression={saved!r}; this {type(self).__name__} "
                f"runs compression={mine!r}"
            )
        self.compressor.load_state_dict(state.get("compressor", {}))

    def _given_name(self) -> str:
        return self._given if self._ranked else self.compressor.name

    def compression_config(self) -> str:
        """``"compression='uint8'"``: the compressor as given (before a per-rank seed)."""
        return f"compression={self._given_name()!r}"


class CompressedAllreduce(RankStreams, Communicator):
    """Each round: the global average (or sum) of the bucket, through a compressor.

    Args:
        compression (str | Compressor): a compressor or its name (``"uint8"``,
            ``"topk:0.01"``, ...; see :func:`gossamer.compression.get_compressor`).
        error_feedback (bool, optional): keep and re-add the compression residual; default:
            on for biased compressors.
        average (bool): divide the sum by the number of ranks.
        global_average_every (int, optional): every K-th round is a full-precision average.
    """

    name = "compressed_allreduce"

    def __init__(
        self,
        compression: str | Compressor = "uint8",
        *,
        error_feedback: bool | None = None,
        average: bool = True,
        global_average_every: int | None = None,
    ) -> None:
        super().__init__(global_average_every=global_average_every)
        self.compressor = get_compressor(compression)
        if error_feedback is None:
            error_feedback = default_error_feedback(self.compressor)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool or None; got {error_feedback!r}")
        if error_feedback and self.compressor.name == "none":
            raise ValueError("error_feedback=True needs a compression; got compression='none'")
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool; got {average!r}")
        if getattr(self.compressor, "reset", False) and not error_feedback:
            raise ValueError(
                f"error_feedback=False with compression={self.compressor.name!r}: error reset "
                "shares the residual this rank has applied, so it needs error feedback"
            )
        self.average = average
        self.feedback = ErrorFeedback(self.compressor) if error_feedback else None
        self.sparse = self.compressor.name.split(":")[0] in _SPARSIFIERS
        self.codec = codec_id(self.compressor)  # of the configuration every rank shares
        self._checked: dict[int, tuple[torch.dtype, int]] = {}  # bucket -> its checked call
        self._use_rank_streams()

    def _use_rank_streams(self) -> None:
        super()._use_rank_streams()
        if self.feedback is not None:  # the residuals' compressor is the same object
            self.feedback.compressor = self.compressor

    def _compress(self, x: torch.Tensor, key: object) -> Payload:
        if self.feedback is None:
            return self.compressor.compress(x)
        return self.feedback.compress(x, key=key)

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        self._begin(flat)
        x = flat.detach().clone()  # the caller may change flat while the round runs
        if x.numel() == 0:  # every rank's bucket is empty alike: nothing to send
            return transport.submit(self.name, lambda: x)
        if isinstance(self.compressor, RandomK):  # its every round checks the call
            return transport.submit(self.name, lambda: self._shared_positions(x, index))
        reduce = self._sparse if self.sparse else self._scatter_gather
        # The payloads hide the tensors' dtype (float16 and bfloat16 ones are the same size):
        # a bucket's first round checks the call itself.
        check = self._checked.get(index) != (x.dtype, x.numel())
        self._checked[index] = (x.dtype, x.numel())

        def run() -> torch.Tensor:
            if check:
                transport.check_same_call(self.name, x, None, codec=self.codec)
            return reduce(x, index)

        return transport.submit(self.name, run)

    def _decode(self, buffer: torch.Tensor, numel: int, like: torch.Tensor) -> torch.Tensor:
        return self.compressor.decompress(Payload(buffer.contiguous(), (numel,), like.dtype))

    def _scatter_gather(
        self, flat: torch.Tensor, index: int, codec: Compressor | None = None
    ) -> torch.Tensor:
        """ByteGrad; with ``codec``, that compressor (without error feedback) instead."""
        n = transport.group_size(None)
        x = flat.reshape(-1)
        # Every chunk is compressed on its own (its own scale), so pad to n equal chunks.
        per = -(-x.numel() // n)
        padded = torch.zeros(per * n, dtype=x.dtype, device=x.device)
        padded[: x.numel()] = x
        coder = codec or self.compressor

        def decode(buffer: torch.Tensor) -> torch.Tensor:
            return coder.decompress(Payload(buffer.contiguous(), (per,), x.dtype))

        chunks = [
            codec.compress(c) if codec else self._compress(c, (index, k))
            for k, c in enumerate(padded.view(n, per))
        ]
        # The call was checked (its first round, or every round for random-k), and the sizes
        # follow from it: no header per collective, which costs a round trip each.
        received = exchange_blocks(torch.cat([c.buffer for c in chunks]), "alltoall", None)
        wide = _WIDE.get(x.dtype, x.dtype)  # half types sum in float32, as ops do
        mine = sum(decode(b).to(wide) for b in received.view(n, -1))
        if self.average:
            mine = mine / n
        mine = mine.to(x.dtype)
        parts = exchange_blocks(coder.compress(mine).buffer, "allgather", None).view(n, -1)
        out = torch.cat([decode(b) for b in parts])
        return out[: x.numel()].view_as(flat)

    def _sparse(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        n = transport.group_size(None)
        payload = self._compress(flat, index)
        sizes = ops.allgather(torch.tensor([payload.nbytes], dtype=torch.int64))
        buffers = ops.allgather(payload.buffer).split(sizes.tolist())
        # Each payload adds its k entries in place: decoding n dense tensors, stacking and
        # summing them was most of a step's CPU time.
        wide = _WIDE.get(flat.dtype)
        total = torch.zeros_like(flat, dtype=wide)
        for buffer in buffers:
            received = Payload(buffer.contiguous(), flat.shape, flat.dtype)
            if wide is None:
                self.compressor.decompress_add_(received, total)
            else:  # half types: a float32 sum, which k half-precision adds could overflow
                total.add_(self.compressor.decompress(received))
        total = total.div_(n) if self.average else total
        return total if wide is None else total.to(flat.dtype)

    def _shared_positions(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        # Every rank kept the same positions: sum the values alone. The header allgather of
        # the allreduce carries (seed, step), so diverged streams raise, never mix.
        payload = self._compress(flat, index)
        head = payload.buffer[:16]
        seed, step = head.view(torch.int64).tolist()
        values = self.compressor.kept_values(payload).clone()
        codec = self.compressor.values_codec  # 8-bit codes are summed as codes (ByteGrad)
        stream = hash((seed, step)) & 0x3FFF_FFFF_FFFF_FFFF
        transport.check_same_call(
            "compressed_allreduce",
            values,
            None,
            aux=stream,
            codec=self.codec,
            explain=lambda aux: f"positions #{aux}",
        )
        if codec is None:
            reduce_into(values, self.average, None)
        else:
            values = self._scatter_gather(values, index, codec)
        out = self.compressor.with_values(payload, values).view_as(flat)
        if self.compressor.reset and self.feedback is not None:
            # Error reset (CSER): this rank applies its own update in full at once, and on
            # the kept positions swaps its own (residual-corrected) values for the average.
            own = self._decode(payload.buffer, flat.numel(), flat).view_as(flat)
            scale = 1 if self.average else transport.group_size(None)
            out = out + scale * (flat - own)
        return out

    def compression_config(self) -> str:
        """The compressor as given, and whether error feedback is on."""
        return f"{super().compression_config()}, error_feedback={self.feedback is not None}"

    def discard_round(self) -> None:
        """Drop the residuals: an overflowed gradient left infinities in them."""
        if self.feedback is not None:
            self.feedback.reset()

    def state_dict(self) -> dict:
        """Rounds, the compressor's state and the error-feedback residuals."""
        state = {**super().state_dict(), **self._compression_state()}
        if self.feedback is not None:
            state["feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` was saved with another compressor, or with error feedback
                where this communicator has none (or the reverse).
        """
        if ("feedback" in state) != (self.feedback is not None):
            saved = "feedback" in state
            raise ValueError(
                f"state was saved with error_feedback={saved}; this CompressedAllreduce runs "
                f"error_feedback={not saved}"
            )
        super().load_state_dict(state)
        self._load_compression_state(state)
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])
