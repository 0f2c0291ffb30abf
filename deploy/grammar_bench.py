"""Grammar engines side by side on one tokenizer: import footprint, compile, mask and advance times.

Each engine runs in a fresh child process, so what it drags in (torch? transformers?) and its
memory are its own. Engines that are not installed are reported as such, not failed. Run:

    python -m deploy.grammar_bench --model-dir ~/.cache/conveyor/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("llguidance", "xgrammar", "outlines_core")
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "conveyor" / "models" / "SmolLM2-135M-Instruct"

# A typical extraction schema: typed fields, an enum, an array, one optional field.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "role", "tags", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "role": "admin",
            "tags": ["math", "poetry", "engines"], "active": True, "score": 9.5}


def byte_level_token_bytes(tokenizer_json: dict[str, Any]) -> dict[int, bytes]:
    """Each vocabulary entry's bytes under GPT-2's byte-to-unicode alphabet (ByteLevel models)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    codepoints = printable + [256 + i for i in range(256 - len(printable))]
    byte_of = dict(zip(map(chr, codepoints), [*printable, *sorted(set(range(256)) - set(printable))]))
    table = {i: bytes(byte_of[c] for c in piece) for piece, i in tokenizer_json["model"]["vocab"].items()}
    for added in tokenizer_json.get("added_tokens", []):
        table[added["id"]] = added["content"].encode()
    return table


class _NumpyRow:
    def allocate(self, vocab_size: int) -> Any:
        import numpy as np
        return np.zeros(-(-vocab_size // 32), dtype=np.int32)  # int32 [ceil(vocab / 32)]


class _Llguidance(_NumpyRow):
    def __init__(self, tokenizer_json: str, eos_id: int, vocab_size: int) -> None:
        import llguidance
        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, row: Any) -> None:
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, matcher: Any, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def accepting(self, matcher: Any) -> bool:
        return matcher.is_accepting()


class _Xgrammar:
    def __init__(self, tokenizer_json: str, eos_id: int, vocab_size: int) -> None:
        import xgrammar
        self.xgr = xgrammar
        vocab = json.loads(tokenizer_json)["model"]["vocab"]
        encoded = [""] * vocab_size
        for piece, i in vocab.items():
            encoded[i] = piece
        for added in json.loads(tokenizer_json).get("added_tokens", []):
            encoded[added["id"]] = added["content"]
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=[eos_id])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.eos_id = eos_id

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, vocab_size: int) -> Any:
        return self.xgr.allocate_token_bitmask(1, vocab_size)  # xgrammar fills torch tensors only

    def fill(self, matcher: Any, row: Any) -> None:
        matcher.fill_next_token_bitmask(row, 0)

    def advance(self, matcher: Any, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def accepting(self, matcher: Any) -> bool:
        return matcher.accept_token(self.eos_id)  # True exactly when the grammar may end here


class _OutlinesCore(_NumpyRow):
    def __init__(self, tokenizer_json: str, eos_id: int, vocab_size: int) -> None:
        import outlines_core
        self.oc = outlines_core
        parsed = json.loads(tokenizer_json)
        special = {a["id"] for a in parsed.get("added_tokens", []) if a.get("special")}
        by_bytes: dict[bytes, list[int]] = {}
        for i, piece in byte_level_token_bytes(parsed).items():
            if i not in special:
                by_bytes.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos_id, by_bytes)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, row: Any) -> None:
        matcher.write_mask_into(row.ctypes.data, row.size, 4)

    def advance(self, matcher: Any, token_id: int) -> bool:
        matcher.advance(token_id)
        return True

    def accepting(self, matcher: Any) -> bool:
        return matcher.is_finished()


