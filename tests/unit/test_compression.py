"""The compressor interface: round trips, payload sizes, the wire format, errors, the registry."""

from __future__ import annotations

import ast
import copy
import dataclasses
import doctest
import importlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gossamer.compression import (
    BF16,
    FP16,
    QSGD,
    STC,
    Compressor,
    MinMaxUInt8,
    Natural,
    NaturalDithering,
    NoCompression,
    Payload,
    RandomK,
    Sign,
    TopK,
    available_compressors,
    default_error_feedback,
    get_compressor,
)

COMPRESSORS = {
    "none": NoCompression(),
    "fp16": FP16(),
    "bf16": BF16(),
    "uint8": MinMaxUInt8(),
    "uint8-chunks5": MinMaxUInt8(5),
    "qsgd4": QSGD(4),
    "qsgd127-bucket3": QSGD(127, bucket=3),
    "natural": Natural(),
    "natural_dithering3": NaturalDithering(3, bucket=100),
    "topk": TopK(0.1),
    "randomk": RandomK(0.1),
    "randomk-unbiased": RandomK(0.3, unbiased=True, seed=5),
    "randomk-quantize": RandomK(0.3, quantize=True, seed=2),
    "randomk-quantize-3bits": RandomK(0.3, quantize=True, bits=3, seed=2),
    "stc": STC(0.1),
    "sign": Sign(),
}
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(), (0,), (1,), (7,), (9,), (3, 5), (2, 0, 3), (1001,), (64, 33)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tensor(shape, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)


def _ids(values):
    return [str(v).replace("torch.", "") for v in values]


@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("dtype", FLOATS, ids=_ids(FLOATS))
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_keeps_shape_dtype_and_sizes(compressor, dtype, shape, device):
    x = _tensor(shape, dtype, device=device)
    payload = compressor.compress(x)
    assert payload.buffer.device == x.device
    bound = compressor.payload_nbytes(x.numel(), dtype)
    assert payload.buffer.dtype == torch.uint8 and payload.buffer.dim() == 1
    assert payload.buffer.is_contiguous()
    assert payload.nbytes == payload.buffer.numel()
    if compressor.exact_nbytes:
        assert payload.nbytes == bound
    else:
        assert payload.nbytes <= bound
    if x.numel() == 0:
        assert payload.nbytes == 0
    y = compressor.decompress(payload)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("numel", [1, 2, 8, 100, 513, 4097, 100_003])
def test_payload_nbytes_is_exact_or_a_tight_bound(compressor, numel):
    for dtype in (torch.float32, torch.float16):
        payload = compressor.compress(_tensor((numel,), dtype, seed=numel))
        bound = compressor.payload_nbytes(numel, dtype)
        if compressor.exact_nbytes:
            assert payload.nbytes == bound
        else:  # STC: the bound assumes the worst gaps; it stays within 2x of a real payload
            assert payload.nbytes <= bound < 2 * payload.nbytes + 16


