"""`extract_hidden_states` (vLLM's name): while serving normally, the verifier writes each finished request's
token ids and the target's hidden states to a safetensors file, the data EAGLE heads are trained on.

One file per request, `<output_dir>/<request id>.safetensors`:
- `token_ids`: int64 [tokens], the prompt then the output;
- `hidden_states`: float16 [tokens - 1, layers, hidden], row i the target's states after token i, for the layers
  in the metadata's `layers` (the verifier's served layers, services/modeling/hidden_layers.py; -1: the final,
  normed one). The last token has none: the target never ran on it (generation stopped after sampling it).
The file's metadata also holds `num_prompt_tokens`. A request aborted before its prefill finished writes nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from services.modeling.hidden_layers import FINAL_ONLY


def file_for(output_dir: Path, request_id: str) -> Path:
    """The request's file; ids are sanitised into file names (a client-chosen id never escapes the folder)."""
    return output_dir / (re.sub(r"[^A-Za-z0-9._-]", "_", request_id)[:200] + ".safetensors")


def write_request_states(output_dir: Path, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                         states: torch.Tensor, layers: Sequence[int] = FINAL_ONLY) -> Path | None:
    """states: [n, len(layers) * hidden], the served layers side by side, as the runner returns them."""
    from safetensors.torch import save_file

    rows = min(states.shape[0], len(token_ids) - 1)
    if rows < 1:
        return None
    path = file_for(output_dir, request_id)
    save_file({"token_ids": torch.tensor(token_ids[: rows + 1], dtype=torch.int64),
               "hidden_states": states[:rows].reshape(rows, len(layers), -1).to(torch.float16).contiguous()},
              str(path), metadata={"num_prompt_tokens": str(num_prompt_tokens), "layers": json.dumps(list(layers))})
    return path
