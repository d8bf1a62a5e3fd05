"""Tests for tierckpt.state: flatten / unflatten round trips, rejections, and hostile skeletons."""

from __future__ import annotations

import collections
import enum
import math
import re
from collections import OrderedDict
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierckpt.errors import CorruptCheckpointError, UnsupportedStateError
from tierckpt.state import (
    MAX_SKELETON_DEPTH,
    Leaf,
    flatten,
    format_path,
    numpy_dtype,
    skeleton_leaf_count,
    survey,
    torch_dtype,
    unflatten,
)

# torch 2.13 warns when creating complex32, quantized, sparse CSR or nested tensors; these tests mean to.
quiet_torch = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental",
    "ignore:torch.quantize_per_tensor",
    "ignore:Sparse CSR tensor support is in beta",
    "ignore:The PyTorch API of nested tensors is in prototype",
)


def through_msgpack(skeleton: Any) -> Any:
    """What the manifest does to a skeleton: pack, then unpack from bytes."""
    return msgpack.unpackb(msgpack.packb(skeleton, use_bin_type=True), raw=False, strict_map_key=False)


def round_trip(state: Any) -> tuple[Any, list[Leaf]]:
    skeleton, leaves = flatten(state)
    return unflatten(through_msgpack(skeleton), [leaf.value for leaf in leaves]), leaves


def assert_same(expected: Any, actual: Any) -> None:
    """Exact structural equality: same types, same order, NaN == NaN, -0.0 != 0.0, arrays by identity."""
    if isinstance(expected, torch.Tensor):
        assert actual is expected
        return
    assert type(actual) is type(expected), (expected, actual)
    if type(expected) in (dict, OrderedDict):
        assert len(actual) == len(expected)
        for (ek, ev), (ak, av) in zip(expected.items(), actual.items()):
            assert_same(ek, ak)
            assert_same(ev, av)
    elif type(expected) in (list, tuple):
        assert len(actual) == len(expected)
        for e, a in zip(expected, actual):
            assert_same(e, a)
    elif type(expected) is float:
        assert (math.isnan(expected) and math.isnan(actual)) or (
            expected == actual and math.copysign(1, expected) == math.copysign(1, actual)
        )
    elif isinstance(expected, np.ndarray):
        assert actual is expected
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes()
    else:
        assert actual == expected


def walk_skeleton(node: Any) -> None:
    """A skeleton holds only msgpack scalars and lists: no maps, no tuples."""
    assert type(node) in (type(None), bool, int, float, str, bytes, list), type(node)
    if type(node) is list:
        for child in node:
            walk_skeleton(child)


def test_round_trip_keeps_every_type_exactly() -> None:
    weight, table = torch.randn(3, 2), np.arange(6, dtype=np.int16).reshape(2, 3)
    state = {
        "model": OrderedDict([("z.weight", weight), ("a.bias", torch.zeros(2))]),
        "ints": {0: "zero", -1: "minus", 2**64 - 1: "max", -(2**63): "min"},
        ("tuple", 1): (1, (2.5, None), []),
        "big": [2**64, -(2**63) - 1, 10**100, -(10**50)],
        "flags": [True, 1, False, 0, 1.0],
        "floats": [float("nan"), float("inf"), -0.0, 1e-300],
        "bytes": b"\x00\xff",
        "empty": {},
        "empty_od": OrderedDict(),
        "dtypes": [torch.float32, torch.bfloat16, torch.qint8],
        "devices": {torch.device("cpu"): 1, "cuda": torch.device("cuda", 1), "meta": torch.device("meta")},
        "numpy": [table, np.float32(1.5), np.int64(-3), np.bool_(True), np.datetime64(7, "ns")],
        "numpy_str": np.str_("é"),
        None: "none key",
        3.5: "float key",
        b"k": "bytes key",
        torch.int8: "dtype key",
    }
    restored, leaves = round_trip(state)
    assert_same(state, restored)
    assert list(restored["model"]) == ["z.weight", "a.bias"]
    walk_skeleton(flatten(state)[0])
    assert [(leaf.index, leaf.path, leaf.kind) for leaf in leaves[:3]] == [
        (0, ("model", "z.weight"), "torch"),
        (1, ("model", "a.bias"), "torch"),
        (2, ("numpy", 0), "numpy"),
    ]
    assert (leaves[0].value is weight, leaves[0].dtype, leaves[0].shape, leaves[0].nbytes) == (
        True, "float32", (3, 2), 24,
    )
    assert (leaves[2].value is table, leaves[2].dtype, leaves[2].shape, leaves[2].nbytes) == (
        True, "<i2", (2, 3), 12,
    )
    scalar = leaves[3]  # np.float32(1.5): stored as a 0-d array leaf
    assert (type(scalar.value), scalar.value.shape, scalar.dtype, scalar.nbytes) == (np.ndarray, (), "<f4", 4)


