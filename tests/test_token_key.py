"""TokenKey: a request's token ids checked once and passed to match and insert."""

from __future__ import annotations

import pytest
import torch

from hicache import IndexSpace, Indices, TokenKey
from hicache.bench.scheduler import make_service


def test_key_gives_the_same_match_and_insert_as_raw_tokens() -> None:
    service = make_service(capacity_tokens=256)
    try:
        tokens = list(range(100, 150))  # 3 whole pages of 16 and a 2-token tail
        key = service.key(tokens)
        assert key.tokens == tuple(tokens) and key.pages == tuple(tokens[:48])
        slots = service.alloc_device(len(tokens))
        assert slots is not None
        assert service.insert(key, slots) == 0
        service.free_device(Indices(slots.tensor[48:], IndexSpace.DEVICE_FULL))
        by_key, by_list = service.match(key), service.match(tokens)
        assert by_key.device_hit_tokens == by_list.device_hit_tokens == 48
        assert torch.equal(by_key.device_indices.tensor, by_list.device_indices.tensor)
        service.check_integrity()
    finally:
        service.stop()


def test_key_owns_its_tokens() -> None:
    """Refilling the engine's list after key() changes nothing in the key."""
    service = make_service(capacity_tokens=256)
    try:
        tokens = list(range(32))
        key = service.key(tokens)
        tokens[:] = [7] * 32
        assert key.tokens == tuple(range(32))
        with pytest.raises(AttributeError, match="read-only"):
            key.tokens = (1, 2)  # type: ignore[misc]
    finally:
        service.stop()


@pytest.mark.parametrize("tokens,error,message", [
    ([1, 2.5], TypeError, r"^key: token ids must be ints, got tokens\[1\] = 2.5"),
    ([1, True], TypeError, r"tokens\[1\] = True \(bool\)"),
    ([5, 9, False, 7], TypeError, r"tokens\[2\] = False \(bool\)"),
    ([5, 1, 0, True], TypeError, r"tokens\[3\] = True \(bool\)"),
    ([5, "7"], TypeError, r"tokens\[1\] = '7' \(str\)"),
    ([5, None], TypeError, r"tokens\[1\] = None"),
    ([3, -1], ValueError, r"^key: token ids must be >= 0, got tokens\[1\] = -1$"),
    ([3, 4, -(2**70)], ValueError, r"tokens\[2\] = -1180591620717411303424$"),
    (None, TypeError, r"^key: tokens must be a list or tuple of ints"),
    (torch.tensor([1.0]), TypeError, r"integer dtype"),
])
def test_key_refuses_what_match_refuses(tokens: object, error: type, message: str) -> None:
    service = make_service(capacity_tokens=256)
    try:
        with pytest.raises(error, match=message):
            service.key(tokens)  # type: ignore[arg-type]
    finally:
        service.stop()


def test_key_of_another_page_size_is_refused_before_anything_changes() -> None:
    service = make_service(capacity_tokens=256)
    other = make_service(capacity_tokens=256, page_size=8)
    try:
        key = other.key(list(range(32)))
        assert isinstance(key, TokenKey) and key.page_size == 8
        for call in (lambda: service.match(key), lambda: service.insert(key, Indices(
                torch.arange(32), IndexSpace.DEVICE_FULL))):
            with pytest.raises(ValueError, match="pages of 8 tokens, this cache's pages have 16"):
                call()
        assert service.tree.num_nodes == 0 and service.tree.stats.matched_tokens == 0
    finally:
        service.stop()
        other.stop()


@pytest.mark.parametrize("tokens", [
    [2**63 - 1, 5, 2**62, 0],
    (7,) * 32,
    torch.arange(40, dtype=torch.int64),
    list(range(10**6, 10**6 + 35)),
])
def test_the_tree_keeps_every_token_id_exactly(tokens: object) -> None:
    """Keys are held as bytes: every whole-page token id comes back from a node as it went
    in, whatever the input form (a packed list, or the checked path of a tensor)."""
    service = make_service(capacity_tokens=256, page_size=4)
    try:
        key = service.key(tokens)  # type: ignore[arg-type]
        slots = service.alloc_device(len(key))
        assert slots is not None
        service.insert(key, slots)
        node = service.match(key).last_device_node
        assert node.tokens == key.pages and len(key.pages) == len(key) // 4 * 4
        service.check_integrity()
    finally:
        service.stop()


def test_a_token_id_of_2_to_the_63_is_refused_by_name() -> None:
    service = make_service(capacity_tokens=256, page_size=4)
    try:
        with pytest.raises(ValueError, match=r"key: token ids must be < 2\*\*63, got tokens\[2\]"):
            service.key([1, 2, 2**63, 4])
        with pytest.raises(ValueError, match=r"match: token ids must be < 2\*\*63"):
            service.match([1, 2, 3, 2**64])
        service.check_integrity()
    finally:
        service.stop()


def test_numpy_integers_in_a_list_give_the_key_of_the_same_ints() -> None:
    """The packing fast path takes anything with ``__index__`` above 1 (numpy integers);
    the key and its unpacked tokens are those of the plain ints."""
    import numpy as np

    service = make_service(capacity_tokens=256, page_size=4)
    try:
        ints = [0, 1, 5, 2**40, 9, 3]
        mixed = [np.int64(0), 1, np.int32(5), np.uint64(2**40), 9, np.int16(3)]
        key, other = service.key(ints), service.key(mixed)
        assert key.data == other.data and other.tokens == tuple(ints)
        assert all(type(token) is int for token in other.tokens)
        assert (len(other), other.num_page_tokens, other.pages) == (6, 4, tuple(ints[:4]))
    finally:
        service.stop()


