"""The ctypes front of the native CPU paged-attention kernel (worker_proc/csrc, built by native_build.py).

One call per layer attends every token of the step: a decode is a member with one query, a
prefill chunk's queries each see one position more. The C side checks every read against the cache
and the block tables before it touches them, so a bad table is an error naming the token or member,
never a stray read.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from pathlib import Path

import torch

from worker_proc.attention.native_build import NativeBuildError, build

log = logging.getLogger(__name__)

__all__ = ["NativeBuildError", "PagedAttentionKernel", "load_native_library", "load_paged_attention",
           "failure_of", "thread_count", "vectorised_library"]

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# paged_attend's C signature, in order (csrc/paged_attention.c).
_ARGTYPES = [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32,
             ctypes.c_float, _I32, _I32, _I32, ctypes.POINTER(ctypes.c_int64)]
PATHS = ("portable", "avx2", "avx512")  # paged_attention_path's return values, in order
BLOCK_PATHS = ("none", "avx2", "avx512")  # paged_attention_block_path's, in order
# (q's dtype, the caches') -> paged_attend's dtypes argument (enum Dtypes, csrc/paged_attention.h)
_DTYPES = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1,
           (torch.float32, torch.bfloat16): 2}
# GNU, Intel and LLVM OpenMP runtimes, also as wheels vendor them (libgomp-a34b3233.so.1); not
# their siblings (libgompd, libomptarget).
_OPENMP_RUNTIME = re.compile(r"lib(?:gomp|iomp5|omp)(?:-[0-9a-f]{8})?\.so(?:\.\d+)*")


class PagedAttentionKernel:
    """Calls release the GIL. Checks what C cannot: dtypes, layouts and shapes."""

    def __init__(self, library: ctypes.CDLL, path: Path, num_threads_cap: int | None) -> None:
        self.path = path
        self.num_threads_cap = num_threads_cap  # 1 when a second OpenMP runtime is loaded
        self._attend = library.paged_attend
        # A build of an older checkout (bench_attention --sources) has no split_positions argument.
        self.takes_split_positions = hasattr(library, "paged_attention_splits")
        self._attend.argtypes = _ARGTYPES if self.takes_split_positions else _ARGTYPES[:18] + _ARGTYPES[19:]
        self._attend.restype = ctypes.c_int
        self._path = library.paged_attention_path
        self._path.argtypes = [_I32, _I32, _I32]
        self._path.restype = ctypes.c_int
        self._block_path = library.paged_attention_block_path
        self._block_path.argtypes = [_I32, _I32, _I32]
        self._block_path.restype = ctypes.c_int

    def code_path(self, dtype: torch.dtype, group: int, head_dim: int, cache_dtype: torch.dtype | None = None) -> str:
        """Which of PATHS this build runs for q in dtype over a cache of cache_dtype (None: the same)
        and this shape (portable: slower than the torch reference)."""
        dtypes = _dtypes(dtype, dtype if cache_dtype is None else cache_dtype)
        return PATHS[_checked(self._path(dtypes, group, head_dim), dtypes)]

    def block_path(self, dtype: torch.dtype, group: int, head_dim: int, cache_dtype: torch.dtype | None = None) -> str:
        """Which of BLOCK_PATHS attends a prefill chunk's queries in blocks (none: one by one)."""
        dtypes = _dtypes(dtype, dtype if cache_dtype is None else cache_dtype)
        return BLOCK_PATHS[_checked(self._block_path(dtypes, group, head_dim), dtypes)]

    @property
    def takes_mixed_dtypes(self) -> bool:
        """Whether this build knows enum Dtypes (fp32 q over a bf16 cache): one from before it read
        the argument as a bf16 flag, and so takes every value past 1 for bf16 throughout."""
        return self._path(len(_DTYPES), 1, 64) == -1

    def __call__(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, token_members: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, num_threads: int, split_positions: int = 0) -> None:
        """Writes every row of out: token t attends to the first context_lens[t] positions of block
        table row token_members[t]. A decode (its member's only query in the step) over more than
        split_positions positions (a multiple of 16; 0: never) is attended in parts of at most that
        many, which the threads share, and merged: its output depends on its context alone, never on
        the step's other queries or the thread count.
        q: [num_tokens, num_heads, head_dim], heads contiguous, token rows any stride apart;
        out: the same shape and dtype, contiguous; caches: [num_kv_heads, num_slots, head_dim]
        contiguous, in q's dtype or, under fp32 q, bf16;
        block_tables int32 [num_seqs, max_blocks]; token_members, context_lens int32 [num_tokens]."""
        num_heads, num_kv_heads, head_dim, num_slots = _check_layouts(q, out, k_cache, v_cache)
        indices = (block_tables, token_members, context_lens)
        if not all(t.dtype == torch.int32 and t.is_contiguous() for t in indices):
            raise ValueError("native attention needs contiguous int32 block tables, token members and "
                             "context lengths")
        if not len(token_members) == len(context_lens) == len(q):
            raise ValueError(f"native attention: {len(q)} query rows, {len(token_members)} token members, "
                             f"{len(context_lens)} context lengths")
        if self.num_threads_cap is not None:
            num_threads = min(num_threads, self.num_threads_cap)
        if not self.takes_split_positions and split_positions:
            raise ValueError(f"native attention: {self.path} predates split_positions; pass 0")
        where = ctypes.c_int64(-1)
        split = (split_positions,) if self.takes_split_positions else ()
        status = self._attend(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(),
                              v_cache.data_ptr(), num_slots, block_tables.data_ptr(), block_tables.shape[0],
                              block_tables.shape[1], token_members.data_ptr(), context_lens.data_ptr(),
                              len(q), num_heads, num_kv_heads, head_dim, block_size, head_dim ** -0.5,
                              _DTYPES[q.dtype, k_cache.dtype], *split, num_threads,
                              ctypes.byref(where))  # checked above
        if status != 0:
            raise failure_of(status, where.value, block_tables, token_members, context_lens, num_slots,
                             block_size, (num_heads, num_kv_heads, head_dim), split_positions)


