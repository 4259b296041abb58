"""ggml block formats and GGUF files against the `gguf` package (gguf-py) as the oracle.

- Our dequantizers (`_kt_core.ggml_dequantize`) against gguf-py's, on blocks gguf-py quantized
  and on random block bytes (every bit pattern, finite fp16 scales) for every type we support.
- The committed `crates/kt-core/tests/data/gguf-py-experts.gguf`, which the Rust suite reads, is
  what gguf-py's GGUFWriter writes (regenerate it with `python tests/test_ggml_formats.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from kt_kernel import _kt_core

T = GGMLQuantizationType

SUPPORTED = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
]  # fmt: skip

# Byte offsets of the fp16 scale fields in one block (everything else is free bits).
F16_FIELDS = {
    "Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "IQ4_NL": [0], "IQ4_XS": [0],
    "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q6_K": [208],
}  # fmt: skip

FIXTURE = Path(__file__).resolve().parents[1] / "crates/kt-core/tests/data/gguf-py-experts.gguf"


def ours(name: str, data: bytes, n: int) -> np.ndarray:
    return np.frombuffer(_kt_core.ggml_dequantize(name, data, n), dtype="<f4")


def random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes of n values of type `name`: random bits with finite random fp16 scales."""
    qtype = T[name]
    block, size = GGML_QUANT_SIZES[qtype]
    if block == 1:
        values = rng.standard_normal(n).astype(np.float32)
        return quants.quantize(values, qtype).view(np.uint8).reshape(-1)
    raw = rng.integers(0, 256, size=(n // block, size), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scales = (rng.standard_normal(n // block) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", SUPPORTED)
def test_dequantizer_matches_gguf_on_random_blocks(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    n = 256 * 64
    raw = random_blocks(name, n, rng)
    want = quants.dequantize(raw, T[name]).reshape(-1).astype(np.float32)
    got = ours(name, raw.tobytes(), n)
    np.testing.assert_array_equal(got, want)  # the same f32 operations: bit for bit


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantizer_matches_gguf_on_gguf_quantized_data(name):
    """For the types gguf-py can quantize: its bytes, read by both dequantizers."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    q = quants.quantize(x, T[name])
    want = quants.dequantize(q, T[name]).reshape(-1).astype(np.float32)
    got = ours(name, q.tobytes(), x.size)
    np.testing.assert_array_equal(got, want)
    # And the round trip is as accurate as the format allows.
    err = np.linalg.norm(got - x.reshape(-1)) / np.linalg.norm(x)
    assert err < {"F32": 1e-7, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01}.get(name, 0.12)


def test_dequantize_errors():
    good = bytes(34)
    assert len(ours("q8_0", good, 32)) == 32  # names are case-insensitive
    with pytest.raises(ValueError, match="unknown ggml type"):
        _kt_core.ggml_dequantize("Q9_9", good, 32)
    with pytest.raises(ValueError, match="34 bytes, got 33"):
        _kt_core.ggml_dequantize("Q8_0", good[:33], 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        _kt_core.ggml_dequantize("Q8_0", good, 31)
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        _kt_core.ggml_dequantize("IQ2_XXS", bytes(66), 256)


# --- the GGUF file the Rust suite reads --------------------------------------------------------


def write_fixture(path: Path) -> None:
    """Every metadata type, alignment 64, stacked experts [E=2, n=4, k] in Q8_0 (gate, k=64,
    quantized by gguf-py) and Q4_K (up, k=256, random blocks), plus F32 `ref.*` tensors holding
    gguf-py's dequantization of each."""
    rng = np.random.default_rng(1234)
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_custom_alignment(64)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo ✓")
    w.add_uint64("test.u64", 2**40 + 3)
    w.add_int64("test.i64", -(2**40))
    w.add_float64("test.f64", 0.1)
    w.add_array("test.array_i32", [1, -2, 3])
    w.add_array("test.array_str", ["a", "bc", ""])
    w.add_array("test.array_f32", [0.5, -0.25])
    gate = (rng.standard_normal((2, 4, 64)) * 0.05).astype(np.float32)
    gate_q = quants.quantize(gate, T.Q8_0)
    up_q = random_blocks("Q4_K", 2 * 4 * 256, rng).reshape(2, 4, 144)
    w.add_tensor("blk.0.ffn_gate_exps.weight", gate_q, raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.ffn_up_exps.weight", up_q, raw_dtype=T.Q4_K)
    w.add_tensor("ref.blk.0.ffn_gate_exps.weight", quants.dequantize(gate_q, T.Q8_0))
    w.add_tensor("ref.blk.0.ffn_up_exps.weight", quants.dequantize(up_q, T.Q4_K))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reader_view(path: Path):
    """What gguf-py's reader sees: metadata values and (name, type, shape, bytes) per tensor."""
    r = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items()}
    tensors = [
        (t.name, int(t.tensor_type), [int(d) for d in t.shape], bytes(t.data.tobytes()))
        for t in r.tensors
    ]
    return fields, tensors


def test_committed_fixture_is_what_gguf_writer_writes(tmp_path):
    fresh = tmp_path / "fresh.gguf"
    write_fixture(fresh)
    if fresh.read_bytes() != FIXTURE.read_bytes():
        # A newer gguf-py may lay bytes out differently; the content must still agree.
        assert reader_view(fresh) == reader_view(FIXTURE)


def test_fixture_content_seen_by_gguf_reader():
    """The values the Rust test `gguf::tests::reads_a_file_written_by_gguf_py` expects."""
    fields, tensors = reader_view(FIXTURE)
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["general.alignment"] == 64
    assert fields["test.u64"] == 2**40 + 3
    assert fields["test.string"] == "héllo ✓"
    assert fields["test.array_i32"] == [1, -2, 3]
    by_name = {t[0]: t for t in tensors}
    _, qtype, shape, data = by_name["blk.0.ffn_up_exps.weight"]
    assert (qtype, shape) == (int(T.Q4_K), [256, 4, 2])
    ref = np.frombuffer(by_name["ref.blk.0.ffn_up_exps.weight"][3], dtype="<f4")
    np.testing.assert_array_equal(ours("Q4_K", data, ref.size), ref)
    _, qtype, shape, data = by_name["blk.0.ffn_gate_exps.weight"]
    assert (qtype, shape) == (int(T.Q8_0), [64, 4, 2])
    ref = np.frombuffer(by_name["ref.blk.0.ffn_gate_exps.weight"][3], dtype="<f4")
    np.testing.assert_array_equal(ours("Q8_0", data, ref.size), ref)


if __name__ == "__main__":
    # Regenerate the committed fixture.
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    target.parent.mkdir(parents=True, exist_ok=True)
    write_fixture(target)
    print(f"wrote {target} ({target.stat().st_size} bytes)")
