"""Chained page hashes and namespace digests."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from storage_helpers import make_pool

from hicache.pools import HostLayout
from hicache.storage import Namespace, chain_page_hashes

TOKENS = list(range(100, 116))
# blake2b-256(previous || ids as u64, person "hicache.page.w1") of [1, 2**32], [2**62 + 5, 4]
GOLDEN_WIDE = ["60b4ee895063e758", "fe94cbbd27c167c3"]


def test_hashes_are_the_same_in_another_process_with_another_hash_seed() -> None:
    """No built-in hash: a process with another PYTHONHASHSEED computes the same hashes."""
    code = ("from hicache.storage import chain_page_hashes; "
            f"print(b''.join(chain_page_hashes({TOKENS}, 4, extra_keys=('lora', 7))).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == b"".join(chain_page_hashes(TOKENS, 4, extra_keys=("lora", 7))).hex()


def test_one_hash_per_full_page_and_list_array_tensor_agree() -> None:
    """A trailing partial page is not hashed; lists, arrays and tensors give the same hashes."""
    hashes = chain_page_hashes([*TOKENS, 1, 2], 4)
    assert len(hashes) == 4 and all(len(h) == 32 for h in hashes)
    assert hashes == chain_page_hashes(np.array(TOKENS, dtype=np.int32), 4)
    assert hashes == chain_page_hashes(torch.tensor(TOKENS), 4)
    assert chain_page_hashes([], 4) == [] and chain_page_hashes([1, 2, 3], 4) == []


def test_a_hash_covers_the_whole_prefix() -> None:
    """Changing a token changes the hash of its page and of every later page only."""
    base = chain_page_hashes(TOKENS, 4)
    changed = chain_page_hashes([*TOKENS[:5], 9, *TOKENS[6:]], 4)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(changed[1:], base[1:], strict=True))


def test_a_chain_continues_from_its_parent() -> None:
    """Hashing the tail with the last prefix hash as parent gives the full chain's tail."""
    full = chain_page_hashes(TOKENS, 4)
    assert chain_page_hashes(TOKENS[8:], 4, parent=full[1]) == full[2:]


def test_extra_keys_separate_chains() -> None:
    """A LoRA id or cache salt changes every page; the keys are encoded unambiguously."""
    plain = chain_page_hashes(TOKENS, 4)
    lora = chain_page_hashes(TOKENS, 4, extra_keys=("ab",))
    assert all(a != b for a, b in zip(plain, lora, strict=True))
    variants = [("ab",), ("a", "b"), (b"ab",), (1,), ("1",)]
    firsts = {chain_page_hashes(TOKENS, 4, extra_keys=v)[0] for v in variants}
    assert len(firsts) == len(variants)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"token_ids": [-1, 2, 3, 4], "page_size": 4}, "token ids must lie"),
    ({"token_ids": np.array([2**63, 2, 3, 4], dtype=np.uint64), "page_size": 4},
     r"token ids must lie in \[0, 2\*\*63\)"),
    ({"token_ids": [1.5, 2.0], "page_size": 2}, "integers"),
    ({"token_ids": [[1, 2]], "page_size": 2}, "1-D"),
    ({"token_ids": [1, 2], "page_size": 0}, "page_size"),
    ({"token_ids": [1, 2], "page_size": 2, "parent": b"short"}, "parent"),
])
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    """Bad tokens, page size or parent raise ValueError saying which."""
    with pytest.raises(ValueError, match=match):
        chain_page_hashes(**kwargs)


def test_namespace_digest_changes_with_everything_that_changes_the_bytes() -> None:
    """Revision, dtype, layout, TP shard, page size and salt each give another digest."""
    base = Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r1")
    assert base.digest == Namespace.for_host_pool(make_pool(), model_id="m",
                                                  model_revision="r1").digest
    variants = [
        Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r2"),
        Namespace.for_host_pool(make_pool(), model_id="m2", model_revision="r1"),
        Namespace.for_host_pool(make_pool(HostLayout.LAYER_FIRST), model_id="m",
                                model_revision="r1"),
        Namespace.for_host_pool(make_pool(HostLayout.PAGE_FIRST_DIRECT), model_id="m",
                                model_revision="r1"),
        Namespace.for_host_pool(make_pool(page_size=8), model_id="m", model_revision="r1"),
        Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r1", tp_rank=1,
                                tp_size=2),
        Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r1", salt="t"),
    ]
    assert len({v.digest for v in [base, *variants]}) == 1 + len(variants)
    assert base.page_bytes == 4 * 2 * 3 * 16 * 2 and base.dtype == "bfloat16"


def test_namespace_refuses_bad_fields() -> None:
    """An empty revision or a TP rank outside the TP size is refused by name."""
    good = Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r")
    with pytest.raises(ValueError, match="model_revision"):
        Namespace(**{**good.__dict__, "model_revision": ""})
    with pytest.raises(ValueError, match="tp_rank"):
        Namespace(**{**good.__dict__, "tp_rank": 2, "tp_size": 2})


