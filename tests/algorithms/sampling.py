"""A communicator that samples, to check that its generator's state is saved and restored."""

import torch

import gossamer
from gossamer.communicators import Communicator


class RandomShift(Communicator):
    """Each round every rank draws the same shift s (same seed), averages with rank r - s and
    sends to rank r + s. What it draws next depends on its generator's state."""

    name = "random_shift"

    def __init__(self, seed):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.shift = 1

    def _advance(self):
        self.shift = int(torch.randint(1, gossamer.size(), (1,), generator=self.generator))

    def _start(self, flat, index):
        r, n = gossamer.rank(), gossamer.size()
        return gossamer.neighbor_allreduce(
            flat,
            self_weight=0.5,
            src_weights={(r - self.shift) % n: 0.5},
            dst_weights={(r + self.shift) % n: 1.0},
            async_op=True,
        )
