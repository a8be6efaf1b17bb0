import json

from hybrid_rl.data.gsm8k import convert_row, main


def test_gsm8k_rows_become_chat_prompts_with_the_number_after_hashes(tmp_path):
    row = {"question": "Natalia sold 48 clips ... How many?", "answer": "She sold 48/2 = 24.\n#### 1,072"}
    out = convert_row(row)
    assert out["ground_truth"] == "1072"
    assert out["prompt"][0]["role"] == "user" and out["prompt"][0]["content"].startswith("Natalia sold 48")
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps(row) + "\n")
    main([str(src), str(tmp_path / "out.jsonl")])
    assert json.loads((tmp_path / "out.jsonl").read_text())["ground_truth"] == "1072"
