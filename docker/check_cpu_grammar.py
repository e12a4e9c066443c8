"""Build-time check that grammar masks work on CPU in this image (the CPU image leaves triton out).

Applies an xgrammar token bitmask to CPU logits, the call the engine makes for constrained
decoding; exits 0 when xgrammar is not a dependency at all.
"""

from __future__ import annotations

import importlib.util
import sys


def main() -> int:
    if importlib.util.find_spec("xgrammar") is None:
        print("xgrammar not installed: nothing to check")
        return 0
    import torch
    import xgrammar

    logits = torch.zeros(1, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)          # every token disallowed
    bitmask[0, 0] = 1                                       # but token 0
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    if logits[0, 0].item() != 0.0 or logits[0, 1:].max().item() != float("-inf"):
        print(f"unexpected masked logits: {logits}", file=sys.stderr)
        return 1
    print("xgrammar applies token masks on CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