def _array_forms() -> list[object]:
    """The ids 0, 1, 5, 90, 127 (and 40 more) as every integer array and CPU tensor form."""
    import numpy as np

    ids = [0, 1, 5, 90, 127, *range(40)]
    forms: list[object] = [np.array(ids, dtype=dtype) for dtype in (
        np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)]
    forms += [torch.tensor(ids, dtype=dtype) for dtype in (
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)]
    forms.append(np.array(ids, dtype=">i8"))  # big-endian: packed in native order
    forms.append(np.array([ids, ids], dtype=np.int64)[:, ::1][0])  # a row of a 2-D array
    forms.append(np.repeat(np.array(ids, dtype=np.int64), 2)[::2])  # strided
    return forms


@pytest.mark.parametrize("tokens", _array_forms(), ids=lambda t: f"{type(t).__name__}-{t.dtype}")
def test_an_array_or_tensor_gives_the_key_of_the_same_ints(tokens: object) -> None:
    """Integer arrays and CPU tensors are packed by numpy (not unpacked into Python ints
    first): the key's bytes and tokens are those of the list of the same ints, and the key
    owns them (the array refilled after ``key()`` changes nothing)."""
    service = make_service(capacity_tokens=256, page_size=4)
    try:
        ids = [0, 1, 5, 90, 127, *range(40)]
        key = service.key(tokens)  # type: ignore[arg-type]
        assert key.data == service.key(ids).data and key.tokens == tuple(ids)
        tokens[:] = 3  # type: ignore[index]
        assert key.tokens == tuple(ids)
    finally:
        service.stop()


@pytest.mark.parametrize("tokens,error,message", [
    ("int64 -1", ValueError, r"^key: token ids must be >= 0, got tokens\[2\] = -1$"),
    ("int8 -3", ValueError, r"^key: token ids must be >= 0, got tokens\[2\] = -3$"),
    ("tensor -1", ValueError, r"^key: token ids must be >= 0, got tokens\[2\] = -1$"),
    ("uint64 2**63", ValueError, r"^key: token ids must be < 2\*\*63, got tokens\[2\]"),
    ("float", TypeError, r"array of float64"),
    ("bool array", TypeError, r"array of bool"),
    ("bool tensor", TypeError, r"integer dtype, got a torch.bool tensor"),
    ("2-D", TypeError, r"got a 2-D array of int64"),
])
def test_an_array_of_bad_ids_is_refused_by_name(tokens: str, error: type, message: str) -> None:
    """What the packed path does not take goes to the checked path, which names it."""
    import numpy as np

    forms = {
        "int64 -1": np.array([4, 5, -1, 6], dtype=np.int64),
        "int8 -3": np.array([4, 5, -3, 6], dtype=np.int8),
        "tensor -1": torch.tensor([4, 5, -1, 6]),
        "uint64 2**63": np.array([4, 5, 2**63, 6], dtype=np.uint64),
        "float": np.array([4.0, 5.0]),
        "bool array": np.array([True, False]),
        "bool tensor": torch.tensor([True, False]),
        "2-D": np.zeros((2, 4), dtype=np.int64),
    }
    service = make_service(capacity_tokens=256, page_size=4)
    try:
        with pytest.raises(error, match=message):
            service.key(forms[tokens])  # type: ignore[arg-type]
        assert service.tree.num_nodes == 0
    finally:
        service.stop()


def _zero_forms() -> list[object]:
    import numpy as np

    ids = [0, 5, 0, 7]
    return [ids, tuple(ids), [np.int64(0), 5, np.int32(0), 7], np.array(ids),
            np.array(ids, dtype=np.uint8), torch.tensor(ids)]


@pytest.mark.parametrize("tokens", _zero_forms(), ids=lambda t: type(t).__name__)
def test_a_key_built_by_hand_takes_token_0_and_pages_of_one_token(tokens: object) -> None:
    """Built by hand (``TokenKey(tokens, page_size)``, the checked path of every form),
    a key takes token id 0, and pages of one token; it is the key ``service.key`` makes."""
    key = TokenKey(tokens, 1)  # type: ignore[arg-type]
    assert key.tokens == key.pages == (0, 5, 0, 7)
    service = make_service(capacity_tokens=256, page_size=1)
    try:
        assert service.key(tokens).data == key.data  # type: ignore[arg-type]
    finally:
        service.stop()
    with pytest.raises(ValueError, match=r"page_size must be an int >= 1 \(the tree's "):
        TokenKey(tokens, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("form", ["list", "mixed list", "array", "tensor"])
def test_a_negative_id_after_zeros_is_named_by_its_own_position(form: str) -> None:
    """The error names the first negative id, not a 0 before it, in every form and on
    both paths (``service.key`` and a key built by hand)."""
    import numpy as np

    ids = [0, 5, 0, -3, 2]
    tokens = {"list": ids, "mixed list": [np.int64(0), *ids[1:]], "array": np.array(ids),
              "tensor": torch.tensor(ids)}[form]
    service = make_service(capacity_tokens=256, page_size=1)
    try:
        for make in (service.key, lambda t: TokenKey(t, 1)):
            with pytest.raises(ValueError, match=r"token ids must be >= 0, got tokens\[3\] = "
                                                 r"-3$"):
                make(tokens)  # type: ignore[operator]
        assert service.tree.num_nodes == 0
    finally:
        service.stop()