@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("device", DEVICES)
def test_payload_rebuilt_from_bytes_decodes_the_same(compressor, device):
    x = _tensor((3, 333), torch.float32, seed=1, device=device)
    payload = compressor.compress(x)
    expected = compressor.decompress(payload)
    received = Payload(payload.buffer.clone(), tuple(x.shape), torch.float32)
    torch.testing.assert_close(compressor.decompress(received), expected, rtol=0, atol=0)
    # A payload cut out of a larger receive buffer at an odd offset.
    big = torch.zeros(payload.nbytes + 3, dtype=torch.uint8, device=device)
    big[1 : 1 + payload.nbytes] = payload.buffer
    shifted = Payload(big[1 : 1 + payload.nbytes], x.shape, torch.float32)
    torch.testing.assert_close(compressor.decompress(shifted), expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("dtype", FLOATS, ids=_ids(FLOATS))
@pytest.mark.parametrize("numel", [4097, 1_100_007], ids=["small", "several-cpu-blocks"])
def test_a_cuda_payload_decodes_on_the_host_as_the_host_would_encode(compressor, dtype, numel):
    # Staged gloo sends a CUDA payload's bytes through host memory. The two devices may
    # round the arithmetic differently (an ulp, or a sum in another order), hence
    # assert_close; 16-bit inputs have ties among the largest magnitudes, which the two
    # devices' top-k may break differently, hence no host round trip for them.
    x = _tensor((numel,), dtype, seed=2, device="cuda")
    twin = copy.deepcopy(compressor)  # at the same step of its random stream
    payload = compressor.compress(x)
    on_host = compressor.decompress(Payload(payload.buffer.cpu(), tuple(x.shape), dtype))
    torch.testing.assert_close(on_host, compressor.decompress(payload).cpu())
    stochastic = isinstance(compressor, QSGD | Natural | NaturalDithering)
    if not stochastic and dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(on_host, twin.decompress(twin.compress(x.cpu())))


def test_threads_encoding_at_once_get_their_own_temporaries():
    # uint8 keeps its block temporaries per thread (float64: float32 takes the kernel,
    # which has none); two threads interleaving must not see each other's.
    compressor = MinMaxUInt8(chunks=3)
    inputs = [_tensor((3 * (1 << 19) + 5,), torch.float64, seed=s) for s in range(4)]
    expected = [compressor.compress(x).buffer for x in inputs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda x: compressor.compress(x).buffer, inputs))
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("dtype", FLOATS, ids=_ids(FLOATS))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (1001,), (64, 33)], ids=str)
def test_in_place_sums_add_exactly_what_decompress_returns(compressor, dtype, shape):
    x, start = _tensor(shape, dtype, seed=2), _tensor(shape, dtype, seed=3)
    fused, plain = copy.deepcopy(compressor), copy.deepcopy(compressor)  # same random state
    expected_payload = plain.compress(x)
    expected = start + plain.decompress(expected_payload)
    tracked = start.clone()
    payload = fused.compress_add_(x, tracked)
    assert torch.equal(payload.buffer, expected_payload.buffer)
    assert torch.equal(tracked, expected)
    received = start.clone()
    assert compressor.decompress_add_(payload, received) is received
    assert torch.equal(received, expected)
    if x.dim() == 2:  # a non-contiguous target takes the unfused path
        column_major = start.t().clone().t()
        assert torch.equal(compressor.decompress_add_(payload, column_major), expected)


@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("rows", [1, 5], ids=["one-element", "five-elements"])
def test_strided_inputs_encode_like_their_copies(compressor, rows):
    # A column of a row-major matrix; torch calls the one-element column contiguous.
    column = _tensor((rows, 3), torch.float32, seed=4)[:, 0]
    fused, plain = copy.deepcopy(compressor), copy.deepcopy(compressor)
    assert torch.equal(fused.compress(column).buffer, plain.compress(column.clone()).buffer)


def test_a_strided_target_that_requires_grad_is_summed_into_without_autograd():
    c, x = MinMaxUInt8(), torch.ones(4)
    weight = torch.zeros(4, 2, requires_grad=True)
    payload = c.compress_add_(x, weight[:, 0])
    c.decompress_add_(payload, weight[:, 1])
    assert torch.equal(weight.detach(), torch.ones(4, 2))  # and no autograd error above


def test_in_place_sums_check_their_target():
    c, x = MinMaxUInt8(), torch.ones(4)
    payload = c.compress(x)
    with pytest.raises(ValueError, match=r"target must be a torch\.float32 tensor of shape \(4,\)"):
        c.decompress_add_(payload, torch.zeros(5))
    with pytest.raises(ValueError, match=r"target must be a torch\.float32.*got torch\.float64"):
        c.compress_add_(x, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"target must be a torch\.Tensor; got list"):
        c.decompress_add_(payload, [0.0] * 4)