_ADAPTERS = {"llguidance": _Llguidance, "xgrammar": _Xgrammar, "outlines_core": _OutlinesCore}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _summary_us(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {"mean_us": round(statistics.fmean(ordered) * 1e6, 1),
            "p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1)}


def measure(engine: str, model_dir: Path, repeat: int, batch: int) -> dict[str, Any]:
    """One engine in this process: run it in a fresh interpreter so its imports are its own."""
    import tokenizers
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    backend = tokenizers.Tokenizer.from_str(tokenizer_json)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    eos_id = backend.token_to_id(json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"])
    token_ids = backend.encode(json.dumps(DOCUMENT), add_special_tokens=False).ids
    before = set(sys.modules)
    rss_before, start = _rss_bytes(), time.perf_counter()
    importlib.import_module(engine)
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    adapter = _ADAPTERS[engine](tokenizer_json, eos_id, vocab_size)
    tokenizer_s = time.perf_counter() - start
    loaded = {name.split(".")[0] for name in set(sys.modules) - before}
    compile_s = []
    for _ in range(repeat):
        start = time.perf_counter()
        compiled = adapter.compile(SCHEMA)
        compile_s.append(time.perf_counter() - start)
    mask_s, advance_s, matcher_s = [], [], []
    row = adapter.allocate(vocab_size)
    for _ in range(repeat):
        start = time.perf_counter()
        matcher = adapter.matcher(compiled)
        matcher_s.append(time.perf_counter() - start)
        for token_id in token_ids:
            start = time.perf_counter()
            adapter.fill(matcher, row)
            mask_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            ok = adapter.advance(matcher, token_id)
            advance_s.append(time.perf_counter() - start)
            assert ok, f"{engine} rejected token {token_id} of a valid document"
        adapter.fill(matcher, row)
        assert adapter.accepting(matcher), f"{engine} does not accept the finished document"
    step_s = _step_mask_s(adapter, compiled, token_ids, vocab_size, batch)
    return {"engine": engine, "version": importlib.metadata.version(engine.replace("_", "-")),
            "vocab_size": vocab_size, "document_tokens": len(token_ids),
            "imports_torch": "torch" in loaded, "imports_transformers": "transformers" in loaded,
            "top_level_modules_loaded": len(loaded), "rss_added_mib": round((_rss_bytes() - rss_before) / 2**20, 1),
            "import_s": round(import_s, 3), "tokenizer_setup_s": round(tokenizer_s, 3),
            "compile_ms": round(statistics.median(compile_s) * 1e3, 2),
            "first_compile_ms": round(compile_s[0] * 1e3, 2),
            "new_matcher_us": _summary_us(matcher_s)["p50_us"],
            "mask_per_token": _summary_us(mask_s), "advance_per_token": _summary_us(advance_s),
            f"step_mask_ms_{batch}_rows": round(statistics.median(step_s) * 1e3, 2)}


def _step_mask_s(adapter: Any, compiled: Any, token_ids: list[int], vocab_size: int,
                 batch: int) -> list[float]:
    """One step's masks for `batch` sequences spread over the document (row by row, one thread),
    each state's mask computed for the first time, as in serving (no mask reused)."""
    rows = [adapter.allocate(vocab_size) for _ in range(batch)]
    samples = []
    for _ in range(5):
        matchers = []
        for i in range(batch):
            matcher = adapter.matcher(compiled)
            for token_id in token_ids[:i * len(token_ids) // batch]:
                adapter.advance(matcher, token_id)
            matchers.append(matcher)
        start = time.perf_counter()
        for matcher, row in zip(matchers, rows):
            adapter.fill(matcher, row)
        samples.append(time.perf_counter() - start)
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="constrained sequences in one step")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.model_dir, args.repeat, args.batch)))
        return
    for engine in args.engines:
        if importlib.util.find_spec(engine) is None:
            print(json.dumps({"engine": engine, "error": "not installed"}))
            continue
        child = subprocess.run([sys.executable, "-m", "deploy.grammar_bench", "--child", engine,
                                "--model-dir", str(args.model_dir), "--repeat", str(args.repeat), "--batch", str(args.batch)],
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        lines = child.stdout.strip().splitlines()
        print(lines[-1] if child.returncode == 0 and lines else
              json.dumps({"engine": engine, "error": child.stderr.strip()[-400:]}))


if __name__ == "__main__":
    main()