def test_scalar_roots_and_leaf_roots() -> None:
    for value in (None, 7, "s", 2**80, torch.float16):
        assert_same(value, round_trip(value)[0])
    tensor = torch.ones(1)
    assert round_trip(tensor)[0] is tensor
    assert flatten(tensor)[1][0].path == ()


def test_same_tensor_twice_gives_two_leaves_and_parameter_comes_back_as_given() -> None:
    shared = torch.nn.Parameter(torch.ones(2))
    skeleton, leaves = flatten({"a": shared, "b": [shared]})
    assert [leaf.path for leaf in leaves] == [("a",), ("b", 0)]
    assert leaves[0].value is shared and leaves[1].value is shared
    plain = torch.ones(2)
    restored = unflatten(skeleton, [plain, plain.clone()])
    assert type(restored["a"]) is torch.Tensor and restored["a"] is plain


def test_transformer_and_adamw_state_dicts_round_trip() -> None:
    torch.manual_seed(0)
    model = torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 16), torch.randn(2, 4, 16)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}

    skeleton, leaves = flatten(state)
    # What restore hands back: fresh tensors built from the stored bytes, not the originals.
    arrays = [leaf.value.detach().clone() for leaf in leaves]
    restored = unflatten(through_msgpack(skeleton), arrays)

    assert type(restored["model"]) is OrderedDict
    assert list(restored["model"]) == list(state["model"])
    assert type(restored["optim"]["param_groups"][0]["betas"]) is tuple
    assert restored["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert list(restored["optim"]["state"]) == list(state["optim"]["state"])  # int keys stay ints
    for leaf, array in zip(leaves, arrays):
        original = leaf.value
        rebuilt = restored
        for key in leaf.path:
            rebuilt = rebuilt[key]
        assert rebuilt is array
        assert (rebuilt.dtype, rebuilt.shape) == (original.dtype, original.shape)
        assert torch.equal(rebuilt, original)
    torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True).load_state_dict(restored["model"])


def stored_bytes(leaf: Leaf) -> torch.Tensor:
    """What capture stores: the leaf's elements in row-major order, as bytes."""
    return leaf.value.contiguous().reshape(-1).view(torch.uint8).clone()


def from_bytes(leaf: Leaf, raw: torch.Tensor) -> torch.Tensor:
    """What restore builds from the leaf's metadata and its bytes."""
    return raw.view(torch_dtype(leaf.dtype)).reshape(leaf.shape)


QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
STORABLE = [
    d
    for name, d in vars(torch).items()
    if isinstance(d, torch.dtype) and str(d) == f"torch.{name}" and d not in QUANTIZED
]


@quiet_torch
@pytest.mark.parametrize("dtype", STORABLE, ids=str)
def test_every_storable_torch_dtype_round_trips(dtype: torch.dtype) -> None:
    tensor = torch.empty(2, 3, dtype=dtype)
    skeleton, (leaf,) = flatten({"t": tensor})
    assert leaf.dtype == str(dtype).removeprefix("torch.")
    assert torch_dtype(leaf.dtype) is dtype
    assert leaf.nbytes == 6 * tensor.element_size() == stored_bytes(leaf).numel()
    assert unflatten(through_msgpack(skeleton), [tensor])["t"] is tensor
    assert from_bytes(leaf, stored_bytes(leaf)).dtype is dtype


