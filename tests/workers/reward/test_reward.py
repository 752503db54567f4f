"""The reward worker's decoding: transformers' text, without importing transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from workers.reward.worker import load_decoder

ROOT = Path(__file__).resolve().parents[3]


def test_the_decoder_gives_transformers_text_for_any_ids(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    decode = load_decoder(str(tiny_model_dir))
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    assert special
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))] + [rng.choice(special)]
        rng.shuffle(ids)
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def imports_transformers(tokenizer_dir: Path) -> bool:
    """Whether decoding with ``tokenizer_dir`` imports transformers (a fresh interpreter)."""
    code = f"import sys; from workers.reward.worker import load_decoder; load_decoder({str(tokenizer_dir)!r})([1, 2]); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.split()[-1] == "True"


def test_transformers_is_imported_only_for_a_tokenizer_that_cleans_up_spaces(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert not imports_transformers(tiny_model_dir)  # ~5 s less at each reward worker start
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "clean_up_tokenization_spaces": True}))
    assert imports_transformers(tmp_path)  # transformers decides what its clean-up does
    ids = AutoTokenizer.from_pretrained(tmp_path).encode("yes , it is . right ?")
    assert load_decoder(str(tmp_path))(ids) == AutoTokenizer.from_pretrained(tmp_path).decode(ids, skip_special_tokens=True)
