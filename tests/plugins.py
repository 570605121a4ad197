"""A throwaway drafter method installed the way a third-party package would install one: a module plus a
`*.dist-info` with an entry point in the group "specserve.drafter_methods", on a folder put on sys.path /
PYTHONPATH. Tests use it to show that a method needs nothing but its module and one registry line, options of its
own included."""

from __future__ import annotations

import textwrap
from pathlib import Path

from services.common.drafter_methods import ENTRY_POINT_GROUP

THROWAWAY_METHOD = "throwaway"

_MODULE = '''
"""Proposes the token that followed the last occurrence of the last token (a 1-gram lookup), K times over, or
at most throwaway_max_draft times."""

from pydantic import Field

from services.common.method_options import MethodOptions
from services.common.proposer import Draft


class ThrowawayOptions(MethodOptions):
    throwaway_max_draft: int = Field(64, ge=1)


OPTIONS = ThrowawayOptions


class ThrowawayProposer:
    method = "throwaway"

    def __init__(self, options):
        self.options = options

    async def propose(self, inputs):
        drafts = []
        for item in inputs:
            tokens = list(item.token_ids)
            draft = []
            for _ in range(min(item.num_speculative_tokens, self.options.throwaway_max_draft)):
                last = (tokens + draft)[-1]
                earlier = [i for i, t in enumerate(tokens[:-1]) if t == last]
                if not earlier:
                    break
                draft.append(tokens[earlier[-1] + 1])
            drafts.append(Draft(draft))
        return drafts

    def release(self, seq_id):
        pass


def build_proposer(config):
    return ThrowawayProposer(config.options)
'''


def install_throwaway_method(folder: Path) -> Path:
    """Write the plug-in into `folder` (to be put on sys.path / PYTHONPATH); returns the folder."""
    (folder / "specserve_throwaway_method.py").write_text(textwrap.dedent(_MODULE))
    dist_info = folder / "specserve_throwaway-0.1.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: specserve-throwaway\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{THROWAWAY_METHOD} = specserve_throwaway_method\n"
    )
    return folder
