"""Token ids checked once per request: :class:`TokenKey` and the validation behind it.

An engine calls ``service.key(tokens)`` once when a request arrives and passes the key to
``match``, ``insert`` and ``load_back``; each of them then skips the check that raw token ids
get (a 2k-token list costs tens of microseconds to check, more than the tree walk). A key is
immutable (it owns a tuple), so a buffer the engine refills later cannot make it stale.

Raw token ids are still accepted everywhere and checked at the call.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

# integer tensor dtypes numpy reads as they are (no bool: it is refused by name)
_TENSOR_INT_DTYPES = frozenset((torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64))

# Token ids as engines hold them: ``[n]`` Python ints, or a 1-D integer tensor / numpy array.
TokenIds = Sequence[int] | torch.Tensor | np.ndarray

# The tree holds keys as bytes: every token id as a native 8-byte signed int, so a page of
# 16 tokens is one 128-byte string (a tuple would keep 16 Python ints alive: ~580 bytes).
TOKEN_BYTES = 8

_TOKENS_EXPECTED = "a list or tuple of ints, or a 1-D integer torch tensor or numpy array"


class TokenKey:
    """A request's token ids, checked, with the whole-page prefix the tree works on.

    Build it with ``HiCacheService.key`` (or :meth:`RadixTree.key`); the fields are
    read-only. The key holds every token packed (``TOKEN_BYTES`` each), not a tuple of Python
    ints: ``tokens`` and ``pages`` unpack on demand (for debugging; the cache reads ``data``).

    Attributes:
        tokens: every token id, as a tuple of Python ints.
        pages: ``tokens`` cut to whole pages of ``page_size``.
        page_size: tokens per page of the tree it was made for.
        data: ``pages`` as the tree holds them (:func:`key_bytes`).
    """

    __slots__ = ("_packed", "data", "num_tokens", "page_size")

    def __init__(self, tokens: TokenIds, page_size: int, op: str = "key") -> None:
        # built by hand, it checks what ``make_key`` checks: the tree trusts a key's ids
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"{op}: page_size must be an int >= 1 (the tree's "
                             f"page_size_tokens), got {page_size!r}")
        ids = token_ids(tokens, op)
        self._init(key_bytes(ids, op), len(ids), page_size)

    @classmethod
    def from_packed(cls, packed: bytes, page_size: int) -> TokenKey:
        """A key of token ids already packed and checked (:func:`make_key`)."""
        key = cls.__new__(cls)
        key._init(packed, len(packed) // TOKEN_BYTES, page_size)
        return key

    def _init(self, packed: bytes, num_tokens: int, page_size: int) -> None:
        whole = num_tokens // page_size * page_size
        object.__setattr__(self, "_packed", packed)
        object.__setattr__(self, "num_tokens", num_tokens)
        object.__setattr__(self, "page_size", page_size)
        object.__setattr__(self, "data", packed[:whole * TOKEN_BYTES])

    _packed: bytes
    num_tokens: int
    page_size: int
    data: bytes

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token id of the key, partial last page included (decoded: for tests)."""
        return key_tokens(self._packed)

    @property
    def pages(self) -> tuple[int, ...]:
        """The token ids of the key's whole pages, the part the tree caches (decoded)."""
        return key_tokens(self.data)

    @property
    def num_page_tokens(self) -> int:
        """Tokens in whole pages (``len(pages)``, without unpacking them)."""
        return len(self.data) // TOKEN_BYTES

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TokenKey is read-only: make a new key for other tokens "
                             f"(tried to set {name})")

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"TokenKey({self.num_tokens} tokens, {self.num_page_tokens} in whole pages)"


def key_bytes(ids: Sequence[int], op: str) -> bytes:
    """``ids`` as the tree's key bytes (``TOKEN_BYTES`` per token, native order, in C).

    Raises:
        ValueError: a token id of 2**63 or more (no tokenizer has one).
    """
    try:
        return array("q", ids).tobytes()
    except OverflowError:
        big = next(i for i, token in enumerate(ids) if token >= 2**63)
        raise ValueError(f"{op}: token ids must be < 2**63, got tokens[{big}] = "
                         f"{ids[big]}") from None


def key_tokens(data: bytes) -> tuple[int, ...]:
    """The token ids of key bytes (for debugging and tests)."""
    return tuple(array("q", data))


def make_key(tokens: TokenIds, page_size: int, op: str) -> TokenKey:
    """A checked :class:`TokenKey` of ``tokens`` (as :func:`token_ids` checks them). A list
    or tuple of Python ints, the common case, is packed and checked in C
    (:func:`_packed_ids`); anything else, or a list that fails there, goes through
    :func:`token_ids`, which names what is wrong."""
    if isinstance(tokens, (list, tuple)):
        packed = _packed_ids(tokens)
        if packed is not None:
            return TokenKey.from_packed(packed, page_size)
    elif isinstance(tokens, (np.ndarray, torch.Tensor)):
        packed = _packed_array(tokens)
        if packed is not None:
            return TokenKey.from_packed(packed, page_size)
    return TokenKey(tokens, page_size, op)