def test_the_edges_of_the_token_range_and_pages_of_one_token_are_hashed() -> None:
    """Token ids 0 and 2**32 - 1 are valid; pages of one token hash each token."""
    edges = [0, 2**32 - 1, 0, 7]
    assert len(chain_page_hashes(edges, 2)) == 2
    ones = chain_page_hashes(edges, 1)
    assert len(ones) == 4 and len(set(ones)) == 4
    assert chain_page_hashes(edges[:2], 1) == ones[:2]


def test_ids_of_2_32_or_more_are_hashed_page_by_page_as_u64() -> None:
    """The tree takes ids up to 2**63 (a backup of such a prefix raised out of ``step``):
    a page holding one is hashed as u64 under its own personalisation, the others as
    ever, so each page's hash depends on its prefix only, not on what else a call hashes."""
    small, wide, after = [1, 2], [3, 2**32], [5, 6]
    hashes = chain_page_hashes(small + wide + after, 2)
    assert hashes[0] == chain_page_hashes(small, 2)[0]  # before the wide page: unchanged
    assert hashes[1:] == chain_page_hashes(wide + after, 2, parent=hashes[0])
    assert hashes[2] == chain_page_hashes(after, 2, parent=hashes[1])[0]
    # not the id's low 32 bits, nor any u32 page of the same bytes
    assert hashes[1] != chain_page_hashes([*small, 3, 0], 2)[1]
    assert len(set(chain_page_hashes([2**63 - 1, 2**40, 2**32, 2**62], 1))) == 4
    assert chain_page_hashes(np.array([7, 2**40], dtype=np.int64), 2) == \
        chain_page_hashes([7, 2**40], 2) == chain_page_hashes(torch.tensor([7, 2**40]), 2)


def test_the_hashes_of_pages_with_ids_of_2_32_or_more_keep_their_values() -> None:
    """Golden values: two instances of any version find each other's pages."""
    hashes = chain_page_hashes([1, 2**32, 2**62 + 5, 4], 2)
    assert [h.hex()[:16] for h in hashes] == GOLDEN_WIDE


def test_a_bool_extra_key_is_refused() -> None:
    with pytest.raises(TypeError, match="extra_keys items must be str, int or bytes, got True"):
        chain_page_hashes(TOKENS, 4, extra_keys=(True,))


@pytest.mark.parametrize(("field", "value"), [
    ("num_layers", True), ("page_size", 0), ("segment_bytes", ()), ("segment_bytes", (0,)),
    ("segment_bytes", (16, -1)), ("dtype", "")])
def test_namespace_refuses_each_bad_field_by_name(field: str, value: object) -> None:
    good = Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r")
    with pytest.raises(ValueError, match=f"Namespace.{field} must be"):
        Namespace(**{**good.__dict__, field: value})


def test_a_namespace_is_one_shard_by_default_takes_one_byte_segments_and_is_frozen() -> None:
    good = Namespace.for_host_pool(make_pool(), model_id="m", model_revision="r")
    fields = {**good.__dict__, "segment_bytes": (1,)}
    del fields["tp_rank"], fields["tp_size"]
    namespace = Namespace(**fields)
    assert (namespace.tp_rank, namespace.tp_size, namespace.page_bytes) == (0, 1, 1)
    with pytest.raises(AttributeError):
        namespace.salt = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):  # every field by name, none by position
        Namespace(*[getattr(good, f.name) for f in dataclasses.fields(Namespace)])  # type: ignore[misc]


def test_page_hashes_keep_their_values_across_versions() -> None:
    """A store names pages by these hashes, so any change of them strands every stored page:
    the values of pages of 4 tokens 0..11, at a sequence's start and after a parent with
    extra keys, pinned, and the definition written out (blake2b of 32 bytes, personalised,
    over the previous hash, the extra keys' digest and the page's ids as u32 little-endian)."""
    import hashlib
    import struct

    from hicache.storage.keys import ROOT_HASH

    assert [h.hex() for h in chain_page_hashes(list(range(12)), 4)] == [
        "a30b5217cf56722d45b06de14715fa980875ee04c0f88cbf6703bff28655d6a7",
        "9df4d998dda0d9f85de2b1409d3a493c9f3979733c073d1e1e7e0e6cd86fd76f",
        "3ccefa88599aa8b9b1d0283181b96cb85230f9333e7a23ec6af02a689dd15e21"]
    parent = bytes(range(32))
    assert [h.hex() for h in chain_page_hashes(list(range(12)), 4, parent=parent,
                                                extra_keys=("lora", 7))] == [
        "876f721edf9c8851cee6be9562e9f628ca9cae16095d9c4d76fd45c2f25fa6a9",
        "10aed0c606ed9bd0cf6da4ce0e932dcb9ca26a01aa225f174b06f8f586014b4d",
        "c0440858071462ddfd279122bdc813258832db0651356a7e62ce540479eec045"]
    previous, written_out = ROOT_HASH, []
    for page in range(3):
        ids = struct.pack("<4I", *range(4 * page, 4 * page + 4))
        previous = hashlib.blake2b(previous + ids, digest_size=32,
                                   person=b"hicache.page.v1").digest()
        written_out.append(previous)
    assert written_out == chain_page_hashes(list(range(12)), 4)