@pytest.mark.parametrize(
    ("compressor", "tolerance"),
    [
        (NoCompression(), 0.0),
        (FP16(), 2.0**-11),
        (BF16(), 2.0**-8),
        (TopK(1.0), 0.0),
        (RandomK(1.0), 0.0),
        (RandomK(1.0, unbiased=True), 0.0),
    ],
    ids=["none", "fp16", "bf16", "topk-all", "randomk-all", "randomk-unbiased-all"],
)
def test_lossless_and_cast_errors(compressor, tolerance):
    x = _tensor((1000,), torch.float32, seed=2)
    y = compressor.decompress(compressor.compress(x))
    assert torch.all((y - x).abs() <= tolerance * x.abs())


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64], ids=str
)
def test_no_compression_passes_every_dtype(dtype):
    x = (torch.arange(12) % 3).reshape(3, 4).to(dtype)
    compressor = NoCompression()
    payload = compressor.compress(x)
    assert payload.nbytes == compressor.payload_nbytes(12, dtype) == 12 * x.element_size()
    assert torch.equal(compressor.decompress(payload), x)


@pytest.mark.parametrize(
    "compressor", [c for k, c in COMPRESSORS.items() if k != "none"], ids=list(COMPRESSORS)[1:]
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn], ids=str)
def test_non_floating_tensors_are_refused_naming_argument_and_dtype(compressor, dtype):
    with pytest.raises(TypeError, match=rf"tensor must have a floating dtype.*{dtype}"):
        compressor.compress(torch.zeros(4, dtype=dtype))
    with pytest.raises(TypeError, match=rf"dtype must have a floating dtype.*{dtype}"):
        compressor.payload_nbytes(4, dtype)


def test_argument_errors():
    compressor = TopK(0.5)
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor; got list"):
        compressor.compress([1.0, 2.0])
    with pytest.raises(TypeError, match="payload must be a Payload; got Tensor"):
        compressor.decompress(torch.zeros(3))
    with pytest.raises(ValueError, match="numel must be >= 0; got -1"):
        compressor.payload_nbytes(-1)
    with pytest.raises(TypeError, match="numel must be an int; got '3'"):
        compressor.payload_nbytes("3")
    payload = compressor.compress(torch.ones(10))
    with pytest.raises(ValueError, match=r"payload.nbytes must be 23 .*got 22"):
        compressor.decompress(Payload(payload.buffer[:-1], (10,), torch.float32))
    with pytest.raises(ValueError, match="at most"):
        STC(0.5).decompress(Payload(torch.zeros(999, dtype=torch.uint8), (10,), torch.float32))
    with pytest.raises(TypeError, match=r"buffer must be a torch\.uint8 tensor; got torch\.float"):
        Payload(torch.zeros(3), (3,), torch.float32)
    with pytest.raises(ValueError, match="buffer must be 1-D and contiguous"):
        Payload(torch.zeros(2, 3, dtype=torch.uint8), (6,), torch.float32)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype; got 'float32'"):
        Payload(torch.zeros(3, dtype=torch.uint8), (3,), "float32")
    with pytest.raises(TypeError, match="shape must be a sequence of ints; got 3"):
        Payload(torch.zeros(3, dtype=torch.uint8), 3, torch.float32)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: TopK(0.0), r"ratio must be in \(0, 1\]; got 0.0"),
        (lambda: TopK(1.5), r"ratio must be in \(0, 1\]; got 1.5"),
        (lambda: STC(float("nan")), r"ratio must be in \(0, 1\]; got nan"),
        (lambda: RandomK("0.1"), "ratio must be a float; got '0.1'"),
        (lambda: RandomK(0.1, unbiased=1), "unbiased must be a bool; got 1"),
        (lambda: RandomK(0.1, reset="yes"), "reset must be a bool; got 'yes'"),
        (lambda: RandomK(0.1, unbiased=True, reset=True), "reset=True needs the biased"),
        (lambda: MinMaxUInt8(0), r"chunks must be >= 1; got 0"),
        (lambda: QSGD(128), r"levels must be in \[1, 127\]; got 128"),
        (lambda: QSGD(4, bucket=0), "bucket must be >= 1; got 0"),
        (lambda: NaturalDithering(True), "levels must be an int; got True"),
        (lambda: Natural(seed=-1), r"seed must be in \[0, 9223372036854775807\]; got -1"),
    ],
    ids=[
        "ratio-0",
        "ratio-1.5",
        "ratio-nan",
        "ratio-str",
        "unbiased",
        "reset",
        "reset-unbiased",
        "chunks",
        "levels",
        "bucket",
        "levels-bool",
        "seed",
    ],
)
def test_constructor_errors_name_argument_and_value(factory, message):
    with pytest.raises((TypeError, ValueError), match=message):
        factory()