def _packed_array(tokens: np.ndarray | torch.Tensor) -> bytes | None:
    """Key bytes of a 1-D integer array or CPU tensor of valid token ids, packed by numpy
    (2k ids: about 3 us, where unpacking them into Python ints first took 65), or ``None``
    when it is anything else (another dtype or shape, a negative id or one of ``2**63`` or
    more, a tensor off the CPU): the checked path then names what is wrong, or copies the
    tensor to the host."""
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu" or tokens.dtype not in _TENSOR_INT_DTYPES:
            return None
        array = tokens.detach().numpy()
    else:
        array = tokens
    kind = array.dtype.kind
    if array.ndim != 1 or kind not in "iu":
        return None
    if array.size and ((kind == "i" and array.min() < 0)
                       or (kind == "u" and array.dtype.itemsize == 8
                           and array.max() >= 2**63)):
        return None
    return array.astype(np.int64, copy=False).tobytes()


def _packed_ids(tokens: Sequence[object]) -> bytes | None:
    """Key bytes of a list of valid token ids, or ``None`` when one is not (the caller then
    checks element by element for the error message).

    ``array("Q")`` packs in C and refuses what is not an integer (``TypeError``) and a
    negative id or one of ``2**64`` or more (``OverflowError``); ids of ``2**63`` or more
    pack but read back negative as int64. A bool is an int to it (True packs as 1), so the
    elements whose value is 0 or 1, and only those, have their type looked at."""
    try:
        packed = array("Q", cast("Sequence[int]", tokens))  # refuses what is not an int
    except (TypeError, OverflowError):
        return None
    values = np.frombuffer(packed, dtype=np.int64)
    # one pass finds both: ids read negative (2**63 or more) and those of 0 or 1 (bools?)
    (low,) = (values <= 1).nonzero()
    if low.size and (values[low].min() < 0 or
                     any(type(tokens[i]) is not int for i in low.tolist())):
        return None
    return packed.tobytes()


def token_ids(tokens: TokenIds, op: str) -> tuple[int, ...]:
    """Validated ``[n]`` token ids as a tuple of Python ints.

    Accepted: a list or tuple of ints (not bools), or a 1-D integer torch tensor (any device;
    a CUDA tensor is copied to the host) or numpy array. Lists of Python ints, the common
    case, are checked, copied and sign-checked in C.

    Raises:
        TypeError: anything else (``None``, a string, floats, bools, nested lists, a float or
            bool tensor, a tensor that is not 1-D), naming ``op``.
        ValueError: a negative token id.
    """
    if isinstance(tokens, (list, tuple)):
        if set(map(type, tokens)) - {int}:  # in C; bool is its own type, so it goes there
            return _mixed_ids(tokens, op)
        ids = tuple(tokens)
        if ids and min(ids) < 0:
            _refuse_negative(np.asarray(ids), op)
        return ids
    if isinstance(tokens, torch.Tensor):
        dtype = tokens.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{op}: token ids must have an integer dtype, got a {dtype} tensor")
        return _array_ids(tokens.detach().cpu().numpy(), op)
    if isinstance(tokens, np.ndarray):
        return _array_ids(tokens, op)
    if isinstance(tokens, TokenKey):
        return tokens.tokens
    if isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes, bytearray)):
        return token_ids(list(tokens), op)
    raise TypeError(f"{op}: tokens must be {_TOKENS_EXPECTED}, got {type(tokens).__name__}")


def _array_ids(array: np.ndarray, op: str) -> tuple[int, ...]:
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"{op}: tokens must be {_TOKENS_EXPECTED}, got a {array.ndim}-D "
                        f"array of {array.dtype}")
    if array.dtype.kind == "i" and array.size and array.min() < 0:
        _refuse_negative(array, op)
    return tuple(array.tolist())


def _mixed_ids(tokens: Sequence[object], op: str) -> tuple[int, ...]:
    """A sequence with some elements that are not Python ints: numpy integers are fine;
    the first other element (bool, float, None, list, ...) is refused."""
    ids: list[int] = []
    for position, token in enumerate(tokens):
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise TypeError(
                f"{op}: token ids must be ints, got tokens[{position}] = {token!r:.40} "
                f"({type(token).__name__}); tokens must be {_TOKENS_EXPECTED}"
            )
        ids.append(int(token))
    if ids and min(ids) < 0:
        _refuse_negative(np.asarray(ids), op)
    return tuple(ids)


def _refuse_negative(array: np.ndarray, op: str) -> None:
    position = int(np.argmax(array < 0))
    raise ValueError(f"{op}: token ids must be >= 0, got tokens[{position}] = "
                     f"{int(array[position])}")
