"""A pack's no-space error states its scratch need without under-stating it (issue 36, item 4).

Before: a unit none of whose scratch had come back was counted at its input size, but a
tokenised unit's decoded Arrow form holds its token ids beside the text: the byte tokenizer's is
3x its input (11.5 MB said, 33 MB needed), so freeing what the message asked for failed again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import PackInputError


def docs(path: Path) -> Path:
    with open(path, "w") as f:  # one 11.5 MB unit
        for i in range(20000):
            f.write(json.dumps({"id": i, "text": f"doc {i} " + "lorem ipsum dolor sit amet " * 20}) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("keep_text", [True, False])
def test_the_scratch_a_tokenised_pack_says_it_needs_covers_its_decoded_unit(tmp_path, small_tmpfs, keep_text):
    src = docs(tmp_path / "docs.jsonl")
    roomy = tierflow.pack([src], tmp_path / "roomy", workers=2, tokenizer="bytes", keep_text=keep_text)
    decoded = sum(s.decoded_bytes for s in roomy.manifest.shards)  # the one unit's decoded form
    out = small_tmpfs("8m") / "out"
    with pytest.raises(PackInputError, match=rf"{out}: no space left") as caught:
        tierflow.pack([src], out, workers=2, tokenizer="bytes", keep_text=keep_text)
    said = float(re.search(r"needs about ([\d.]+) MB of scratch", str(caught.value)).group(1))
    assert said * 1e6 >= decoded, (said, decoded / 1e6)  # before: 11.5 MB said for 33 MB (with the text)
    assert said * 1e6 <= 4 * src.stat().st_size  # an upper bound, not a wild one