@quiet_torch
def test_storable_dtypes_are_exactly_those_whose_bytes_are_the_value() -> None:
    """The probe behind the quantized deny-list: created by torch.empty, viewable as uint8, not quantized."""
    for name, dtype in vars(torch).items():
        if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{name}":
            continue
        try:
            probe = torch.empty(3, dtype=dtype)
            probe.reshape(-1).view(torch.uint8)
            storable = not probe.is_quantized
        except (RuntimeError, TypeError):
            storable = False
        assert (dtype in STORABLE) == storable, name
        if not storable:
            with pytest.raises(CorruptCheckpointError):
                torch_dtype(name)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4, dtype=torch.bfloat16),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.randn(2, 2, dtype=torch.complex64),
        lambda: torch.tensor(3.25),  # 0-d
        lambda: torch.empty(0, 5),  # zero elements
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        lambda: torch.arange(20, dtype=torch.int32)[5:9],  # a view with a storage offset
        lambda: torch.randn(4, 4).to(torch.float8_e4m3fn),
    ],
    ids=["bf16", "bool", "complex64", "0-d", "zero-element", "transposed", "slice", "float8"],
)
def test_tensor_shapes_and_bytes_survive(make: Any) -> None:
    tensor = make()
    (leaf,) = flatten([tensor])[1]
    assert leaf.value is tensor
    assert leaf.shape == tuple(tensor.shape)
    assert leaf.nbytes == tensor.numel() * tensor.element_size()
    rebuilt = from_bytes(leaf, stored_bytes(leaf))
    assert rebuilt.dtype == tensor.dtype and rebuilt.shape == tensor.shape
    as_bytes = tensor.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(rebuilt.reshape(-1).view(torch.uint8), as_bytes)


class Point:
    pass


class Color(enum.Enum):
    RED = 1


class Wrapped(torch.Tensor):
    """Stands in for DTensor and other tensor subclasses."""


Pair = collections.namedtuple("Pair", "a b")


def cyclic() -> dict[str, Any]:
    inner: list[Any] = [1]
    state = {"opt": {"loop": inner}}
    inner.append(inner)
    return state


@quiet_torch
@pytest.mark.parametrize(
    ("make", "key", "fragment"),
    [
        (lambda: {"a": {"b": {1, 2}}}, "['a']['b']", "cannot store set"),
        (lambda: {"a": [Point()]}, "['a'][0]", "test_state.Point"),
        (lambda: {"e": Color.RED}, "['e']", "Color"),
        (lambda: {"p": Pair(1, 2)}, "['p']", "Pair"),
        (lambda: {"d": collections.defaultdict(int)}, "['d']", "defaultdict"),
        (lambda: {"g": torch.Generator()}, "['g']", "Generator"),
        (lambda: {"f": len}, "['f']", "builtin_function_or_method"),
        (lambda: {"b": bytearray(b"x")}, "['b']", "bytearray"),
        (lambda: {"m": {"w": torch.eye(3).to_sparse()}}, "['m']['w']", "sparse_coo"),
        (lambda: {"m": {"w": torch.eye(3).to_sparse_csr()}}, "['m']['w']", "sparse_csr"),
        (lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "['q']", "quantized"),
        (lambda: {"m": [torch.empty(2, device="meta")]}, "['m'][0]", "meta"),
        (lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "['n']", "nested"),
        (lambda: {"s": torch.ones(2).as_subclass(Wrapped)}, "['s']", "not supported yet"),
        (lambda: {"o": np.array([1, "x"], dtype=object)}, "['o']", "Python objects"),
        (lambda: {"r": np.zeros(2, dtype=[("x", "<f4")])}, "['r']", "structured"),
        (lambda: {"x": np.ma.masked_array([1, 2])}, "['x']", "numpy subclasses"),
        (lambda: {"k": {torch.ones(1): 1}}, "['k']", "a key of the dict at ['k']"),
        (lambda: {"k": {(1, np.int64(2)): 1}}, "['k']", "arrays cannot be dict keys"),
        (lambda: {"s": ["ok", "\ud800"]}, "['s'][1]", "UTF-8"),
        (lambda: {"i": 10**5000}, "['i']", "too many digits"),
        (cyclic, "['opt']['loop'][1]", "cycle"),
    ],
)
def test_unsupported_values_name_their_key_path(make: Any, key: str, fragment: str) -> None:
    with pytest.raises(UnsupportedStateError) as caught:
        flatten(make())
    assert caught.value.key == key
    assert key in str(caught.value) and fragment in str(caught.value)


