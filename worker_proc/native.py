"""Builds the native CPU decode-attention kernel (csrc/paged_decode.c) once per machine and loads it.

The shared library is cached in $CONVEYOR_CACHE/native under a key of the source, the compiler's
version, the flags and this CPU's feature flags (-march=native code must never run on another CPU).
Tensor-parallel workers may build at once: each compiles to a private temporary file and renames it
into place, so a reader only ever sees a complete library.

The kernel threads with OpenMP. Linked by soname (libgomp.so.1), it shares the OpenMP runtime that
torch's CPU wheels already loaded, so its threads are torch's own pool; a second runtime in the
process would leave two sets of spinning threads on the same cores, so then it runs one thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from proto.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 300
# GNU, Intel and LLVM OpenMP runtimes, also as wheels vendor them (libgomp-a34b3233.so.1); not
# their siblings (libgompd, libomptarget).
_OPENMP_RUNTIME = re.compile(r"lib(?:gomp|iomp5|omp)(?:-[0-9a-f]{8})?\.so(?:\.\d+)*")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# paged_decode's C signature, in order (csrc/paged_decode.c documents each argument).
_ARGTYPES = [_P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32,
             ctypes.c_float, _I32, _I32]
# paged_attend_queries's: the same with int64 query_rows, table_rows, int32 context_lens, int64 count.
_QUERY_ARGTYPES = [*_ARGTYPES[:8], _P, _P, _P, _I64, *_ARGTYPES[12:]]
# paged_decode's and paged_attend_queries's nonzero returns (enum Status).
_FAILURES = {-1: "num_kv_heads < 1 or not dividing num_heads, or head_dim or block_size < 1",
             -2: "a query's context length is < 1", -3: "a context runs past its block table",
             -4: "out of memory for the scores buffer (out is incomplete)"}


class NativeBuildError(RuntimeError):
    """The kernel could not be compiled or loaded on this machine; the message says why."""


class PagedDecodeKernel:
    """ctypes front of paged_decode and paged_attend_queries (calls release the GIL). Checks what C
    cannot: dtypes, layouts, shapes and that every slot the block tables name lies in the caches."""

    def __init__(self, library: ctypes.CDLL, path: Path, num_threads_cap: int | None) -> None:
        self.path = path
        self.num_threads_cap = num_threads_cap  # 1 when a second OpenMP runtime is loaded
        self._decode = library.paged_decode
        self._decode.argtypes = _ARGTYPES
        self._decode.restype = ctypes.c_int
        self._queries = library.paged_attend_queries
        self._queries.argtypes = _QUERY_ARGTYPES
        self._queries.restype = ctypes.c_int
        self._vectorised = library.paged_decode_vectorised
        self._vectorised.argtypes = [_I32, _I32, _I32]
        self._vectorised.restype = ctypes.c_int

    def vectorised(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        """True when the AVX512 path covers this dtype and shape (else the C runs its portable loop,
        which is slower than the torch reference)."""
        return bool(self._vectorised(int(dtype == torch.bfloat16), group, head_dim))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                 members: torch.Tensor, block_size: int, num_threads: int,
                 reads_checked: bool = False) -> None:
        """Writes out[cu_seqlens_q[m]] for every decode member m; other rows are left as they are.
        q: [num_tokens, num_heads, head_dim], heads contiguous, token rows any stride apart;
        out: the same shape, contiguous; caches: [num_kv_heads, num_slots, head_dim] contiguous;
        block_tables int32 [num_seqs, max_blocks]; cu_seqlens_q int32 [num_seqs + 1];
        context_lens int32 [num_seqs]; members int64 [num_members].
        reads_checked: check_reads already passed for these index tensors and shapes (it costs a few
        small tensor ops, so a caller running every layer over one step's tables checks once)."""
        num_heads, num_kv_heads, head_dim, num_slots = _check_layouts(q, out, k_cache, v_cache)
        tables = (block_tables, cu_seqlens_q, context_lens)
        int32_ok = all(t.dtype == torch.int32 and t.is_contiguous() for t in tables)
        if not int32_ok or members.dtype != torch.int64 or not members.is_contiguous():
            raise ValueError("native decode needs contiguous int32 block tables, cu_seqlens_q and "
                             "context_lens, and int64 members")
        if not reads_checked:
            self.check_reads(block_tables, cu_seqlens_q, context_lens, members, num_slots, block_size, len(q))
        if self.num_threads_cap is not None:
            num_threads = min(num_threads, self.num_threads_cap)
        status = self._decode(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(),
                              v_cache.data_ptr(), num_slots, block_tables.data_ptr(), block_tables.shape[1],
                              cu_seqlens_q.data_ptr(), context_lens.data_ptr(), members.data_ptr(),
                              len(members), num_heads, num_kv_heads, head_dim, block_size,
                              head_dim ** -0.5, int(q.dtype == torch.bfloat16), num_threads)
        _raise_on_failure("paged_decode", status, q, k_cache, block_size)

    def attend_queries(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, query_rows: torch.Tensor, table_rows: torch.Tensor,
                       context_lens: torch.Tensor, block_size: int, num_threads: int,
                       reads_checked: bool = False) -> None:
        """Prefill chunks as decodes: writes out[query_rows[i]], query i attending to the first
        context_lens[i] positions of block table row table_rows[i] (its causal prefix, this step's K/V
        already in the cache). query_rows, table_rows int64 [num_queries]; context_lens int32
        [num_queries]; the rest as in __call__."""
        num_heads, num_kv_heads, head_dim, num_slots = _check_layouts(q, out, k_cache, v_cache)
        if not (block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.is_contiguous()
                and context_lens.is_contiguous() and query_rows.dtype == table_rows.dtype == torch.int64
                and query_rows.is_contiguous() and table_rows.is_contiguous()):
            raise ValueError("native attention needs contiguous int32 block tables and context_lens, and "
                             "int64 query_rows and table_rows")
        if not reads_checked:
            _check_query_reads(block_tables, query_rows, table_rows, context_lens, num_slots, block_size,
                               len(q), lambda i: f"query row {int(query_rows[i])}'s")
        if self.num_threads_cap is not None:
            num_threads = min(num_threads, self.num_threads_cap)
        status = self._queries(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), num_slots, block_tables.data_ptr(), block_tables.shape[1],
                               query_rows.data_ptr(), table_rows.data_ptr(), context_lens.data_ptr(),
                               len(query_rows), num_heads, num_kv_heads, head_dim, block_size,
                               head_dim ** -0.5, int(q.dtype == torch.bfloat16), num_threads)
        _raise_on_failure("paged_attend_queries", status, q, k_cache, block_size)

    @staticmethod
    def check_reads(block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                    members: torch.Tensor, num_slots: int, block_size: int, num_tokens: int) -> None:
        """Raises ValueError naming the first decode member whose query row or K/V reads would fall
        outside q or the caches (whole blocks of num_slots). Tensors as in __call__."""
        num_seqs = len(block_tables)
        if len(cu_seqlens_q) != num_seqs + 1 or len(context_lens) != num_seqs:
            raise ValueError(f"native decode: {num_seqs} block tables, but {len(cu_seqlens_q)} "
                             f"cu_seqlens_q entries and {len(context_lens)} context_lens")
        outside_batch = (members < 0) | (members >= num_seqs)
        if bool(outside_batch.any()):
            raise ValueError(f"native decode: decode member {int(members[outside_batch][0])} is not one of "
                             f"the batch's {num_seqs} members")
        _check_query_reads(block_tables, cu_seqlens_q[members].long(), members, context_lens[members],
                           num_slots, block_size, num_tokens, lambda i: f"member {int(members[i])}'s")