def test_compressors_are_values():
    assert TopK(0.01) == TopK(0.01) and hash(TopK(0.01)) == hash(TopK(0.01))
    assert TopK(0.01) != TopK(0.02) and TopK(0.1) != STC(0.1)
    assert QSGD(4) != NaturalDithering(4)
    assert repr(QSGD(16)) == "QSGD(levels=16, seed=0, bucket=512)"
    assert repr(MinMaxUInt8(4)) == "MinMaxUInt8(chunks=4)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        TopK(0.1).ratio = 0.2
    used = QSGD(4)
    used.compress(torch.ones(10))
    assert used == QSGD(4) and used.state_dict() == {"step": 1}  # state is not configuration


def test_unbiased_flags_and_error_feedback_default():
    unbiased = {"none", "qsgd4", "qsgd127-bucket3", "natural", "natural_dithering3",
                "randomk-unbiased"}  # fmt: skip
    for key, compressor in COMPRESSORS.items():
        assert compressor.unbiased == (key in unbiased), key
        assert default_error_feedback(compressor) == (key not in unbiased), key
    with pytest.raises(TypeError, match="compressor must be a Compressor; got str"):
        default_error_feedback("topk")


@pytest.mark.parametrize(
    ("compressor", "limit"),
    [(MinMaxUInt8(), 0.26), (TopK(0.01), 0.025), (Sign(), 0.04), (STC(0.01), 0.01)],
    ids=["uint8", "topk", "sign", "stc"],
)
def test_wire_size_ratio_against_float32(compressor, limit):
    x = _tensor((100_000,), torch.float32, seed=3)
    assert compressor.compress(x).nbytes <= limit * x.numel() * 4


def test_every_compressor_has_a_registry_entry():
    registered = {usage.split("[")[0].split(":")[0] for usage in available_compressors()}
    assert registered == {type(c).spec_name for c in COMPRESSORS.values()}
    assert "topk:<ratio>" in available_compressors()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, NoCompression()),
        ("none", NoCompression()),
        ("fp16", FP16()),
        ("bf16", BF16()),
        ("uint8", MinMaxUInt8()),
        ("uint8:32", MinMaxUInt8(32)),
        (" UINT8 : chunks = 4 ", MinMaxUInt8(4)),
        ("qsgd:16", QSGD(16)),
        ("qsgd:4:seed=7:bucket=64", QSGD(4, seed=7, bucket=64)),
        ("natural", Natural()),
        ("natural_dithering:3", NaturalDithering(3)),
        ("topk:0.01", TopK(0.01)),
        ("topk:1", TopK(1.0)),
        ("randomk:0.01", RandomK(0.01)),
        ("randomk:0.5:unbiased=true", RandomK(0.5, unbiased=True)),
        ("randomk:0.01:reset=true", RandomK(0.01, reset=True)),
        ("randomk:0.04:quantize=true", RandomK(0.04, quantize=True)),
        ("randomk:0.08:quantize=true:bits=4", RandomK(0.08, quantize=True, bits=4)),
        ("stc:0.01", STC(0.01)),
        ("sign", Sign()),
    ],
    ids=lambda v: repr(v),
)
def test_registry_parses_specs(spec, expected):
    compressor = get_compressor(spec)
    assert compressor == expected
    assert get_compressor(compressor.name) == compressor
    assert get_compressor(compressor) is compressor


