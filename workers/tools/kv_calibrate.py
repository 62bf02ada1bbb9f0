"""`tidepool models calibrate-kv NAME [--data FILE.jsonl] [--samples N]`: a model's KV cache scales and the accuracy
each quantized dtype keeps with them (workers/engine/kv_calibration.py), stored in the model folder
(kv_cache_scales.json, which its engines read) and in the registry (which the Models page shows and the workers pass
on).

Text: an operator's JSONL (one object a line: "text", "prompt", or "messages" as chat turns), else the built-in set
shipped with the package (data/corpus.txt, by paragraph). Texts are cut into samples of at most SAMPLE_TOKENS tokens;
the last HELDOUT_SHARE of the texts are held out for the accuracy figures and never calibrate.
"""
import json
from pathlib import Path

BUILTIN = Path(__file__).parent / "data" / "corpus.txt"
SAMPLE_TOKENS = 64
HELDOUT_SHARE = 0.2
HELDOUT_TOKENS = 256        # held-out texts are joined into sequences this long (attention over a longer context)


def builtin_texts() -> list[str]:
    return [line.strip() for line in BUILTIN.read_text().splitlines() if line.strip()]


def jsonl_texts(path: str | Path) -> list[str]:
    texts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row, str):
            texts.append(row)
        elif isinstance(row.get("text") or row.get("prompt"), str):
            texts.append(row.get("text") or row.get("prompt"))
        elif isinstance(row.get("messages"), list):
            texts.append("\n".join(str(m.get("content", "")) for m in row["messages"]))
        else:
            raise ValueError(f"{path}:{n}: expected a string or an object with text, prompt or messages")
    return texts


def split(texts: list[str], tokenizer, samples: int) -> tuple[list[list[int]], list[list[int]]]:
    """(calibration samples, held-out sequences) of token ids."""
    if len(texts) < 2:
        raise ValueError("calibration needs at least two texts (some are held out)")
    cut = len(texts) - max(1, int(len(texts) * HELDOUT_SHARE))
    calib = []
    for text in texts[:cut]:
        ids = tokenizer.encode(text)
        calib += [ids[i:i + SAMPLE_TOKENS] for i in range(0, len(ids), SAMPLE_TOKENS)]
    joined = [t for text in texts[cut:] for t in tokenizer.encode(text)]
    heldout = [joined[i:i + HELDOUT_TOKENS] for i in range(0, len(joined), HELDOUT_TOKENS)]
    return calib[:samples], [h for h in heldout if len(h) > 1]


def calibrate_folder(folder: str | Path, data: str | None = None, samples: int = 1000,
                     dtype: str | None = None) -> dict:
    """Calibrate the model in `folder`, write its kv_cache_scales.json, return the record."""
    from tidepool.workers.engine.kv_calibration import calibrate
    from tidepool.workers.engine.kv_scales import judge, save_calibration
    from tidepool.workers.engine.tokenizer import Tokenizer
    texts = jsonl_texts(data) if data else builtin_texts()
    calib, heldout = split(texts, Tokenizer(folder), samples)
    record = calibrate(str(folder), calib, heldout, dtype)
    record["data"] = str(Path(data).resolve()) if data else "built-in"
    judge(record)
    save_calibration(folder, record)
    return record