def _checked(path: int, dtypes: int) -> int:
    """A path function's index, or ValueError for its -1 (dtypes outside enum Dtypes)."""
    if path < 0:
        raise ValueError(f"native attention: this build has no dtypes {dtypes} (enum Dtypes)")
    return path


def _dtypes(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """paged_attend's dtypes for this pair, or ValueError."""
    try:
        return _DTYPES[(q_dtype, cache_dtype)]
    except KeyError:
        raise ValueError(f"native attention has no path for {q_dtype} q over a {cache_dtype} cache") from None


def _check_layouts(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, num_slots), or ValueError for what the kernel cannot read."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, num_slots = k_cache.shape[:2]
    if (q.dtype != out.dtype or k_cache.dtype != v_cache.dtype
            or (q.dtype, k_cache.dtype) not in _DTYPES):
        raise ValueError(f"native attention needs q and out of one dtype and caches of another or the "
                         f"same: bfloat16/float32 throughout or float32 over a bfloat16 cache, got "
                         f"{q.dtype}, {out.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous() or out.shape != q.shape:
        raise ValueError("native attention needs q's heads contiguous and out contiguous in q's shape")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.shape[2] == head_dim):
        raise ValueError(f"native attention needs contiguous [kv_heads, slots, {head_dim}] caches, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    return num_heads, num_kv_heads, head_dim, num_slots


def failure_of(status: int, where: int, block_tables: torch.Tensor, token_members: torch.Tensor,
               context_lens: torch.Tensor, num_slots: int, block_size: int,
               shape: tuple[int, int, int], split_positions: int) -> Exception:
    """The exception for paged_attend's nonzero status (enum Status), naming what is at fault."""
    num_seqs, max_blocks = block_tables.shape
    if status == -7:
        return ValueError("native attention: the dtypes argument is not one of enum Dtypes")
    if status == -1:
        return ValueError(f"native attention: {shape[0]} heads, {shape[1]} KV heads, head_dim {shape[2]}, "
                          f"block_size {block_size} and split_positions {split_positions} (0 or a multiple "
                          f"of 16) are not a valid attention shape")
    if status == -4:
        return MemoryError("native attention: out of memory for its work lists, scores or partial rows")
    if status == -6:
        num_blocks = num_slots // block_size
        row = block_tables[where]
        block = int(row[(row < 0) | (row >= num_blocks)][0])
        return ValueError(f"native attention: member {where}'s block table names block {block}, the "
                          f"cache holds {num_blocks} blocks of {block_size} slots")
    if status not in (-2, -3, -5):
        return RuntimeError(f"native attention failed with unknown status {status}")
    member, n = int(token_members[where]), int(context_lens[where])
    says = {-5: f"member {member} is not one of the step's {num_seqs} block tables",
            -2: f"context length {n} is < 1",
            -3: f"context of {n} tokens needs {-(-n // block_size)} blocks of {block_size}, its block "
                f"table holds {max_blocks}"}[status]
    return ValueError(f"native attention: token {where} (member {member}): {says}")


def load_paged_attention(cpu_isa: str = "") -> PagedAttentionKernel:
    """Built for cpu_isa (EngineConfig.cpu_isa; '' = all this CPU has) or reused, and loaded once per
    process. Raises NativeBuildError."""
    return PagedAttentionKernel(*load_native_library(cpu_isa))


def thread_count(num_threads_cap: int | None) -> int:
    """The threads a native call may use: torch's, under the library's cap (load_native_library)."""
    num_threads = torch.get_num_threads()
    return num_threads if num_threads_cap is None else min(num_threads, num_threads_cap)


@functools.cache
def load_native_library(cpu_isa: str = "") -> tuple[ctypes.CDLL, Path, int | None]:
    """The native library (attention and the skinny linear, worker_proc/csrc) built for cpu_isa,
    loaded once per process: (library, its path, the thread cap its OpenMP calls must keep: 1 when
    a second OpenMP runtime is loaded, else None). Raises NativeBuildError."""
    path = build(cpu_isa=cpu_isa)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeBuildError(f"cannot load {path}: {error}") from error
    runtimes = openmp_runtimes()
    cap = None
    if len(runtimes) > 1:
        log.warning("native attention runs one thread: two OpenMP runtimes are loaded (%s)",
                    ", ".join(sorted(runtimes)))
        cap = 1
    return library, path, cap


def vectorised_library(dtype: torch.dtype, dtypes: tuple[torch.dtype, ...], cpu_isa: str,
                       probe: str, needs: str = "AVX2 + FMA") -> tuple[ctypes.CDLL, int | None] | str:
    """(the native library, its thread cap) when the model computes in one of `dtypes` and the
    library's `probe()` (a function of worker_proc/csrc returning 1 or 0) says this build, under
    the ISA cap, vectorises that path; else why not (`needs`: what the probe asks of the build)."""
    if dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"the model computes in {str(dtype).removeprefix('torch.')}, the native path in {names}"
    try:
        library, path, cap = load_native_library(cpu_isa)
    except NativeBuildError as error:
        return f"the native library is unavailable: {error}"
    if not getattr(library, probe)():
        return f"{path.name} was built without {needs}"
    return library, cap


def openmp_runtimes() -> set[str]:
    """Distinct OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps
                    if _OPENMP_RUNTIME.fullmatch(line.rstrip().rsplit("/", 1)[-1])}
    except OSError:
        return set()