def nested(levels: int, inner: Any, wrap: Any) -> Any:
    for _ in range(levels):
        inner = wrap(inner)
    return inner


def test_depth_bound_keeps_skeletons_within_msgpack_limits() -> None:
    # A list costs 2 skeleton levels and a leaf 1: 499 lists around a tensor nest 999 lists, 500 nest 1001.
    leaf = torch.ones(1)
    deepest = nested(MAX_SKELETON_DEPTH // 2 - 1, leaf, lambda x: [x])
    assert round_trip(deepest)[1][0].path == (0,) * (MAX_SKELETON_DEPTH // 2 - 1)
    msgpack.unpackb(msgpack.packb({"manifest": [flatten(deepest)[0]]}))  # room left for the manifest
    with pytest.raises(UnsupportedStateError, match="nested deeper") as caught:
        flatten(nested(MAX_SKELETON_DEPTH // 2, leaf, lambda x: [x]))
    assert caught.value.key == format_path((0,) * (MAX_SKELETON_DEPTH // 2))
    scalar_at_bottom = nested(MAX_SKELETON_DEPTH // 2, 0, lambda x: [x])  # a scalar adds no level
    assert_same(scalar_at_bottom, round_trip(scalar_at_bottom)[0])
    dicts = (MAX_SKELETON_DEPTH - 1) // 3
    assert round_trip(nested(dicts, leaf, lambda x: {"k": x}))[1][0].path == ("k",) * dicts
    with pytest.raises(UnsupportedStateError, match="nested deeper"):
        flatten(nested(MAX_SKELETON_DEPTH, 0, lambda x: (x,)))


def test_format_path() -> None:
    assert format_path(()) == "<root>"
    assert format_path(("model", "w")) == "['model']['w']"
    assert format_path(("optim", "state", 0, "exp_avg")) == "['optim']['state'][0]['exp_avg']"


def deep_skeleton(levels: int) -> list[Any]:
    node: Any = None
    for _ in range(levels):
        node = ["l", [node]]
    return node


@pytest.mark.parametrize(
    ("skeleton", "arrays", "fragment"),
    [
        (["zz", 1], [], "unknown tag 'zz'"),
        (["l", [["T", 1]]], [torch.ones(1)], "out of range"),
        (["T", -1], [torch.ones(1)], "out of range"),
        (["T", 10**5000], [torch.ones(1)], "leaf index <huge int> is out of range"),
        (["d", [[["t", [1, ["l", []]]], 0]]], [], "at a key of the dict at <root>: tag 'l' cannot appear"),
        (["T", True], [torch.ones(1)], "a leaf index is a bool"),
        (["N", "0"], [np.ones(1)], "a leaf index is a str"),
        (["l", [["T", 0], ["T", 0]]], [torch.ones(1)], "used twice"),
        (["l", [["T", 0]]], [torch.ones(1), torch.ones(1)], "uses 1 of the 2"),
        (["T", 0], [np.ones(1)], "was given a ndarray"),
        (["n", 0], [np.ones(2)], "was given a ndarray"),
        (["l"], [], "not a [tag, payload] pair"),
        (["l", [], []], [], "not a [tag, payload] pair"),
        ([1, 2], [], "not a [tag, payload] pair"),
        (["d", [["k"]]], [], "not a [key, value] pair"),
        (deep_skeleton(100_000), [], "nests deeper"),
        (["d", {"a": 1}], [], "payload of tag 'd' is not a list"),
        ({"a": 1}, [], "a msgpack map"),
        (["l", "ab"], [], "payload of tag 'l' is not a list"),
        (["d", [[["l", []], 1]]], [], "cannot appear in a dict key"),
        (["d", [[["T", 0], 1]]], [torch.ones(1)], "cannot appear in a dict key"),
        (["d", [[1, "a"], [1.0, "b"]]], [], "same key twice"),
        (["i", "12a"], [], "invalid 'i' payload"),
        (["i", "9" * 5000], [], "too many digits"),
        (["dt", "__class__"], [], "invalid 'dt' payload"),
        (["dev", "cuda:-1"], [], "invalid 'dev' payload"),
        (["dev", "nonsense"], [], "invalid 'dev' payload"),
        (["dt", 3], [], "payload"),
        ([3, None], [], "not a [tag, payload] pair"),
        (["d", [["opt", ["l", [0, ["bad", 1]]]]]], [], "['opt'][1]"),
    ],
)
def test_malformed_skeletons_are_corrupt(skeleton: Any, arrays: list[Any], fragment: str) -> None:
    with pytest.raises(CorruptCheckpointError) as caught:
        unflatten(skeleton, arrays)
    assert fragment in str(caught.value)


def test_skeleton_leaf_count_validates() -> None:
    skeleton, leaves = flatten({"a": torch.ones(1), "b": [np.zeros(2), np.float64(1.0)]})
    assert skeleton_leaf_count(through_msgpack(skeleton)) == len(leaves) == 3
    assert skeleton_leaf_count(7) == 0
    with pytest.raises(CorruptCheckpointError, match="not 0..1"):
        skeleton_leaf_count(["l", [["T", 0], ["N", 5]]])
    with pytest.raises(CorruptCheckpointError, match="unknown tag"):
        skeleton_leaf_count(["l", [["X", 0]]])


def test_numpy_dtype_parses_only_plain_canonical_strings() -> None:
    for dtype in ("<f4", ">f8", "|b1", "<M8[ns]", "<m8[3s]", "<U5", "|S3", "|V8", "<c16", "|u1", "<f2"):
        assert numpy_dtype(dtype).str == dtype
    for bad in ("|O", "O", "f4", "f4,i4", "[('a', '<f4')]", "<f4 ", "T", "", "<M8[ns]x", 4, None):
        with pytest.raises(CorruptCheckpointError):
            numpy_dtype(bad)  # type: ignore[arg-type]


def test_torch_dtype_accepts_only_canonical_storable_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    for bad in ("float", "torch.float32", "qint8", "__class__", "", 3):
        with pytest.raises(CorruptCheckpointError):
            torch_dtype(bad)  # type: ignore[arg-type]


# --- property: random states survive msgpack + unflatten exactly -----------------------------------

torch_leaves = st.builds(
    lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.uint16]),
)
numpy_arrays = hnp.arrays(hnp.scalar_dtypes(), hnp.array_shapes(min_dims=0, max_dims=2, min_side=0))
numpy_scalars = hnp.arrays(hnp.scalar_dtypes(), ()).map(lambda array: array[()])
keys = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=5)
    | st.sampled_from([torch.float32, torch.device("cpu")]),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=4,
)
scalars = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary()
    | st.sampled_from([torch.float64, torch.bfloat16, torch.device("cpu"), torch.device("cuda", 3)])
)
states = st.recursive(
    scalars | torch_leaves | numpy_arrays | numpy_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(keys, inner, max_size=4)
    | st.dictionaries(keys, inner, max_size=4).map(OrderedDict),
    max_leaves=25,
)


@settings(deadline=None, max_examples=200)
@given(states)
def test_random_states_round_trip_exactly(state: Any) -> None:
    skeleton, leaves = flatten(state)
    walk_skeleton(skeleton)
    assert [leaf.index for leaf in leaves] == list(range(len(leaves)))
    assert skeleton_leaf_count(through_msgpack(skeleton)) == len(leaves)
    restored, _ = round_trip(state)
    assert_same(state, restored)


tags = st.sampled_from(["d", "od", "l", "t", "T", "N", "n", "i", "dt", "dev", "x"])
garbage = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 4) | st.floats() | st.text(max_size=3) | st.binary(max_size=2)
    | tags | st.sampled_from(["123", "-5", "float32", "cpu", "cuda:1"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.tuples(tags, st.lists(inner, max_size=3)).map(list)
    | st.tuples(tags, inner).map(list)
    | st.dictionaries(st.text(max_size=2), inner, max_size=2),
    max_leaves=30,
)


@settings(deadline=None, max_examples=500)
@given(garbage)
def test_garbage_skeletons_only_ever_raise_corrupt(skeleton: Any) -> None:
    arrays = [torch.ones(1), np.ones(()), np.ones(2)]
    try:
        unflatten(skeleton, arrays)
    except CorruptCheckpointError:
        pass
    try:
        skeleton_leaf_count(skeleton)
    except CorruptCheckpointError:
        pass


def _same_leaves(got: list[Leaf], want: list[Leaf]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.index, a.path, a.kind, a.dtype, a.shape, a.nbytes, a.replicas, a.region) == (
            b.index, b.path, b.kind, b.dtype, b.shape, b.nbytes, b.replicas, b.region
        )
        # A numpy scalar becomes a new 0-d array in each walk: the same bytes (NaN and NaT included).
        assert a.value is b.value or (a.kind == "numpy" and a.value.tobytes() == b.value.tobytes())
        assert type(a.shape) is tuple and type(a.nbytes) is int


def _walks_agree(state: Any) -> None:
    """save()'s common-case walk gives exactly the general walk's skeleton and leaves (or declines)."""
    from tierckpt.state.leaves import _flatten_any
    from tierckpt.state.walk import _flatten_common

    try:
        fast = _flatten_common(state)
    except Exception:  # noqa: BLE001 - declined: flatten() takes the general walk
        return
    general = _flatten_any(state)
    assert msgpack.packb(fast.skeleton, use_bin_type=True) == msgpack.packb(general[0], use_bin_type=True)
    _same_leaves(fast.leaves(), general[1])


@pytest.mark.slow
@settings(deadline=None, max_examples=300)
@given(states)
def test_the_common_case_walk_agrees_with_the_general_one(state: Any) -> None:
    _walks_agree(state)


def test_the_common_case_walk_takes_a_model_and_its_optimizer() -> None:
    from tierckpt.state.walk import _flatten_common

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3, "rng": torch.get_rng_state(), "np": np.random.get_state()}
    _flatten_common(state)  # taken, not declined
    _walks_agree(state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"k": "é"}, lambda: {"é": 1}, lambda: {(1, 2): 3}, lambda: {"x": 2**64}, lambda: {"x": {1.5: 2}},
        lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
        lambda: {"m": torch.empty(2, device="meta")}, lambda: {"s": torch.ones(2).to_sparse()},
        lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, lambda: {"set": {1}},
    ],
    ids=["non-ascii value", "non-ascii key", "tuple key", "big int", "float key", "quantized", "meta", "sparse", "nested", "set"],
)
def test_unusual_states_take_the_general_walk_with_its_result_or_error(make: Any) -> None:
    unusual = make()
    from tierckpt.state.leaves import _flatten_any
    from tierckpt.state.walk import _flatten_common, _Unusual

    with pytest.raises((_Unusual, UnsupportedStateError, RuntimeError)):  # a strided nested tensor: its .shape raises
        _flatten_common(unusual)
    try:
        want: Any = _flatten_any(unusual)
    except UnsupportedStateError as exc:
        with pytest.raises(UnsupportedStateError, match=re.escape(str(exc))):
            flatten(unusual)
        return
    got = flatten(unusual)
    assert msgpack.packb(got[0], use_bin_type=True) == msgpack.packb(want[0], use_bin_type=True)
    _same_leaves(got[1], want[1])


