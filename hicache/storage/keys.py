"""Page keys: chained page hashes and the namespace digest.

A page's hash identifies the whole prefix that ends with it: ``blake2b-256(parent hash ||
extra-keys digest || this page's token ids as u32 little-endian)``, the first page's parent
being 32 zero bytes (a page holding an id of ``2**32`` or more: its ids as u64, under another
personalisation). Every engine process, machine and Python version computes the same
hashes (no built-in ``hash``, no pickle, no random seed), so two instances share pages.

The :class:`Namespace` digest covers everything that changes a page's bytes (model and its
revision or weights digest, dtype, geometry, page size, host layout, TP rank and size,
the object format's version): pages of another model revision are simply not found.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from ..pools import HostKVPool

PAGE_HASH_BYTES = 32
NAMESPACE_BYTES = 16
FORMAT_VERSION = 1
ROOT_HASH = bytes(PAGE_HASH_BYTES)
_PERSON = b"hicache.page.v1"
_WIDE_PERSON = b"hicache.page.w1"  # pages with an id of 2**32 or more, as u64
_MAX_TOKEN_ID = 2**32 - 1

ExtraKey = str | int | bytes


def chain_page_hashes(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    page_size: int,
    *,
    parent: bytes | None = None,
    extra_keys: Sequence[ExtraKey] = (),
) -> list[bytes]:
    """Hashes of the full pages of ``token_ids`` (a trailing partial page is not hashed).

    Args:
        token_ids: ``[n]`` token ids in ``[0, 2**63)`` (the tree's); a list, NumPy array or
            CPU tensor.
        page_size: tokens per page (>= 1).
        parent: hash of the page before ``token_ids[0]`` when continuing a chain (a request's
            new pages after a cached prefix); ``None`` at the start of a sequence.
        extra_keys: what else makes the KV differ for the same tokens: a LoRA id, a cache
            salt, multimodal hashes. Mixed into every page, so two requests that differ only
            here share nothing.

    Returns:
        ``n // page_size`` hashes of 32 bytes; hash ``i`` identifies the tokens
        ``[0, (i + 1) * page_size)``.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != PAGE_HASH_BYTES):
        raise ValueError(f"parent must be a {PAGE_HASH_BYTES}-byte page hash or None, "
                         f"got {parent!r}")
    tokens, high = _token_array(token_ids)
    extra = _extra_digest(extra_keys)
    previous = ROOT_HASH if parent is None else parent
    num_pages = len(tokens) // page_size
    if high > _MAX_TOKEN_ID:
        return _wide_chain(tokens[:num_pages * page_size].reshape(num_pages, page_size),
                           previous, extra)
    data = tokens.astype("<u4").tobytes()
    page_bytes = 4 * page_size
    hashes = []
    # each page's hash: blake2b(previous hash, extra digest, the page's token ids); a copy of
    # an empty personalised state costs less than making one (64 pages: 22 against 36 us)
    empty = hashlib.blake2b(digest_size=PAGE_HASH_BYTES, person=_PERSON)
    for start in range(0, num_pages * page_bytes, page_bytes):
        digest = empty.copy()
        digest.update(previous + extra + data[start:start + page_bytes])
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def _wide_chain(pages: np.ndarray, previous: bytes, extra: bytes) -> list[bytes]:
    """:func:`chain_page_hashes` of ``[num_pages, page_size]`` tokens of which some are
    ``2**32`` or more (the tree takes ids up to ``2**63``): a page of such ids is hashed as
    u64 under its own personalisation (never equal to a u32 page's hash), any other page
    as ever, so a page's hash depends on its prefix only, whatever else a call hashes."""
    hashes = []
    wides: list[bool] = np.asarray((pages > _MAX_TOKEN_ID).any(axis=1)).tolist()
    for page, wide in zip(pages, wides, strict=True):
        digest = hashlib.blake2b(digest_size=PAGE_HASH_BYTES,
                                 person=_WIDE_PERSON if wide else _PERSON)
        digest.update(previous + extra + page.astype("<u8" if wide else "<u4").tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def _token_array(token_ids: Sequence[int] | np.ndarray | torch.Tensor
                 ) -> tuple[np.ndarray, int]:
    """The ids as a 1-D integer array, checked, and the largest of them (0 when none)."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    if tokens.size == 0:
        return tokens.astype(np.int64), 0
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {tokens.dtype}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= 2**63:
        raise ValueError(f"token ids must lie in [0, 2**63), got min {low}, max {high}")
    return tokens, high


def _extra_digest(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Canonical digest of the extra keys: type-tagged and length-prefixed, so ``("ab",)``,
    ``("a", "b")`` and ``(b"ab",)`` all differ. Empty when there are none."""
    if not extra_keys:
        return b""
    digest = hashlib.blake2b(digest_size=PAGE_HASH_BYTES, person=b"hicache.extra.v1")
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, str | int | bytes):
            raise TypeError(f"extra_keys items must be str, int or bytes, got {key!r}")
        if isinstance(key, str):
            tag, raw = b"s", key.encode("utf-8")
        elif isinstance(key, int):
            tag, raw = b"i", str(key).encode("ascii")
        else:
            tag, raw = b"b", key
        digest.update(tag + struct.pack("<I", len(raw)) + raw)
    return digest.digest()


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Everything that changes the bytes of a stored page; its digest prefixes every key.

    Args:
        model_id: e.g. ``meta-llama/Llama-3.1-8B``.
        model_revision: a commit, tag or digest of the weights: a weight update must change it.
        dtype: KV element type, e.g. ``bfloat16``.
        num_layers, num_components, row_elems: KV geometry of the full pool (components: 2 for
            K and V, 1 for an MLA latent row; row_elems: elements per token per layer).
        page_size: tokens per page.
        layout: host layout of the payload (``layer_first``, ``page_first`` or
            ``page_first_direct``; the byte order of a page differs between them, so pages of
            one layout are never read into another, even where the bytes happen to agree).
        tp_rank, tp_size: the tensor-parallel shard (MLA engines that share one copy pass 0, 1).
        segment_bytes: byte length of each payload segment (the full rows; hybrid models add
            the SWA rows as a second segment).
        salt: optional tenant salt (pages of different salts are never shared).
    """

    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    num_components: int
    row_elems: int
    page_size: int
    layout: str
    segment_bytes: tuple[int, ...]
    tp_rank: int = 0
    tp_size: int = 1
    salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model_id", "model_revision", "dtype", "layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Namespace.{name} must be a non-empty string, "
                                 f"got {getattr(self, name)!r}")
        for name in ("num_layers", "num_components", "row_elems", "page_size", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Namespace.{name} must be an int >= 1, "
                                 f"got {getattr(self, name)!r}")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or \
                not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"Namespace.tp_rank must lie in [0, tp_size={self.tp_size}), "
                             f"got {self.tp_rank}")
        if not self.segment_bytes or any(not isinstance(n, int) or n < 1
                                         for n in self.segment_bytes):
            raise ValueError(f"Namespace.segment_bytes must be positive ints, "
                             f"got {self.segment_bytes!r}")

    @property
    def page_bytes(self) -> int:
        """Payload bytes of one page (all segments)."""
        return sum(self.segment_bytes)

    @property
    def digest(self) -> bytes:
        """16 bytes: SHA-256 of the canonical JSON of every field and the format version."""
        fields = dict(asdict(self), segment_bytes=list(self.segment_bytes),
                      format_version=FORMAT_VERSION)
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).digest()[:NAMESPACE_BYTES]

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def for_host_pool(cls, pool: HostKVPool, *, model_id: str, model_revision: str,
                      tp_rank: int = 0, tp_size: int = 1, salt: str = "") -> Namespace:
        """The namespace of pages read from and written to ``pool`` (full rows only)."""
        geometry = pool.geometry
        page_bytes = (pool.page_size * geometry.num_components * pool.num_layers
                      * geometry.row_bytes)
        return cls(
            model_id=model_id, model_revision=model_revision,
            dtype=str(geometry.dtype).removeprefix("torch."), num_layers=pool.num_layers,
            num_components=geometry.num_components, row_elems=geometry.row_elems,
            page_size=pool.page_size, layout=pool.layout.value, segment_bytes=(page_bytes,),
            tp_rank=tp_rank, tp_size=tp_size, salt=salt,
        )
