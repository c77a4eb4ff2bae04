"""Whole-page copies between a staging buffer and a device pool by one small CUDA kernel,
launched straight through the driver: the staged backend's page gather and scatter where a
chunk's device slots are whole device pages (``page_first_direct`` and ``layer_first``
hosts, :mod:`.chunk_pages`).

torch's ``index_copy_`` / ``index_select`` on the paged views do the same copy, but cost
12-18 us of CPU per call to issue on an H200 host against 8.5-11 for this kernel's launch,
and for a small chunk several kernels' worth of GPU time: 35 against 10 us for 16 pages of
one layer, 84 against 72 us for 680 pages of 3 layers (one script, bit-identical). A staged
chunk makes one such call per block of layers; in one process, alternating, a layer-wise
load of 256 / 2048 tokens (32 layers, 16-token pages, random device pages) of a
``page_first_direct`` host was issued in 535 / 858 us against 576 / 940 with torch's
copies, a write in 344 / 498 against 365 / 558; of a ``layer_first`` host (against its
slot copies) 471 / 959 against 508 / 1011 and 295 / 520 against 329 / 550.

The kernel is compiled once per GPU architecture with NVRTC (the library torch's CUDA
build ships and has already loaded; 0.09 s on the H200 host, at the first staged op) and
loaded as a context-independent library
(``cuLibraryLoadData``); its arguments for one pair of views are packed once into a buffer
(:class:`PageLaunch`), so a launch sets the chunk's index pointer and makes one driver call
on the current stream. Anything else (a CPU pool, no NVRTC or driver entry points, views
whose pages are not 16-byte aligned contiguous blocks, an index that is not contiguous
int64) takes torch's call instead: :func:`page_launches` returns ``None`` and the caller
keeps its own path.

An index entry outside the device pool's pages moves nothing (the controller checked every
page on the CPU before the index was uploaded; the kernel does not trust it anyway).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from .cuda_libraries import mapped_libraries

logger = logging.getLogger(__name__)

_NAME = b"hicache_page_copy"
_SOURCE = rb"""
extern "C" __global__ void hicache_page_copy(
    const int4* __restrict__ src, int4* __restrict__ dst, const long long* __restrict__ index,
    long long limit, long long page_vecs, long long src_c, long long src_l, long long src_p,
    long long dst_c, long long dst_l, long long dst_p, long long scatter)
{
    long long p = blockIdx.x, page = index[p];
    if (page < 0 || page >= limit) return;
    long long src_page = scatter ? p : page, dst_page = scatter ? page : p;
    const int4* s = src + blockIdx.z * src_c + blockIdx.y * src_l + src_page * src_p;
    int4* d = dst + blockIdx.z * dst_c + blockIdx.y * dst_l + dst_page * dst_p;
    for (long long i = threadIdx.x; i < page_vecs; i += blockDim.x) d[i] = s[i];
}
"""
_VEC = 16  # bytes per int4
_NUM_PARAMS = 12
_INDEX_PARAM = 2
_LAUNCH_BUFFER_POINTER, _LAUNCH_BUFFER_SIZE, _LAUNCH_END = 1, 2, 0  # CU_LAUNCH_PARAM_*
MAX_THREADS = 256
# the raw handle of a device's current stream (absent from a CPU build of torch)
_CURRENT_RAW_STREAM: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class PageLaunch:
    """One launch's packed arguments: the copy between one staged block of layers
    ``[C, count, pages, page_size, row]`` and the device pool's view of the same layers,
    with every argument but the index pointer fixed (both buffers outlive their views'
    caches); ``grid`` is ``(pages, count, C)``."""

    def __init__(self, kernel: int, staged: torch.Tensor, device: torch.Tensor,
                 scatter: bool) -> None:
        self.kernel = kernel
        self.device_index = staged.device.index
        size = staged.element_size()
        c, count, pages, page_size, width = staged.shape
        self.grid = (pages, count, c)
        page_vecs = page_size * width * size // _VEC
        self.threads = min(MAX_THREADS, (page_vecs + 31) // 32 * 32)
        src, dst = (staged, device) if scatter else (device, staged)
        vecs = [stride * size // _VEC for view in (src, dst) for stride in view.stride()[:3]]
        self.params = (ctypes.c_int64 * _NUM_PARAMS)(
            src.data_ptr(), dst.data_ptr(), 0, device.shape[2], page_vecs, *vecs, int(scatter))
        self._size = ctypes.c_size_t(ctypes.sizeof(self.params))
        self.extra = (ctypes.c_void_p * 5)(
            _LAUNCH_BUFFER_POINTER, ctypes.addressof(self.params),
            _LAUNCH_BUFFER_SIZE, ctypes.addressof(self._size), _LAUNCH_END)


def page_launches(staged: Sequence[torch.Tensor], device: Sequence[torch.Tensor],
                  scatter: bool) -> list[PageLaunch] | None:
    """The launches that copy each staged block of layers to (``scatter``) or from its
    device view, block by block; ``None`` when the kernel cannot serve them (see the module
    docstring): the caller uses torch's indexed copy."""
    if not staged or not all(_fits(s, d) for s, d in zip(staged, device, strict=True)):
        return None
    kernel = _kernel(torch.cuda.get_device_capability(staged[0].device))
    if kernel is None:
        return None
    return [PageLaunch(kernel, s, d, scatter) for s, d in zip(staged, device, strict=True)]