def test_deep_states_take_the_general_walk() -> None:
    state: Any = torch.ones(1)
    for _ in range(400):
        state = [state]
    skeleton, leaves = flatten(state)
    assert len(leaves) == 1 and leaves[0].path == (0,) * 400


def test_tensor_leaf_nodes_are_shared_between_skeletons_up_to_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common walk's ("T", i) nodes are made once and shared by every skeleton, up to a bound
    (here 8 of 12 leaves); the skeletons encode as the general walk's all the same."""
    from tierckpt.state import walk
    from tierckpt.state.leaves import _flatten_any

    monkeypatch.setattr(walk, "_SHARED_LEAF_NODES", 8)
    monkeypatch.setattr(walk, "_LEAF_NODES", [])
    state = {"layer": [{"w": torch.ones(2), "b": torch.zeros(1)} for _ in range(5)], "last": torch.ones(3), "opt": {"step": torch.tensor(1.0)}}
    first, second = walk.survey(state), walk.survey(state)
    want = msgpack.packb(_flatten_any(state)[0], use_bin_type=True)
    assert msgpack.packb(first.skeleton, use_bin_type=True) == msgpack.packb(second.skeleton, use_bin_type=True) == want

    def leaf_nodes(node: Any) -> list[Any]:
        if type(node) is tuple and node[0] == "T":
            return [node]
        if type(node) is tuple and node[0] in ("d", "od"):
            return [n for _, value in node[1] for n in leaf_nodes(value)]
        return [n for child in node[1] for n in leaf_nodes(child)] if type(node) is tuple and node[0] in ("l", "t") else []

    a, b = leaf_nodes(first.skeleton), leaf_nodes(second.skeleton)
    assert [n[1] for n in a] == list(range(12))
    assert [x is y for x, y in zip(a, b)] == [True] * 8 + [False] * 4


