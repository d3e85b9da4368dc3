"""benchmarks/qlora_memory.py runs on CPU at a tiny size: the QLoRA state between steps holds
the 4-bit base (no dequantized copy) and is far smaller than the bf16 full fine-tune's."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import qlora_memory  # noqa: E402


def test_qlora_memory_tiny(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = qlora_memory.main(["--tiny", "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    q, full = {r["variant"]: r for r in rows}["qlora"], {r["variant"]: r for r in rows}["bf16_full"]
    # nf4: 4-bit codes + one float32 absmax per 64 elements = 4.5 bits against bf16's 16
    assert q["base_bytes"] == q["dense_params"] * 9 // 16
    assert full["base_bytes"] == full["bf16_copy_bytes"] == 2 * full["dense_params"]
    # what stays between steps beyond the 4-bit base is adapters, optimizer and norms:
    # no room for a dequantized copy of the base
    assert q["state_bytes"] - q["base_bytes"] < q["bf16_copy_bytes"] / 2
    assert q["state_bytes"] < full["state_bytes"] / 3
    assert q["trained_bytes"] < full["trained_bytes"] / 4
    for r in rows:  # the steps train
        assert r["losses"][-1] < r["losses"][0], r
        assert r["temp_bytes"] > 0 and r["argument_bytes"] >= r["state_bytes"]
    text = capsys.readouterr().out
    assert "| QLoRA (nf4 base, rank 4) |" in text and "bf16 full fine-tune" in text