def index_fits(index: torch.Tensor) -> bool:
    """Whether ``index`` can be read by the kernel (contiguous int64 on a GPU)."""
    return index.is_cuda and index.dtype is torch.int64 and index.is_contiguous()


def launch_pages(launches: list[PageLaunch], index: int, stream: int | None = None) -> None:
    """Copy the pages of every launch with the page ids at device address ``index`` (int64,
    the device page of each staged page: a tensor :func:`index_fits`) on the CUDA stream of
    raw handle ``stream``, by default the current stream of the launches' device, where
    torch's indexed copy runs.

    Raises:
        RuntimeError: the driver refused the launch (named with its code).
    """
    launch = _driver().cuLaunchKernel
    if stream is None:
        stream = _CURRENT_RAW_STREAM(launches[0].device_index)
    for item in launches:
        item.params[_INDEX_PARAM] = index
        status = launch(item.kernel, *item.grid, item.threads, 1, 1, 0, stream, None, item.extra)
        if status != 0:
            raise RuntimeError(f"page copy kernel: the CUDA driver refused the launch "
                               f"(CUresult {status}) of grid {item.grid}")


def _fits(staged: torch.Tensor, device: torch.Tensor) -> bool:
    """Both are ``[C, count, pages, page_size, row]`` CUDA views of one dtype whose pages
    are contiguous blocks, with 16-byte aligned addresses and strides."""
    if not (staged.is_cuda and device.is_cuda and staged.device == device.device
            and staged.dtype == device.dtype and staged.dim() == 5 and device.dim() == 5
            and staged.shape[:2] == device.shape[:2] and staged.shape[3:] == device.shape[3:]):
        return False
    size, (page_size, width) = staged.element_size(), staged.shape[3:]
    for view in (staged, device):
        if view.stride(4) != 1 or view.stride(3) != width or view.data_ptr() % _VEC:
            return False
        if any(stride * size % _VEC for stride in view.stride()[:3]):
            return False
    return page_size * width * size % _VEC == 0


@functools.cache
def _kernel(capability: tuple[int, int]) -> int | None:
    """The kernel's handle for GPUs of ``capability`` (compiled and loaded on first use),
    or ``None`` (logged once) when NVRTC or the driver cannot provide it."""
    try:
        return _compile_and_load(capability)
    except (OSError, AttributeError, RuntimeError) as error:
        logger.info("page copy kernel unavailable (%s); staged page copies use torch's "
                    "indexed copies", error)
        return None


def _compile_and_load(capability: tuple[int, int]) -> int:
    nvrtc, driver = _nvrtc(), _driver()
    program = ctypes.c_void_p()
    _ok(nvrtc.nvrtcCreateProgram(ctypes.byref(program), _SOURCE, b"page_copy.cu", 0, None,
                                 None), "nvrtcCreateProgram")
    try:
        option = f"--gpu-architecture=sm_{capability[0]}{capability[1]}".encode()
        options = (ctypes.c_char_p * 1)(option)
        if nvrtc.nvrtcCompileProgram(program, 1, options) != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile the kernel: {log.value.decode()}")
        size = ctypes.c_size_t()
        _ok(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _ok(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    library, kernel = ctypes.c_void_p(), ctypes.c_void_p()
    _ok(driver.cuLibraryLoadData(ctypes.byref(library), cubin, None, None, 0, None, None, 0),
        "cuLibraryLoadData")
    _ok(driver.cuLibraryGetKernel(ctypes.byref(kernel), library, _NAME), "cuLibraryGetKernel")
    assert kernel.value is not None
    return kernel.value


def _ok(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with status {status}")


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """NVRTC: the copy torch loaded, else one found by name."""
    for name in [*mapped_libraries("libnvrtc.so"), "libnvrtc.so.13", "libnvrtc.so.12",
                 "libnvrtc.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no NVRTC library (libnvrtc) found")


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver, with ``cuLaunchKernel`` typed."""
    driver = ctypes.CDLL("libcuda.so.1")
    launch = driver.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 6, ctypes.c_uint, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p]
    return driver