def test_the_skeleton_a_save_keeps_is_left_alone_by_the_collector_and_flatten_gives_lists() -> None:
    """save()'s walk makes its skeleton of tuples, which Python's collector stops tracking once it has
    looked at them (a snapshot keeps its skeleton for several saves: as lists, they were promoted and
    set off full collections); unflatten takes it as it is, and flatten gives the grammar's lists."""
    import gc

    state = {"model": OrderedDict((f"w{i}", torch.ones(2)) for i in range(4)), "optim": {"state": {0: {"step": 3, "m": torch.zeros(1)}}, "groups": [{"lr": 0.1, "params": [0, 1]}]}, "dt": torch.float16, "n": np.float32(2)}
    found = survey(state)
    gc.collect()

    def tensor_pairs(node: Any) -> list[Any]:  # each (key, ("T", i)): one a tensor, the bulk of a skeleton
        if type(node) is not tuple or node[0] not in ("d", "od", "l", "t"):
            return []
        if node[0] in ("l", "t"):
            return [p for child in node[1] for p in tensor_pairs(child)]
        return [p for pair in node[1] for p in ([pair] if type(pair[1]) is tuple and pair[1][0] == "T" else tensor_pairs(pair[1]))]

    pairs = tensor_pairs(found.skeleton)
    assert len(pairs) == 5 and not any(gc.is_tracked(p) or gc.is_tracked(p[1]) for p in pairs)
    rebuilt = unflatten(found.skeleton, found.values)
    assert list(rebuilt["model"]) == [f"w{i}" for i in range(4)] and rebuilt["optim"]["state"][0]["step"] == 3 and rebuilt["dt"] is torch.float16
    walk_skeleton(flatten(state)[0])  # lists only
    assert through_msgpack(found.skeleton) == flatten(state)[0]
