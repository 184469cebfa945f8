"""Bagua's algorithms, by module as in ``bagua.torch_api.algorithms``, and their registry.

=================================  ========================================================
name (``Algorithm.init(name)``)    class
=================================  ========================================================
``gradient_allreduce``             ``gradient_allreduce.GradientAllReduceAlgorithm``
``bytegrad``                       ``bytegrad.ByteGradAlgorithm``
``decentralized``                  ``decentralized.DecentralizedAlgorithm``
``low_precision_decentralized``    ``decentralized.LowPrecisionDecentralizedAlgorithm``
``qadam``                          ``q_adam.QAdamAlgorithm``
``async``                          ``async_model_average.AsyncModelAverageAlgorithm``
=================================  ========================================================
"""

from __future__ import annotations

from gossamer.bagua.algorithms import (
    async_model_average,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)
from gossamer.bagua.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "gradient_allreduce",
    "q_adam",
]

for _name, _cls, _description in (
    (
        "gradient_allreduce",
        gradient_allreduce.GradientAllReduceAlgorithm,
        "Gradient AllReduce Algorithm",
    ),
    ("bytegrad", bytegrad.ByteGradAlgorithm, "ByteGrad Algorithm"),
    ("decentralized", decentralized.DecentralizedAlgorithm, "Decentralized SGD Algorithm"),
    (
        "low_precision_decentralized",
        decentralized.LowPrecisionDecentralizedAlgorithm,
        "Low Precision Decentralized SGD Algorithm",
    ),
    ("qadam", q_adam.QAdamAlgorithm, "QAdam Algorithm"),
    (
        "async",
        async_model_average.AsyncModelAverageAlgorithm,
        "Asynchronous Model Average Algorithm",
    ),
):
    if _name not in GlobalAlgorithmRegistry:
        GlobalAlgorithmRegistry.register(_name, _cls, description=_description)