@pytest.mark.parametrize("compressor", COMPRESSORS.values(), ids=COMPRESSORS.keys())
def test_name_spells_the_configuration_back(compressor):
    assert get_compressor(compressor.name) == compressor


def test_names():
    assert TopK(0.01).name == "topk:0.01"
    assert MinMaxUInt8().name == "uint8" and MinMaxUInt8(8).name == "uint8:8"
    assert QSGD(16).name == "qsgd:16"
    assert RandomK(0.1, unbiased=True, seed=2).name == "randomk:0.1:seed=2:unbiased=true"
    assert NoCompression().name == "none"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "topk:2",
            r"compression='topk:2': ratio must be in \(0, 1\]; got 2.0; usage: topk:<ratio>",
        ),
        ("topk", r"compression='topk': .*ratio.*; usage: topk:<ratio>"),
        ("topk:abc", r"ratio must be a float; got 'abc'"),
        ("qsgd:4.5", r"levels must be an int; got '4.5'"),
        ("randomk:0.1:unbiased=maybe", r"unbiased must be a bool \(true/false\); got 'maybe'"),
        (
            "randomk:0.1:unbiased=true:quantize=true",
            r"quantize=True needs the biased random-k \(unbiased=False\)",
        ),
        ("randomk:0.1:bits=4", r"bits=4 needs quantize=True"),
        ("randomk:0.1:quantize=true:bits=9", r"bits must be in \[1, 8\]; got 9"),
        ("topk:0.1:0.2", r"unexpected parameter '0.2'"),
        ("topk:size=3", r"unknown parameter 'size'"),
        ("qsgd:4:seed=1:seed=2", r"parameter 'seed' given twice"),
        ("sign:1", r"unexpected parameter '1'; usage: sign"),
        ("zip", r"compression='zip': unknown compressor 'zip'; valid: bf16, fp16, .*topk:<ratio>"),
        ("qsgd:1_6", r"levels must be an int; got '1_6'"),  # int() would read 16
        ("topk:1_0e-2", r"ratio must be a float; got '1_0e-2'"),
    ],
    ids=lambda v: v if ":" in v or v.isalpha() else "",
)
def test_registry_errors_name_argument_value_and_valid_forms(spec, message):
    with pytest.raises(ValueError, match=message):
        get_compressor(spec)


def test_registry_error_uses_the_callers_argument_name():
    with pytest.raises(ValueError, match=r"^grad_compression='uint8:0': chunks must be >= 1"):
        get_compressor("uint8:0", argument="grad_compression")
    with pytest.raises(TypeError, match="compression must be a str, a Compressor or None; got int"):
        get_compressor(3)


def test_subclass_contract():
    assert issubclass(TopK, Compressor)
    with pytest.raises(TypeError):
        Compressor()


@pytest.mark.parametrize(
    "module", ["minmax", "error_feedback", "registry", "packing"], ids=lambda name: name
)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"gossamer.compression.{module}")
    names = {**vars(importlib.import_module("gossamer.compression")), "torch": torch}
    result = doctest.testmod(mod, extraglobs={**names, **vars(mod)}, report=False)
    assert result.failed == 0 and result.attempted > 0


def test_compression_is_a_leaf_layer():
    """It imports torch, numpy, numba, the standard library and gossamer.errors, nothing else."""
    package = Path(importlib.import_module("gossamer.compression").__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "gossamer":
                    assert name == "gossamer.errors" or name.startswith("gossamer.compression")
                else:
                    assert top in sys.stdlib_module_names | {"torch", "numpy", "numba"}, (
                        path.name,
                        name,
                    )