def _check_layouts(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, num_slots), or ValueError for what the kernel cannot read."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, num_slots = k_cache.shape[:2]
    dtypes = {q.dtype, out.dtype, k_cache.dtype, v_cache.dtype}
    if len(dtypes) != 1 or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"native decode needs one dtype of bfloat16/float32 for q, out and caches, "
                         f"got {q.dtype}, {out.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous():
        raise ValueError("native decode needs q's heads and out contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.shape[2] == head_dim):
        raise ValueError(f"native decode needs contiguous [kv_heads, slots, {head_dim}] caches, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    return num_heads, num_kv_heads, head_dim, num_slots


def _check_query_reads(block_tables: torch.Tensor, rows: torch.Tensor, table_rows: torch.Tensor,
                       lens: torch.Tensor, num_slots: int, block_size: int, num_tokens: int,
                       who: Callable[[int], str]) -> None:
    """Raises ValueError naming (who(i)) the first query whose row or K/V reads fall outside q or the
    caches. rows, table_rows int64 [num_queries]; lens int32 [num_queries]."""
    num_seqs, max_blocks = block_tables.shape
    outside_batch = (table_rows < 0) | (table_rows >= num_seqs)
    if bool(outside_batch.any()):
        raise ValueError(f"native attention: block table row {int(table_rows[outside_batch][0])} is not one "
                         f"of the batch's {num_seqs}")
    needed = (lens.long() + block_size - 1) // block_size  # int64 [num_queries] blocks read
    tables = block_tables[table_rows]  # int32 [num_queries, max_blocks]
    num_blocks = num_slots // block_size
    read = torch.arange(max_blocks) < needed[:, None]  # bool [num_queries, max_blocks]
    outside_cache = read & ((tables < 0) | (tables >= num_blocks))
    problems = [  # (bool [num_queries], what query i does wrong)
        ((rows < 0) | (rows >= num_tokens), lambda i: f"query row {int(rows[i])} is outside q's "
                                                      f"{num_tokens} tokens"),
        (lens < 1, lambda i: f"context length {int(lens[i])} is < 1"),
        (needed > max_blocks, lambda i: f"context of {int(lens[i])} tokens needs {int(needed[i])} blocks "
                                        f"of {block_size}, its block table holds {max_blocks}"),
        (outside_cache.any(1), lambda i: f"block table names block {int(tables[i][outside_cache[i]][0])},"
                                         f" the cache holds {num_blocks} blocks of {block_size} slots")]
    for bad, says in problems:
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"native decode: {who(i)} {says(i)}")


def _raise_on_failure(name: str, status: int, q: torch.Tensor, k_cache: torch.Tensor,
                      block_size: int) -> None:
    if status != 0:
        raise RuntimeError(f"{name} failed ({status}): {_FAILURES.get(status, 'unknown status')} "
                           f"({q.shape[1]} heads, {k_cache.shape[0]} KV heads, head_dim {q.shape[2]}, "
                           f"block_size {block_size})")


def compiler() -> str:
    """$CC when set, else cc or gcc from PATH."""
    chosen = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not chosen:
        raise NativeBuildError("no C compiler: set CC or install cc/gcc")
    return chosen


def build(cache_dir: Path | None = None) -> Path:
    """The shared library for this source, compiler and CPU: reused from cache_dir (default
    $CONVEYOR_CACHE/native) or compiled into it. Raises NativeBuildError with the compiler's stderr."""
    cc = compiler()
    cache_dir = cache_root() / "native" if cache_dir is None else cache_dir
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, _compiler_version(cc).encode(), " ".join(FLAGS + LIBS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:24]
    target = cache_dir / f"paged_decode-{key}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=cache_dir)
    except OSError as error:
        raise NativeBuildError(f"cannot write the build cache {cache_dir}: {error}") from error
    os.close(handle)
    # The source goes in on stdin: the bytes compiled are the bytes hashed into the key, even if
    # a checkout replaces the file meanwhile.
    command = [cc, *FLAGS, "-x", "c", "-", "-o", partial, *LIBS]
    try:
        done = subprocess.run(command, input=source, capture_output=True, timeout=BUILD_TIMEOUT_S,
                              check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"{cc} failed to build {SOURCE.name} (exit {done.returncode}):\n"
                                   f"{done.stderr.decode(errors='replace').strip()}")
        os.replace(partial, target)  # atomic: concurrent builders each rename a complete file
    except subprocess.TimeoutExpired as error:
        raise NativeBuildError(f"building {SOURCE.name} took over {BUILD_TIMEOUT_S} s: "
                               f"{' '.join(command)}") from error
    except OSError as error:
        raise NativeBuildError(f"cannot build {target}: {error}") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("built native decode attention: %s", target)
    return target


@functools.cache
def load_paged_decode() -> PagedDecodeKernel:
    """Built (or reused) and loaded once per process. Raises NativeBuildError."""
    path = build()
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeBuildError(f"cannot load {path}: {error}") from error
    runtimes = _openmp_runtimes()
    cap = None
    if len(runtimes) > 1:
        log.warning("native decode attention runs one thread: two OpenMP runtimes are loaded (%s)",
                    ", ".join(sorted(runtimes)))
        cap = 1
    return PagedDecodeKernel(library, path, cap)


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"cannot run the C compiler {cc!r}: {error}") from error
    if done.returncode != 0:
        raise NativeBuildError(f"{cc} --version failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _cpu_flags() -> str:
    """The flags line of /proc/cpuinfo: what -march=native compiled for."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor()


def _openmp_runtimes() -> set[str]:
    """Distinct OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps
                    if _OPENMP_RUNTIME.fullmatch(line.rstrip().rsplit("/", 1)[-1])}
    except OSError:
        return set()
