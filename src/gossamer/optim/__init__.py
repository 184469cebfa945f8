"""Decentralized optimizers: each wraps a torch optimizer and adds only communication.

============================  ==============================================================
class                         what a step does
============================  ==============================================================
``AdaptWithCombine``          combine parameters during backward, then the local step
``AdaptThenCombine``          local step, then combine (diffusion)
``GradientAllreduce``         average gradients over all ranks during backward, then step
``WindowPut``                 asynchronous: put parameters to neighbours' windows, combine
``WindowAdaptThenCombine``    asynchronous ATC: local step per bucket in backward, put, combine
``PushSum``                   asynchronous push-sum SGD, also on directed graphs
``CliqueAveraging``           average gradients in the D-Clique, momentum step, then combine
``NGC`` / ``CompNGC``         mix self- and cross-gradients (neighbours' data at this model)
``DACFL``                     local training from a consensus estimate tracked by FODAC
``SkewScout``                 wraps one of the above; tunes its period to the accuracy loss
``FedHiSyn``                  ATC on a ring inside each speed group, global average per round
``CoCoFL``                    constrained ranks freeze layers (int8), masked averaging
``MomentumCorrection``        (a helper) momentum on each rank before the gradient is sent
============================  ==============================================================
"""

from __future__ import annotations

from gossamer.optim.base import COMMUNICATIONS, Communicator, DecentralizedOptimizer
from gossamer.optim.cliques import CliqueAveraging
from gossamer.optim.cocofl import CoCoFL, quantize_frozen
from gossamer.optim.combine import AdaptThenCombine, AdaptWithCombine
from gossamer.optim.dacfl import DACFL
from gossamer.optim.fedhisyn import FedHiSyn, group_by_speed, grouped_ring
from gossamer.optim.gradient_allreduce import GradientAllreduce
from gossamer.optim.momentum import MomentumCorrection
from gossamer.optim.ngc import NGC, CompNGC
from gossamer.optim.skewscout import PeriodController, SkewScout
from gossamer.optim.utils import (
    allreduce_parameters,
    broadcast_optimizer_state,
    broadcast_parameters,
    consensus_distance,
)
from gossamer.optim.window import PushSum, WindowAdaptThenCombine, WindowPut

__all__ = [
    "COMMUNICATIONS",
    "DACFL",
    "NGC",
    "AdaptThenCombine",
    "AdaptWithCombine",
    "CliqueAveraging",
    "CoCoFL",
    "Communicator",
    "CompNGC",
    "DecentralizedOptimizer",
    "FedHiSyn",
    "GradientAllreduce",
    "MomentumCorrection",
    "PeriodController",
    "PushSum",
    "SkewScout",
    "WindowAdaptThenCombine",
    "WindowPut",
    "allreduce_parameters",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "consensus_distance",
    "group_by_speed",
    "grouped_ring",
    "quantize_frozen",
]
